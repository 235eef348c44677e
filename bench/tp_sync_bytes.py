"""Bytes the gradient sync moves per iteration under a plan whose two groups split the same
layers 2 ways: the per-shard path against the full-tensor one, side by side in one run.

    .venv/bin/python bench/tp_sync_bytes.py [--iterations 3]

4 gloo ranks (CPU, nothing emulated) train ``hetpilot.trainer.examples:gpt_tp`` in float64
under :data:`~hetpilot.trainer.testing.tp_ranks.EQUAL_PLAN` (two groups, each one stage of
2 ranks splitting every block 2 ways). Each rank runs ``--iterations`` iterations with the
per-shard sync the plan gets, then as many with its buckets forced onto the full-tensor
path (what every bucket took before the per-shard one). Printed: bucket bytes per
iteration summed over the ranks, and the slowest rank's median sync wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch


def _rank(rank: int, world: int, out: str, iterations: int) -> None:
    from hetpilot.planner.serde import plan_from_dict
    from hetpilot.trainer.examples import gpt_tp
    from hetpilot.trainer.runtime import Trainer, TrainerConfig
    from hetpilot.trainer.testing.tp_ranks import EQUAL_PLAN
    from hetpilot.trainer.tpsync import TPGradSync

    spec = gpt_tp()
    trainer = Trainer(
        spec["layers"], spec["loss"], spec["optimizer"], spec["dataset"],
        TrainerConfig(global_batch=spec["global_batch"], device_id=f"local:{rank}", seed=0,
                      dtype=torch.float64, tp_plan=spec["tp_plan"]),
    )
    trainer.switch(plan_from_dict(EQUAL_PLAN), 1)
    sync = trainer._part.gradsync
    assert isinstance(sync, TPGradSync)
    result: dict[str, Any] = {}
    for path in ("shard", "full"):
        if path == "full":  # the full-tensor path every bucket took before
            sync.shard_groups = [None] * len(sync.buckets)
        assert set(sync.paths) == {path}
        sent, secs = [], []
        for _ in range(iterations):
            stats, _ = trainer.train_step()
            assert stats is not None
            sent.append(stats.sync_bytes)
            secs.append(stats.sync_s)
        result[path] = {"bytes": sent, "sync_s": secs}
    torch.save(result, Path(out) / f"bytes{rank}.pt")


def main() -> None:
    from hetpilot.trainer.launch import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        spawn(_rank, 4, (out, args.iterations), timeout_s=300)
        got = [torch.load(Path(out) / f"bytes{r}.pt", weights_only=True) for r in range(4)]
    report = {}
    for path in ("shard", "full"):
        per_iter = {sum(g[path]["bytes"][i] for g in got) for i in range(args.iterations)}
        assert len(per_iter) == 1, per_iter
        report[path] = {
            "bytes_per_iteration_all_ranks": per_iter.pop(),
            "bytes_per_iteration_per_rank": [g[path]["bytes"][0] for g in got],
            "sync_s_slowest_rank_median": max(statistics.median(g[path]["sync_s"])
                                              for g in got),
        }
    report["full_over_shard_bytes"] = (report["full"]["bytes_per_iteration_all_ranks"]
                                       / report["shard"]["bytes_per_iteration_all_ranks"])
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
