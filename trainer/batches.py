"""Which samples each iteration takes, and how they are batched.

Iteration i of epoch e takes samples ``perm_e[i*B:(i+1)*B]`` of a seeded per-epoch
permutation, whatever the plan, so a plan switch never skips or repeats a sample; each
data-parallel group takes its slice of that batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import TensorDataset, default_collate

from .itemseed import read_items

__all__ = ["EVAL_EPOCH", "EpochOrder", "collate"]

EVAL_EPOCH = -1
"""The epoch under which the held-out set's items are read (:func:`read_items`)."""


class EpochOrder:
    """The seeded sample order of each epoch, kept for the epoch: drawing it for every
    iteration cost a ``randperm`` of the whole data set per iteration (about 10 ms for a
    million samples, on every rank's critical path)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        self._cache: tuple[int, torch.Tensor] | None = None  # (epoch, its order)

    def of(self, epoch: int) -> torch.Tensor:
        if self._cache is None or self._cache[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._cache = (epoch, torch.randperm(self.size, generator=gen))
        return self._cache[1]

    def batch(self, epoch: int, iteration: int, global_batch: int) -> list[int]:
        """Dataset indices of one global batch; independent of the plan."""
        b = global_batch
        return self.of(epoch)[iteration * b : (iteration + 1) * b].tolist()


def collate(dataset: Any, indices: Sequence[int], which: int, seed: int = 0,
            epoch: int = 0) -> Any:
    """Inputs (``which`` 0) or targets (1) of ``indices``, batched as a DataLoader would
    (``default_collate``: tensors stacked, numbers to tensors, tuples and dicts kept);
    dtypes are the dataset's (the stage casts floating leaves when ``dtype`` is set).
    Items are read by :func:`read_items` (random augmentation seeded per item).

    A ``TensorDataset`` is gathered with one ``index_select`` per tensor instead: the
    same rows stacked, without a Python call per sample (0.48 against 0.08 ms for 128
    rows of 512 floats; per microbatch, on the pipeline's critical path). Not
    ``tensor[index]``, which runs in parallel: for 8 rows of 512 token ids on a 16-core
    H100 host it took 32 us against ``index_select``'s 6 us in a loop, and 1.5 ms a call
    in a profiled GPT-2 iteration."""
    if type(dataset) is TensorDataset and len(indices):
        return dataset.tensors[which].index_select(
            0, torch.as_tensor(indices, dtype=torch.long))
    return default_collate(read_items(dataset, indices, which, seed, epoch))
