"""Requests are decoded by the daemon, not by grpc: a payload that is not a valid
message (corrupt wire format, a string field that is not UTF-8) is answered
INVALID_ARGUMENT instead of grpc's UNKNOWN, and logged at most once a minute
per peer address, without a traceback (a client sending garbage in a loop must
not fill the disk with logs).

:class:`DecodeInterceptor` swaps each handler's deserializer for the identity
and decodes in the handler itself; the servicers see the same messages.

It also writes the responses of streaming calls itself (``context.write``) instead
of handing grpc an async generator: when a client goes away while a response is
being sent (a slow consumer that cancels, a killed trainer or ``logs --follow``),
grpc's send fails before it has noticed the cancellation, and for a generator it
logs that at ERROR with a traceback, once per such call. Written here, the failed
send just ends the call (logged at DEBUG) and closes the servicer's generator.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

__all__ = ["DecodeInterceptor", "RateLimitedLog"]

log = logging.getLogger("hetpilot.daemon")


def _send_failed_types() -> tuple[type[BaseException], ...]:
    """What grpc.aio raises from ``context.write`` when the call ended under it (the
    client cancelled or went away): its core's ExecuteBatchError, not public API."""
    with contextlib.suppress(ImportError):
        found = getattr(importlib.import_module("grpc._cython.cygrpc"), "ExecuteBatchError", None)
        if isinstance(found, type) and issubclass(found, BaseException):
            return (found,)
    return ()


_SEND_FAILED = _send_failed_types()


async def _write_all(responses: Any, context: grpc.aio.ServicerContext, method: str) -> None:
    """Send each response of ``responses`` (an async iterator; a coroutine, for handlers
    that write themselves, such as health's Watch, is awaited); when a send fails
    because the call is over, stop quietly and close ``responses``."""
    if inspect.isawaitable(responses):
        await responses
        return
    try:
        async for item in responses:
            try:
                await context.write(item)
            except _SEND_FAILED:
                log.debug("%s: the client went away while a response was sent", method)
                return
    finally:
        aclose = getattr(responses, "aclose", None)
        if aclose is not None:
            await aclose()  # the servicer's finally blocks run now, not at collection


class RateLimitedLog:
    """``warn(key, message)`` logs at most once per ``period_s`` for each key."""

    def __init__(self, period_s: float = 60.0, max_keys: int = 4096) -> None:
        self.period_s = period_s
        self.max_keys = max_keys
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def warn(self, key: str, message: str, *args: object) -> bool:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.period_s:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        if len(self._last) >= self.max_keys:  # many peers: forget the oldest half
            for k in sorted(self._last, key=self._last.__getitem__)[: self.max_keys // 2]:
                self._last.pop(k, None)
                self._dropped.pop(k, None)
        dropped = self._dropped.pop(key, 0)
        self._last[key] = now
        log.warning(message + (f" ({dropped} more like it not logged)" if dropped else ""),
                    *args)
        return True


class _Requests:
    """The decoded requests of a stream, read with ``context.read`` (one async
    generator less per message than iterating grpc's request iterator and decoding
    in a generator of our own: an agent's report stream carries one a second)."""

    def __init__(self, interceptor: DecodeInterceptor, decode: Callable[[bytes], Any],
                 context: grpc.aio.ServicerContext, method: str) -> None:
        self._interceptor, self._decode, self._context, self._method = (
            interceptor, decode, context, method)

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Any:
        raw = await self._context.read()
        if raw is grpc.aio.EOF:  # type: ignore[attr-defined]  # not in grpc-stubs
            raise StopAsyncIteration
        return await self._interceptor._decode(raw, self._decode, self._context, self._method)


def _peer_host(context: grpc.aio.ServicerContext) -> str:
    peer = context.peer() or "unknown"
    return peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer


class DecodeInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, on_reject: Callable[[], None] | None = None) -> None:
        self._on_reject = on_reject
        self._log = RateLimitedLog()

    async def _decode(self, raw: bytes, decode: Callable[[bytes], Any],
                      context: grpc.aio.ServicerContext, method: str) -> Any:
        try:
            return decode(raw)
        except Exception as exc:  # DecodeError, and whatever a broken payload raises
            if self._on_reject is not None:
                self._on_reject()
            self._log.warn(_peer_host(context), "undecodable request to %s from %s: %s",
                           method, _peer_host(context), str(exc)[:200])
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request is not a valid message for {method}")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler: Any = await continuation(details)  # the stubs type its behaviours as sync
        decode = getattr(handler, "request_deserializer", None)
        if handler is None or decode is None:
            return handler
        method = details.method
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await inner_uu(await self._decode(raw, decode, context, method), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, None, serialize)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> None:
                request = await self._decode(raw, decode, context, method)
                await _write_all(inner_us(request, context), context, method)

            return grpc.unary_stream_rpc_method_handler(unary_stream, None, serialize)
        if handler.stream_stream is not None:
            inner_ss = handler.stream_stream

            async def stream_stream(raws: AsyncIterator[bytes],
                                    context: grpc.aio.ServicerContext) -> None:
                requests = _Requests(self, decode, context, method)
                await _write_all(inner_ss(requests, context), context, method)

            return grpc.stream_stream_rpc_method_handler(stream_stream, None, serialize)
        return handler  # stream-unary: none in this API
