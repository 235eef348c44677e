"""The job's own link measurement (hetpilot.trainer.linkprobe) over real gloo ranks."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hetpilot.trainer.launch import spawn
from hetpilot.trainer.linkprobe import link_entries, measure_links, pair_rounds


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_small_jobs_measure_every_pair_once_in_rounds_of_disjoint_pairs(world: int) -> None:
    rounds = pair_rounds(world)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(world), 2))
    for r in rounds:
        members = [x for p in r for x in p]
        assert len(members) == len(set(members))
    assert len(rounds) == (world - 1 if world % 2 == 0 else world)


def test_large_jobs_measure_rank_neighbours_only() -> None:
    rounds = pair_rounds(11, all_pairs_up_to=8)
    assert sorted(p for r in rounds for p in r) == [(a, a + 1) for a in range(10)]
    assert len(rounds) == 2
    assert pair_rounds(1) == []


def _worker(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    links = measure_links("cpu", msg_bytes=64 * 1024, ar_bytes=1 << 20, repeats=3,
                          op_ms=1.0, microbatches=4)
    Path(out, f"{rank}.json").write_text(json.dumps(
        {f"{a}-{b}": [t.latency_s, t.gbps, t.idle_latency_s, t.busy_latency_s]
         for (a, b), t in links.items()}))
    dist.barrier()


def test_three_gloo_ranks_measure_every_link_and_agree(tmp_path: Path, importable: None) -> None:
    spawn(_worker, 3, (str(tmp_path),), 120)
    seen = [json.loads(Path(tmp_path, f"{r}.json").read_text()) for r in range(3)]
    assert seen[0] == seen[1] == seen[2]  # every rank gets the whole result
    assert set(seen[0]) == {"0-1", "0-2", "1-2"}
    for latency, gbps, idle, busy in seen[0].values():
        assert all(math.isfinite(x) and x > 0 for x in (latency, gbps, idle, busy))
        assert latency == max(idle, busy)
        assert latency < 1.0 and gbps < 1e4  # a loopback link: no more than that


def test_each_pair_is_sent_once_by_its_lower_rank() -> None:
    from hetpilot.trainer.linkprobe import LinkTime

    t = LinkTime(latency_s=1e-3, gbps=5.0, idle_latency_s=1e-4, busy_latency_s=1e-3)
    entries = link_entries({(0, 1): t, (1, 2): t}, ["h:0", "h:1", "g:0"])
    assert entries == [{"links": {"h:1": (1e-3, 5.0)}}, {"links": {"g:0": (1e-3, 5.0)}},
                       {"links": {}}]


def test_the_transfer_time_is_solved_back_from_the_reference_makespan() -> None:
    """Every op 1 s long, M = 4: the makespan spec 5.2 gives at C = 0.25 is solved back
    to C = 0.25."""
    from hetpilot.planner.refmodel import builtin_makespan_1f1b
    from hetpilot.trainer.linkprobe import _solve_transfer

    span = builtin_makespan_1f1b([1.0, 1.0], [1.0, 1.0], [0.25], 4)
    assert _solve_transfer(1.0, span, 4) == pytest.approx(0.25, abs=1e-9)
    assert _solve_transfer(1.0, span - 1.0, 4) == 0.0  # faster than C = 0 allows
