"""The planner's process-wide memos, and the one switch that forgets them all.

Planning the same group, cut or LP again is the common case: a controller
re-plans every job every slot, and one search tries the same group in many
structures and device subsets. So the modules that plan keep memos keyed on
every number an answer depends on, which stay valid across calls. Each module
registers how to empty its own (:func:`register`), so :func:`clear_memos`
(benchmarks that time cold searches, tests of concurrency) never reaches into
another module's private state.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["BoundedMemo", "PerModel", "clear_memos", "register"]

_K = TypeVar("_K")
_V = TypeVar("_V")

_CLEARERS: list[Callable[[], None]] = []
_LOCK = threading.Lock()


def register(clear: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`clear_memos` call ``clear`` (a memo's own way to empty itself)."""
    with _LOCK:
        _CLEARERS.append(clear)
    return clear


def clear_memos() -> None:
    """Forget every memoised cut, makespan, LP solution and search of the process."""
    with _LOCK:
        clearers = list(_CLEARERS)
    for clear in clearers:
        clear()


class BoundedMemo(Generic[_K, _V]):
    """A memo of at most ``size`` entries that forgets the least recently used.

    Keys hold every number a value depends on, so entries stay valid across calls;
    registered with :func:`clear_memos` on creation."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.data: OrderedDict[_K, _V] = OrderedDict()
        register(self.data.clear)

    def get(self, key: _K, make: Callable[[], _V]) -> _V:
        try:
            self.data.move_to_end(key)
            return self.data[key]
        except KeyError:
            value = self.data[key] = make()
            if len(self.data) > self.size:
                self.data.popitem(last=False)
            return value


class PerModel(Generic[_K, _V]):
    """A dict of values per model object (and an optional extra key such as the
    microbatch size), for memos of pure functions of a model: keyed by the model's id
    with the model held, so the id stays its own; at most ``models`` tables of at most
    ``size`` entries (a full one is emptied); registered with :func:`clear_memos`."""

    def __init__(self, models: int = 64, size: int = 65536) -> None:
        self.models = models
        self.size = size
        self.tables: dict[tuple[int, object], tuple[object, dict[_K, _V]]] = {}
        register(self.tables.clear)

    def table(self, model: object, extra: object = None) -> dict[_K, _V]:
        key = (id(model), extra)
        held = self.tables.get(key)
        if held is None or held[0] is not model:
            if len(self.tables) >= self.models:
                self.tables.clear()
            held = self.tables[key] = (model, {})
        if len(held[1]) >= self.size:
            held[1].clear()
        return held[1]
