"""Bearer-token authentication, checked in one server interceptor.

JobService needs an owner's token; AgentService and TrainerService need the
cluster token; health and reflection are open (probes and grpcurl). The
servicers ask :meth:`Authenticator.owner` who the caller is; the interceptor
has already refused anyone else with UNAUTHENTICATED.
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from .config import AuthConfig

__all__ = ["ANONYMOUS", "AuthInterceptor", "Authenticator"]

ANONYMOUS = "anonymous"
_OWNER_PREFIX = "/hetpilot.v1.JobService/"
_CLUSTER_PREFIXES = ("/hetpilot.v1.AgentService/", "/hetpilot.v1.TrainerService/")
#: Methods whose handlers are not unary-unary (the refusal must match the shape).
_STREAMING = {
    "/hetpilot.v1.AgentService/Report": "stream_stream",
    "/hetpilot.v1.JobService/WatchPlans": "unary_stream",
    "/hetpilot.v1.TrainerService/WatchPlans": "unary_stream",
}


def _bearer(metadata: Iterable[tuple[str, Any]] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            if text[:7].lower() == "bearer ":
                return text[7:].strip()
    return ""


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        self._owners = [(token.encode(), owner) for owner, token in config.owner_tokens.items()]
        self._cluster = config.cluster_token.encode()
        self.open = config.allow_unauthenticated

    def owner(self, metadata: Iterable[tuple[str, Any]] | None) -> str | None:
        if self.open:
            return ANONYMOUS
        token = _bearer(metadata).encode()
        found = None
        for candidate, owner in self._owners:
            if token and hmac.compare_digest(candidate, token):
                found = owner
        return found

    def is_cluster(self, metadata: Iterable[tuple[str, Any]] | None) -> bool:
        if self.open:
            return True
        token = _bearer(metadata).encode()
        return bool(self._cluster) and hmac.compare_digest(self._cluster, token)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


async def _deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
    yield  # pragma: no cover - makes this an async generator


async def _deny_bidi(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    # Read the first request before refusing: a two-way stream ended before its first
    # read races in grpc's core and then answers INTERNAL (about 1 call in 4) instead.
    with contextlib.suppress(Exception):
        await anext(aiter(requests), None)
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
    yield  # pragma: no cover - makes this an async generator


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: Authenticator, on_reject: Callable[[], None] | None = None) -> None:
        self._auth = auth
        self._on_reject = on_reject

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method
        metadata = details.invocation_metadata
        if method.startswith(_OWNER_PREFIX):
            ok = self._auth.owner(metadata) is not None
        elif method.startswith(_CLUSTER_PREFIXES):
            ok = self._auth.is_cluster(metadata)
        else:
            ok = True
        if ok:
            return await continuation(details)
        if self._on_reject is not None:
            self._on_reject()
        shape = _STREAMING.get(method)
        if shape == "stream_stream":
            return grpc.stream_stream_rpc_method_handler(_deny_bidi)
        if shape == "unary_stream":
            return grpc.unary_stream_rpc_method_handler(_deny_stream)
        return grpc.unary_unary_rpc_method_handler(_deny)
