"""Asynchronous (PipeDream 1F1B, weight stashing) pipeline: the weight-versioning
rule on real gloo ranks, checked against a sequential reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hetpilot.trainer.async_pipeline import Phase, PipeConfig, run_local
from hetpilot.trainer.testing.async_jobs import tiny_data, tiny_mlp
from torch import nn

S, N, MB, LR = 3, 12, 8, 0.1
CUTS = (0, 1, 3, 4)


def _reference(phases: list[tuple[int, tuple[int, ...]]], n: int) -> dict[int, dict[str, torch.Tensor]]:
    """PipeDream with a drain at each re-cut, per layer: microbatch k runs layer i
    (on stage j of the cut in force) with the weights after max(k0, k - (S-j-1))
    updates, k0 the first microbatch of its phase."""
    torch.manual_seed(0)
    layers = tiny_mlp()
    x_all, y_all = tiny_data()
    perm = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
    hist = [[{m: p.detach().clone() for m, p in lay.named_parameters()}] for lay in layers]
    for k in range(n):
        k0, cuts = [(s, c) for s, c in phases if s <= k][-1]
        idx = perm[(torch.arange(MB) + k * MB) % len(x_all)]
        h = x_all[idx]
        used = []
        for j in range(len(cuts) - 1):
            v = max(k0, k - (len(cuts) - 1 - j - 1))
            for i in range(cuts[j], cuts[j + 1]):
                w = {m: t.clone().requires_grad_(True) for m, t in hist[i][v].items()}
                used.append((i, w))
                h = torch.func.functional_call(layers[i], w, (h,))
        nn.functional.cross_entropy(h, y_all[idx]).backward()
        for i, w in used:
            hist[i].append({m: hist[i][-1][m] - LR * w[m].grad for m in w})
    return {i: hist[i][-1] for i in range(len(layers))}


def _check_versions(results: list[dict], oldest: Callable[[int], int]) -> None:
    """PipeDream's rule on every rank's log: microbatch k's forward ran on weight
    version max(oldest(k), k - staleness) with staleness S - j - 1, and its backward
    on those very weights."""
    for j, res in enumerate(results):
        w = S - j - 1
        log = {e["k"]: e for e in res["log"]}
        assert sorted(log) == list(range(N))
        for k, e in log.items():
            assert e["fwd_version"] == max(oldest(k), k - w)
            assert e["bwd_sum"] == e["fwd_sum"]  # backward through the stashed weights
        assert res["version"] == N


def _assert_matches_reference(results: list[dict], phases: list[tuple[int, tuple[int, ...]]]) -> None:
    """The last snapshot of every layer equals the sequential PipeDream reference."""
    got = {i: st for res in results for i, st in res["snaps"][-1][2].items()}
    ref = _reference(phases, N)
    assert sorted(got) == sorted(ref)
    for i, st in ref.items():
        for m, t in st.items():
            torch.testing.assert_close(got[i][m], t, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_backward_uses_the_weights_of_its_forward() -> None:
    cfg = PipeConfig(make_layers=tiny_mlp, data=tiny_data(), phases=[Phase(0, CUTS)],
                     microbatch=MB, microbatches=N, lr=LR, snapshot_every=N, record=True)
    results = run_local(S, cfg, timeout_s=60)
    _check_versions(results, lambda k: 0)
    for res in results:  # ... while the live weights moved on
        assert all(e["bwd_live_version"] == e["k"] for e in res["log"])
    _assert_matches_reference(results, [(0, CUTS)])


@pytest.mark.slow
def test_sync_mode_recuts_between_iterations() -> None:
    cfg = PipeConfig(make_layers=tiny_mlp, data=tiny_data(),
                     phases=[Phase(0, (0, 2, 4)), Phase(4, (0, 1, 4))], microbatch=MB,
                     microbatches=8, per_iteration=4, flush=True, lr=LR)
    r0, r1 = run_local(2, cfg, timeout_s=60)
    assert r0["version"] == r1["version"] == 2
    assert sorted(r0["snaps"][-1][2]) == [0] and sorted(r1["snaps"][-1][2]) == [1, 2, 3]


@pytest.mark.slow
def test_async_mode_recuts_after_draining_and_keeps_the_versioning_rule() -> None:
    phases = [(0, (0, 1, 3, 4)), (6, (0, 2, 3, 4))]
    cfg = PipeConfig(make_layers=tiny_mlp, data=tiny_data(), phases=[Phase(s, c) for s, c in phases],
                     microbatch=MB, microbatches=N, lr=LR, snapshot_every=N, record=True)
    results = run_local(S, cfg, timeout_s=60)
    _check_versions(results, lambda k: 0 if k < 6 else 6)  # the drain: nothing older than k0
    assert all(res["recut_s"] > 0 for res in results)
    assert sorted(results[0]["snaps"][-1][2]) == [0, 1]
    _assert_matches_reference(results, phases)
