"""Per-stage op orders of spec section 5.2 and the in-flight counts of 5.4.

An op is ``(is_backward, microbatch)``; ``(False, 3)`` is F3, ``(True, 3)`` B3.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from itertools import accumulate
from operator import itemgetter
from typing import ParamSpec, TypeVar

from .errors import InvalidPlanError

__all__ = ["Op", "custom_order", "format_order", "inflight", "order", "warmup_order"]

Op = tuple[bool, int]
P = ParamSpec("P")
R = TypeVar("R")

MEMO_MAX_OPS = 4096
"""Orders longer than this (2048 microbatches) are rebuilt on each call rather than
kept: thousands of memo entries of 10^5-op tuples would hold gigabytes."""


def _memo_short(maxsize: int, ops: Callable[..., int]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """lru_cache for calls whose order has at most MEMO_MAX_OPS ops (``ops(*args)``)."""
    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            if ops(*args) <= MEMO_MAX_OPS:
                return cached(*args, **kwargs)  # type: ignore[arg-type,no-any-return]
            return fn(*args, **kwargs)

        return call
    return wrap


class _Order(tuple):  # type: ignore[type-arg]
    """An op order that knows its in-flight peak (:func:`inflight` reads it instead of
    scanning): the built-in and warm-up orders, which the planner and the baselines
    build only to ask for it. Equal to, and hashed as, the plain tuple of its ops."""

    peak: int

    def __new__(cls, ops: list[Op], peak: int) -> _Order:
        self = super().__new__(cls, ops)
        self.peak = peak
        return self

    def __reduce__(self) -> tuple[object, ...]:
        return (_Order, (list(self), self.peak))


_OPS_LOCK = threading.Lock()
_OPS: tuple[tuple[Op, ...], tuple[Op, ...]] = ((), ())
"""``(False, k)`` and ``(True, k)`` for k below their length: the ops every order shares
(one tuple of both, so that a reader never pairs old forwards with new backwards)."""


def _op_tables(m: int) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """The shared forward and backward ops of microbatches 0 .. m - 1 (or more)."""
    global _OPS
    tables = _OPS
    if len(tables[0]) < m:
        with _OPS_LOCK:
            tables = _OPS
            if len(tables[0]) < m:
                size = max(m, 2 * len(tables[0]), 64)
                tables = _OPS = (tuple((False, k) for k in range(size)),
                                 tuple((True, k) for k in range(size)))
    return tables


@_memo_short(4096, lambda schedule, num_stages, stage, microbatches: 2 * microbatches)
def order(schedule: str, num_stages: int, stage: int, microbatches: int) -> tuple[Op, ...]:
    """The op order of a built-in schedule on one stage."""
    m = microbatches
    if schedule == "gpipe":
        fwd, bwd = _op_tables(m)
        return _Order([*fwd[:m], *bwd[:m]], m)
    if schedule == "1f1b":
        return warmup_order(num_stages - stage - 1, m)
    raise ValueError(f"no built-in order for schedule {schedule!r}")


@_memo_short(4096, lambda warmup, microbatches: 2 * microbatches)
def warmup_order(warmup: int, microbatches: int) -> tuple[Op, ...]:
    """w forwards, then alternate one forward and one backward, then drain.

    ``warmup = S - j - 1`` is 1f1b; ``warmup >= M`` is gpipe; values between
    are the "eager 1f1b" custom orders the planner tries when extra in-flight
    microbatches hide transfer latency.
    """
    m = microbatches
    w = max(0, min(warmup, m))
    fwd, bwd = _op_tables(m)
    # F0 .. F(w-1), then F(w+i), B(i) for i < M - w, then B(M-w) .. B(M-1); by slices
    # of the shared ops (orders of thousands of microbatches are rebuilt on each call)
    ops: list[Op] = [*fwd[:w], *[fwd[0]] * (2 * (m - w)), *bwd[m - w:m]] if m else []
    ops[w:2 * m - w:2] = fwd[w:m]
    ops[w + 1:2 * m - w:2] = bwd[:m - w]
    return _Order(ops, min(w + 1, m))


def custom_order(ops: tuple[str, ...], microbatches: int, field: str) -> tuple[Op, ...]:
    """Parse and check a custom order: each Fk and Bk once, k < M, Fk before Bk."""
    found = _valid_order(ops, microbatches)
    if found is not None:
        return found
    return _check_order(ops, microbatches, field)  # raises, naming the field


@_memo_short(16384, lambda ops, microbatches: len(ops))
def _valid_order(ops: tuple[str, ...], microbatches: int) -> tuple[Op, ...] | None:
    """The parsed order if it is valid, else None (memoised: the planner scores the
    same orders on many groups and candidates)."""
    try:
        return _check_order(ops, microbatches, "")
    except (InvalidPlanError, ValueError, IndexError):
        return None


def _check_order(ops: tuple[str, ...], microbatches: int, field: str) -> tuple[Op, ...]:
    parsed: list[Op] = []
    seen: set[Op] = set()
    for i, text in enumerate(ops):
        op = (text[0] == "B", int(text[1:]))
        if op[1] >= microbatches:
            raise InvalidPlanError(
                f"{field}[{i}]", f"{text} names microbatch {op[1]}, but the group has {microbatches}"
            )
        if op in seen:
            raise InvalidPlanError(f"{field}[{i}]", f"{text} appears twice")
        if op[0] and (False, op[1]) not in seen:
            raise InvalidPlanError(f"{field}[{i}]", f"B{op[1]} comes before F{op[1]}")
        seen.add(op)
        parsed.append(op)
    if len(parsed) != 2 * microbatches:
        missing = [
            f"{'B' if b else 'F'}{k}" for k in range(microbatches) for b in (False, True)
            if (b, k) not in seen
        ]
        raise InvalidPlanError(field, f"misses {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    return tuple(parsed)


@_memo_short(4096, len)
def format_order(ops: tuple[Op, ...]) -> tuple[str, ...]:
    return tuple(f"{'B' if b else 'F'}{k}" for b, k in ops)


def inflight(ops: tuple[Op, ...]) -> int:
    """Most forwards run on a stage without their backward (spec 5.4)."""
    return ops.peak if isinstance(ops, _Order) else _inflight(ops)


@_memo_short(16384, len)
def _inflight(ops: tuple[Op, ...]) -> int:
    # the running count of forwards less backwards, in C: +1 per F, -1 per B
    live = accumulate(map(_STEP.__getitem__, map(_IS_BWD, ops)))
    return max(0, max(live, default=0))


_IS_BWD = itemgetter(0)
_STEP = {False: 1, True: -1}
