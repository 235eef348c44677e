"""Reading dataset items so that random augmentation gives the same item on every rank.

A stage reads only the inputs (the first stage) or the targets (the last) of its
microbatches, on its own rank, and every rank's generators are in another state, so a
dataset augmenting at random in ``__getitem__`` (a random crop, a joint flip of an image
and its mask) would otherwise give a target that does not belong to the input the first
stage read. :func:`read_items` reads each item with every generator it can draw from
seeded by :func:`item_seed`, and puts their states back after:

* torch's, Python's and numpy's global generators;
* generators the dataset holds itself (:func:`owned_generators`): a ``torch.Generator``,
  ``numpy.random.Generator``, ``numpy.random.RandomState`` or ``random.Random`` in an
  attribute of the dataset, of what it wraps (``Subset.dataset``, ``ConcatDataset.datasets``)
  or of its transforms, a few levels down. Without this, a dataset flipping with
  ``self.rng = np.random.default_rng(0)`` trained on mismatched pairs (train-check: the
  mean loss off by 0.05 at 2 ranks).

Every read of an item in an epoch then gives the same item, on every rank and in
train-check's one-process reference, and the draws still change from epoch to epoch.
About 30 us per item. A generator the dataset creates anew inside ``__getitem__`` is
beyond this and must be seeded from the index by the dataset itself.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["item_seed", "owned_generators", "read_items"]

_SEARCH_DEPTH = 6
"""How many levels (attributes, container elements) below the dataset
:func:`owned_generators` looks: ``ConcatDataset.datasets[1].transforms["flip"][0]`` is 5."""
_SEARCH_ITEMS = 64
"""Elements of a list, tuple or dict looked at (a list of 10^6 file names is not walked)."""
_SEARCH_OBJECTS = 2000
"""Objects looked at in all, at most (a few tens of microseconds per read)."""


def item_seed(seed: int, epoch: int, index: int) -> int:
    """Seed of the random draws made while reading dataset item ``index`` in ``epoch``."""
    key = f"item/{seed}/{epoch}/{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional for torch
        return None
    return numpy.random


def _is_generator(value: Any, np_random: Any) -> bool:
    if isinstance(value, (torch.Generator, random.Random)):
        return True
    return np_random is not None and isinstance(value, (np_random.Generator,
                                                        np_random.RandomState))


def owned_generators(dataset: Any) -> list[Any]:
    """The random generators ``dataset`` holds (module docstring), each once; the global
    ``random`` module's own instance is left to :func:`read_items`' global seeding."""
    np_random = _numpy_random()
    found: list[Any] = []
    seen: set[int] = set()

    def children(obj: Any) -> Iterator[Any]:
        if isinstance(obj, dict):
            values: Any = obj.values()
        elif isinstance(obj, (list, tuple)):
            values = obj
        else:
            attrs = getattr(obj, "__dict__", None)
            values = attrs.values() if isinstance(attrs, dict) else ()
        for i, value in enumerate(values):
            if i == _SEARCH_ITEMS:
                break
            yield value

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in seen or len(seen) >= _SEARCH_OBJECTS:
            return
        seen.add(id(obj))
        if _is_generator(obj, np_random):
            found.append(obj)
            return
        if depth > _SEARCH_DEPTH or isinstance(obj, (str, bytes, int, float, torch.Tensor,
                                                      torch.nn.Module, type)):
            return
        if np_random is not None and type(obj).__module__.startswith("numpy"):
            return  # arrays and scalars: no generators inside
        for child in children(obj):
            walk(child, depth + 1)

    walk(dataset, 0)
    return [g for g in found if g is not getattr(random, "_inst", None)]


def _get_state(gen: Any) -> Any:
    if isinstance(gen, random.Random):
        return gen.getstate()
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    if hasattr(gen, "bit_generator"):  # numpy.random.Generator
        return gen.bit_generator.state
    return gen.get_state()  # numpy.random.RandomState


def _set_state(gen: Any, state: Any) -> None:
    if isinstance(gen, random.Random):
        gen.setstate(state)
    elif isinstance(gen, torch.Generator):
        gen.set_state(state)
    elif hasattr(gen, "bit_generator"):
        gen.bit_generator.state = state
    else:
        gen.set_state(state)


def _seed(gen: Any, s: int) -> None:
    if isinstance(gen, random.Random):
        gen.seed(s)
    elif isinstance(gen, torch.Generator):
        gen.manual_seed(s)
    elif hasattr(gen, "bit_generator"):  # the same kind of bit generator, seeded with s
        gen.bit_generator.state = type(gen.bit_generator)(s).state
    else:
        gen.seed(s % 2**32)


@contextmanager
def _restored(gens: Sequence[Any]) -> Iterator[None]:
    states = [_get_state(g) for g in gens]
    try:
        yield
    finally:
        for g, state in zip(gens, states, strict=True):
            _set_state(g, state)


def read_items(dataset: Any, indices: Sequence[int], which: int, seed: int, epoch: int
               ) -> list[Any]:
    """``dataset[i][which]`` for each of ``indices``, each read with the global generators
    and the dataset's own seeded by :func:`item_seed` (module docstring); their states are
    restored after."""
    if not len(indices):
        return []
    gens = [torch.default_generator, *owned_generators(dataset)]
    with _restored(gens), _global_python_and_numpy(_numpy_random()) as reseed_globals:
        items = []
        for i in indices:
            s = item_seed(seed, epoch, int(i))
            for g in gens:
                _seed(g, s)
            reseed_globals(s)
            items.append(dataset[i][which])
        return items


@contextmanager
def _global_python_and_numpy(np_random: Any) -> Iterator[Any]:
    """Python's and numpy's module-level generators: seeded by the returned function,
    restored on exit."""
    py_state = random.getstate()
    np_state = np_random.get_state() if np_random is not None else None

    def reseed(s: int) -> None:
        random.seed(s)
        if np_random is not None:
            np_random.seed(s % 2**32)

    try:
        yield reseed
    finally:
        random.setstate(py_state)
        if np_random is not None:
            np_random.set_state(np_state)
