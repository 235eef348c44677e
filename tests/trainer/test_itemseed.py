"""Dataset items read under per-item seeds: global generators and the dataset's own."""

from __future__ import annotations

import random

import numpy as np
import torch
from hetpilot.trainer.itemseed import owned_generators, read_items


class Draws(torch.utils.data.Dataset[tuple[float, float, float, float]]):
    """Each item: one draw from each generator the dataset holds."""

    def __init__(self) -> None:
        self.np_gen = np.random.default_rng(0)
        self.legacy = np.random.RandomState(0)
        self.py = random.Random(0)
        self.transforms = {"flip": [torch.Generator().manual_seed(0)]}
        self.names = [f"file{i}.png" for i in range(1000)]

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[float, float, float, float]:
        return (float(self.np_gen.random()), float(self.legacy.rand()), self.py.random(),
                float(torch.rand((), generator=self.transforms["flip"][0])))


def test_owned_generators_found_through_wrappers_and_transforms_once() -> None:
    ds = Draws()
    wrapped = torch.utils.data.ConcatDataset([torch.utils.data.Subset(ds, range(5)), ds])
    found = owned_generators(wrapped)
    assert {id(g) for g in found} == {id(ds.np_gen), id(ds.legacy), id(ds.py),
                                      id(ds.transforms["flip"][0])}
    assert len(found) == 4
    assert owned_generators(torch.utils.data.TensorDataset(torch.zeros(3))) == []


def test_an_item_reads_the_same_every_time_and_the_generators_do_not_move() -> None:
    ds = Draws()
    before = (ds.np_gen.bit_generator.state, ds.py.getstate(),
              ds.transforms["flip"][0].get_state())
    legacy = ds.legacy.get_state()[1].copy()
    first = read_items(ds, [3, 4], 0, seed=1, epoch=0) + read_items(ds, [3], 1, 1, 0)
    ds[0]  # the dataset drawing on its own in between changes nothing
    again = read_items(ds, [3, 4], 0, seed=1, epoch=0) + read_items(ds, [3], 1, 1, 0)
    assert first == again
    assert first[0] != first[1]  # items differ
    assert read_items(ds, [3], 0, seed=1, epoch=1) != first[:1]  # so do epochs
    ds2 = Draws()
    for _ in range(3):  # another rank, its generators elsewhere
        ds2[0]
    assert read_items(ds2, [3], 1, seed=1, epoch=0) == first[2:]
    ds3 = Draws()
    read_items(ds3, [1, 2], 0, 1, 0)
    assert ds3.np_gen.bit_generator.state == before[0]
    assert ds3.py.getstate() == before[1]
    assert torch.equal(ds3.transforms["flip"][0].get_state(), before[2])
    assert np.array_equal(ds3.legacy.get_state()[1], legacy)
