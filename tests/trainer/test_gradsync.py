"""GradSync (``hetpilot.trainer.gradsync``): the gradient sync overlapped with the backward.

In-process tests replace the all-reduce by a local stand-in (launch order, hooks,
recompute, a gradient after launch). Multi-rank tests run real gloo ranks
(``hetpilot.trainer.launch.spawn``) with replicas of a small model: a tied parameter,
a checkpointed (non-reentrant recompute) layer, a parameter that gets no gradient and
a frozen one; several microbatches, ``arm()`` before the last backward; the sums are
compared with the runtime's blocking sync (copied below as it is in ``Trainer``).

Spawned ranks unpickle the rank functions by this module's name
(``tests.trainer.test_gradsync`` under pytest's importlib mode); spawn hands the ranks
this process's ``sys.path``, so the ``importable`` fixture puts the directory that
name is relative to on it.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hetpilot.trainer.gradsync import Bucket, GradSync, SyncStats, plan_chunks
from hetpilot.trainer.launch import spawn
from torch import nn
from torch.utils.checkpoint import checkpoint

SMALL_CAP_MB = 300 / 2**20  # 300 bytes: 37 float64 values, several chunks per bucket
MICROBATCHES = 3
ITERATIONS = 2


# -- the model ----------------------------------------------------------------------


class First(nn.Module):
    """Layer 0: uses the tied vector."""

    def __init__(self, shared: nn.Parameter) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) * self.shared)


class Recomputed(nn.Module):
    """Layer 1: runs under non-reentrant checkpoint (recomputed in the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = checkpoint(self._inner, x, use_reentrant=False)
        assert isinstance(out, torch.Tensor)
        return out


class Unused(nn.Module):
    """Layer 2: ``spare`` never gets a gradient, ``frozen`` does not require one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.spare = nn.Parameter(torch.randn(5))
        self.frozen = nn.Parameter(torch.randn(8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) + self.frozen)


class Last(nn.Module):
    """Layer 3: uses the tied vector again."""

    def __init__(self, shared: nn.Parameter) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x) + self.shared[:4]
        return out


def make_model() -> nn.ModuleList:
    """Four layers, the same on every rank; ``shared`` is tied between layers 0 and 3."""
    torch.manual_seed(0)
    shared = nn.Parameter(torch.randn(8))
    model = nn.ModuleList([First(shared), Recomputed(), Unused(), Last(shared)])
    return model.to(torch.float64)


def untied(model: nn.ModuleList, first: int, end: int) -> list[nn.Parameter]:
    """A bucket's parameters as the runtime lists them: layer order, the tie left out."""
    shared = model[0].shared
    return [p for layer in range(first, end) for p in model[layer].parameters()
            if p is not shared]


def microbatch(rank: int, it: int, k: int, width: int, out: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 * rank + 100 * it + k)
    x = torch.randn(4, width, generator=gen, dtype=torch.float64)
    y = torch.randn(4, out, generator=gen, dtype=torch.float64)
    return x, y


def run_stage(model: nn.ModuleList, layers: range, rank: int, it: int,
              sync: GradSync | None, roots: bool) -> None:
    """Forward and backward ``MICROBATCHES`` microbatches through ``layers``, arming before
    the last backward. A stage that does not end the model takes a seeded upstream gradient."""
    width = 6 if layers.start == 0 else 8
    for k in range(MICROBATCHES):
        x, y = microbatch(rank, it, k, width, 4 if layers.stop == 4 else 8)
        for layer in layers:
            x = model[layer](x)
        if layers.stop == 4:
            out, grad = ((x - y) ** 2).mean() / MICROBATCHES, None
        else:
            out, grad = x, y
        if k == MICROBATCHES - 1 and sync is not None:
            sync.arm([out] if roots else ())
        torch.autograd.backward([out], None if grad is None else [grad])


def blocking_reference(buckets: list[tuple[list[nn.Parameter], Any]],
                       tied: list[tuple[nn.Parameter, Any]]) -> None:
    """``Trainer._sync_grads`` as it was before GradSync (emulation left out), with a flag
    per parameter after the gradients (summed with them): one that no rank's backward
    reached gets no gradient (as in one process)."""
    for params, pg in buckets:
        if not params:
            continue
        flat = torch.cat([*(p.grad.reshape(-1) if p.grad is not None else
                            torch.zeros(p.numel(), dtype=p.dtype) for p in params),
                          torch.tensor([1.0 if p.grad is not None else 0.0 for p in params],
                                       dtype=params[0].dtype)])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=pg)
        flags = flat[flat.numel() - len(params):].tolist()
        pos = 0
        for p, flag in zip(params, flags, strict=True):
            n = p.numel()
            # a frozen parameter gets no gradient (none in one process), nor an unused one
            p.grad = flat[pos : pos + n].view_as(p).clone() if p.requires_grad and flag else None
            pos += n
    for param, pg in tied:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=pg)


def sgd_step(model: nn.ModuleList, layers: range,
             sync: GradSync | None = None) -> list[torch.Tensor]:
    """Record the gradients of the stage's trainable parameters, step, clear (so that
    iteration 2 starts elsewhere): with ``sync.zero_grad()`` when given (the runtime's way,
    the gradients stay views of the sync's buffers), else by setting them to None."""
    grads = []
    held = dict.fromkeys(p for layer in layers for p in model[layer].parameters())
    with torch.no_grad():
        for p in held:
            if not p.requires_grad:
                assert p.grad is None, "a frozen parameter was given a gradient"
                continue
            if p is model[2].spare:  # no rank used it: no gradient, as in one process
                assert p.grad is None, "an unused parameter was given a gradient"
                continue
            assert p.grad is not None, "a bucket parameter was left without a gradient"
            grads.append(p.grad.clone())
            p -= 0.1 * p.grad
            if sync is None:
                p.grad = None
        if sync is not None:
            tied = [param for param, _ in sync.tied]
            sync.zero_grad()
            for param in tied:
                param.grad = None
    return grads


# -- rank functions ---------------------------------------------------------------------

CONFIGS: dict[str, dict[str, Any]] = {
    "blocking": {"overlap": False},
    "blocking_zero_grad": {"overlap": False, "zero_grad": True},
    "blocking_copy": {"overlap": False, "views": False},
    "small_cap_zero_grad": {"overlap": True, "cap": SMALL_CAP_MB, "roots": True,
                            "zero_grad": True},
    "small_cap_copy": {"overlap": True, "cap": SMALL_CAP_MB, "views": False},
    "one_chunk": {"overlap": True},
    "one_chunk_roots": {"overlap": True, "roots": True},
    "small_cap": {"overlap": True, "cap": SMALL_CAP_MB},
    "small_cap_roots": {"overlap": True, "cap": SMALL_CAP_MB, "roots": True},
    "small_cap_per_group": {"overlap": True, "cap": SMALL_CAP_MB, "roots": True,
                            "global_order": False},
    "small_cap_per_group_no_roots": {"overlap": True, "cap": SMALL_CAP_MB,
                                     "global_order": False},
}


def _compare(rank: int, out: str, layout: dict[int, tuple[range, list[tuple[int, int, Any]]]],
             tie_group: Any, configs: dict[str, dict[str, Any]]) -> None:
    """Run each config and the blocking reference on fresh copies of the model; write
    how the gradients compare, and the stats, to ``out/rank{rank}.json``."""
    layers, spans = layout[rank]
    base = make_model()
    results: dict[str, Any] = {}
    ref_model = copy.deepcopy(base)
    ref_grads = []
    for it in range(ITERATIONS):
        run_stage(ref_model, layers, rank, it, None, False)
        blocking_reference([(untied(ref_model, a, b), pg) for a, b, pg in spans],
                           [(ref_model[0].shared, tie_group)])
        ref_grads.append(sgd_step(ref_model, layers))
    for name, cfg in configs.items():
        model = copy.deepcopy(base)
        sync = GradSync([Bucket(untied(model, a, b), pg, f"{a}-{b}") for a, b, pg in spans],
                        [(model[0].shared, tie_group)],
                        bucket_cap_mb=cfg.get("cap", 25.0), overlap=cfg["overlap"],
                        global_order=cfg.get("global_order", True),
                        grad_views=cfg.get("views", True))
        diffs, equal, stats, bound = [], True, [], True
        for it in range(ITERATIONS):
            run_stage(model, layers, rank, it, sync, cfg.get("roots", False))
            got: SyncStats = sync.finish()
            bound = bound and _grads_are_views(sync, model[2].spare)
            grads = sgd_step(model, layers, sync if cfg.get("zero_grad") else None)
            for g, r in zip(grads, ref_grads[it], strict=True):
                diffs.append(float((g - r).abs().max()))
                equal = equal and torch.equal(g, r)
            stats.append({"launched": got.launched_in_backward, "chunks": got.chunks,
                          "bytes": got.bytes, "bucket_bytes": got.bucket_bytes,
                          "exposed_s": got.exposed_s})
        sync.close()
        results[name] = {"max_diff": max(diffs), "bitwise": equal, "stats": stats,
                         "layout": sync.chunk_layout, "views": bound}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _grads_are_views(sync: GradSync, unused: nn.Parameter) -> bool:
    """Whether every trainable bucket parameter's gradient (but ``unused``'s, which has
    none) lies in one of the sync's buffers (its storage is a buffer's, not its own)."""
    params = [p for b in sync.buckets for p in b.params if p.requires_grad and p is not unused]
    buffers = {v.buf.untyped_storage().data_ptr() for v in sync._views if v is not None}
    return all(p.grad is not None and p.grad.untyped_storage().data_ptr() in buffers
               for p in params)


def _replicas(rank: int, world: int, out: str) -> None:
    """Every rank holds the whole model: buckets [0,2) and [2,4), both over all ranks."""
    group = dist.new_group(list(range(world)))
    spans = [(0, 2, group), (2, 4, group)]
    _compare(rank, out, {r: (range(4), spans) for r in range(world)}, group, CONFIGS)


def _two_groups(rank: int, world: int, out: str) -> None:
    """Rank 0 holds layers [0,4) (a group of its own); ranks 1 and 2 are a 2-stage pipeline
    holding [0,2) and [2,4). Buckets: layers [0,2) over {0,1}, [2,4) over {0,2}; the tie
    (layers 0 and 3) over all three."""
    assert world == 3
    ga = dist.new_group([0, 1])
    gb = dist.new_group([0, 2])
    every = dist.new_group([0, 1, 2])
    layout = {0: (range(4), [(0, 2, ga), (2, 4, gb)]),
              1: (range(2), [(0, 2, ga)]),
              2: (range(2, 4), [(2, 4, gb)])}
    configs = {k: CONFIGS[k] for k in ("blocking", "small_cap", "small_cap_roots",
                                       "small_cap_per_group", "small_cap_per_group_no_roots")}
    _compare(rank, out, layout, every, configs)


def _emulated(rank: int, world: int, out: str) -> None:
    """min_seconds: bucket 0's all-reduces last at least 0.4 s per its whole size, blocking
    and overlapped; overlapped, counted from the launches (0.3 s of other work before
    finish)."""
    group = dist.new_group(list(range(world)))
    bytes0 = sum(p.numel() * 8 for p in untied(make_model(), 0, 2))
    found: dict[str, Any] = {"bytes0": bytes0}
    for overlap in (False, True):
        asked: list[tuple[int, int]] = []

        def minimum(bucket: int, nbytes: int, asked: list[tuple[int, int]] = asked
                    ) -> float | None:
            asked.append((bucket, nbytes))
            return 0.4 * nbytes / bytes0 if bucket == 0 else None

        model = make_model()
        sync = GradSync([(untied(model, 0, 2), group), (untied(model, 2, 4), group)],
                        [(model[0].shared, group)], bucket_cap_mb=SMALL_CAP_MB,
                        overlap=overlap, min_seconds=minimum)
        run_stage(model, range(4), rank, 0, sync, roots=True)
        dist.barrier()  # both ranks reach finish() together (first-call warm-up differs)
        if overlap:
            time.sleep(0.3)  # the rest of the iteration, while the all-reduces run
        stats = sync.finish()
        sync.close()
        found["overlap" if overlap else "blocking"] = {
            "exposed_s": stats.exposed_s, "bucket_s": stats.bucket_s,
            "emulated_s": stats.emulated_s, "launched": stats.launched_in_backward,
            "bucket_bytes": stats.bucket_bytes, "asked": asked}
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))


# -- multi-rank tests -------------------------------------------------------------------


def _read(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _check_replicas(results: list[dict[str, Any]], bitwise: bool) -> None:
    for rank, res in enumerate(results):
        # the blocking GradSync is the runtime's sync: the same sums to the bit
        assert res["blocking"]["bitwise"], (rank, res["blocking"])
        assert res["blocking_copy"]["bitwise"], (rank, res["blocking_copy"])
        for name, r in res.items():
            # gradients live in the sync's buffers, unless the config asks for copies
            assert r["views"] == (CONFIGS[name].get("views", True)), (rank, name)
            if bitwise:
                assert r["bitwise"], (rank, name, r["max_diff"])
            assert r["max_diff"] <= 1e-12, (rank, name, r["max_diff"])
        for it in range(ITERATIONS):
            assert res["blocking"]["stats"][it]["launched"] == 0.0
            assert res["blocking"]["stats"][it]["chunks"] == 2
            # one chunk per bucket; layers 2-3's holds `spare`, which never gets a gradient,
            # and comes first: nothing goes before finish() ...
            assert res["one_chunk"]["stats"][it]["launched"] == 0.0
            # ... unless arm() is given the backward's roots (spare is found unreachable)
            assert res["one_chunk_roots"]["stats"][it]["launched"] == 1.0
            # a small cap: the chunks before the one holding `spare` go during the backward
            assert 0.0 < res["small_cap"]["stats"][it]["launched"] < 1.0
            assert res["small_cap"]["stats"][it]["chunks"] > 4
            assert res["small_cap_roots"]["stats"][it]["launched"] == 1.0
            assert res["small_cap_per_group"]["stats"][it]["launched"] == 1.0
            assert all(r["stats"][it]["bucket_bytes"] == res["blocking"]["stats"][it]
                       ["bucket_bytes"] for r in res.values())
        layout = res["small_cap"]["layout"]
        assert [b for b, _, _ in layout] == sorted((b for b, _, _ in layout), reverse=True)
        assert all(n <= 300 or count == 1 for _, count, n in layout)  # bigger: alone


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_replicas_bitwise_equal_to_the_blocking_sync(tmp_path: Path,
                                                         importable: None) -> None:
    spawn(_replicas, 2, (str(tmp_path),), timeout_s=100)
    _check_replicas(_read(tmp_path, 2), bitwise=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_three_replicas_equal_to_1e12(tmp_path: Path, importable: None) -> None:
    spawn(_replicas, 3, (str(tmp_path),), timeout_s=100)
    _check_replicas(_read(tmp_path, 3), bitwise=False)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rank_in_two_groups(tmp_path: Path, importable: None) -> None:
    spawn(_two_groups, 3, (str(tmp_path),), timeout_s=100)
    results = _read(tmp_path, 3)
    for rank, res in enumerate(results):
        for name, r in res.items():
            # every bucket group has 2 members: bitwise; the tie's (3 members) is blocking
            assert r["bitwise"], (rank, name, r["max_diff"])
        assert res["small_cap_roots"]["stats"][0]["launched"] == 1.0
        assert {b for b, _, _ in res["small_cap"]["layout"]} == ({0, 1} if rank == 0 else {0})
    # rank 0 without roots: `spare` (layers 2-3, group {0,2}) holds its chunk until finish();
    # in the global order every chunk after it waits too (all of group {0,1}'s) ...
    held_back = results[0]["small_cap"]["stats"][0]["launched"]
    assert 0.0 < held_back < 1.0
    # ... per group, {0,1}'s chunks go during the backward anyway
    assert results[0]["small_cap_per_group_no_roots"]["stats"][0]["launched"] > held_back
    assert results[1]["small_cap"]["stats"][0]["launched"] == 1.0  # layers 0-1: all get grads


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_min_seconds_is_honoured(tmp_path: Path, importable: None) -> None:
    spawn(_emulated, 2, (str(tmp_path),), timeout_s=80)
    least = 0.4 - 1e-9  # the emulated minimum; ends are sums of clock readings (rounding)
    for res in _read(tmp_path, 2):
        blocking, overlap, bytes0 = res["blocking"], res["overlap"], res["bytes0"]
        assert blocking["bucket_s"][0] >= least and blocking["exposed_s"] >= least
        assert blocking["emulated_s"] > 0
        # blocking: once per bucket with its whole size
        assert blocking["asked"] == [[0, bytes0], [1, blocking["bucket_bytes"] - bytes0]]
        assert overlap["launched"] == 1.0
        assert overlap["bucket_s"][0] >= least  # from its first launch, in the backward
        assert overlap["exposed_s"] < 0.35  # 0.3 s of it passed before finish()
        assert overlap["emulated_s"] > 0
        # overlapped: once per chunk with its size (bucket 0 is cut in several)
        sizes0 = [n for b, n in overlap["asked"] if b == 0]
        assert len(sizes0) > 1 and sum(sizes0) == bytes0


# -- in-process tests (the all-reduce replaced by a local stand-in) ---------------------


class _Done:
    def wait(self) -> bool:
        return True


class LocalSync(GradSync):
    """Records each launch; the "sum" doubles the buffer (two equal ranks)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.launched: list[int] = []
        super().__init__(*args, **kwargs)

    def _all_reduce(self, buf: torch.Tensor, group: Any) -> Any:
        self.launched.append(buf.numel())
        buf.mul_(2)
        return _Done()


def test_plan_chunks_reverse_order_cap_and_dtypes() -> None:
    params = [torch.zeros(10), torch.zeros(3), torch.zeros(3), torch.zeros(40),
              torch.zeros(2, dtype=torch.float64), torch.zeros(1)]
    # bytes: 40, 12, 12, 160, 16 (float64), 4
    assert plan_chunks(params, 48) == [[5], [4], [3], [2, 1], [0]]
    assert plan_chunks(params, 1000) == [[5], [4], [3, 2, 1, 0]]
    assert plan_chunks(params[:3], 1) == [[2], [1], [0]]


def test_launch_order_does_not_follow_the_hooks() -> None:
    """Hooks firing out of order: a chunk goes only when it and every chunk before it in
    the sequence are ready; finish() sends the rest in order."""
    params = [nn.Parameter(torch.full((4,), float(i))) for i in range(6)]
    sync = LocalSync([(params[:3], None), (params[3:], None)], bucket_cap_mb=16 / 2**20)
    # 16 bytes: one parameter per chunk; sequence: 5, 4, 3 (bucket 1) then 2, 1, 0
    slot = {id(q): i for i, q in enumerate(sync._slot_param)}
    sync.arm()
    for i in (3, 1, 4, 0):
        params[i].grad = torch.ones(4) * i
        sync._on_grad(slot[id(params[i])])
    assert sync.launched == []  # 5 has not come
    params[5].grad = torch.ones(4) * 5
    sync._on_grad(slot[id(params[5])])
    assert sync.launched == [5, 5, 5]  # 5, 4, 3 (4 values and a flag each); 2 is missing
    stats = sync.finish()
    assert len(sync.launched) == 6 and stats.chunks == 6
    assert stats.launched_in_backward == pytest.approx(0.5)
    assert params[2].grad is None  # no gradient on either "rank": none, as in one process
    for i in (0, 1, 3, 4, 5):
        grad = params[i].grad
        assert grad is not None and torch.equal(grad, torch.full((4,), 2.0 * i))


def _net() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def _loss(net: nn.Module, k: int, recompute: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    if recompute:
        h = checkpoint(net[:3], x, use_reentrant=False)
        y = net[3:](h)
    else:
        y = net(x)
    out: torch.Tensor = (y**2).mean()
    return out


@pytest.mark.parametrize("recompute", [False, True])
def test_hooks_launch_during_the_backward(recompute: bool) -> None:
    """Real autograd (with and without non-reentrant recompute): chunks go in the last
    backward only, the sums land in .grad, and the hooks do nothing after close()."""
    net, ref = _net(), _net()
    sync = LocalSync([(list(net.parameters()), None)], bucket_cap_mb=200 / 2**20)
    for k in range(3):
        if k == 2:
            sync.arm()
        _loss(net, k, recompute).backward()
        _loss(ref, k, recompute).backward()
        assert (len(sync.launched) > 0) == (k == 2)
    stats = sync.finish()
    assert stats.launched_in_backward == 1.0 and stats.chunks == len(sync.launched) > 2
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, 2 * q.grad)
    sync.close()
    launched = len(sync.launched)
    sync.arm()
    _loss(net, 0, recompute).backward()
    assert len(sync.launched) == launched  # no hooks left


def test_a_gradient_after_its_launch_is_refused() -> None:
    net = _net()
    sync = LocalSync([(list(net.parameters()), None)])
    sync.arm()
    _loss(net, 0, False).backward()
    assert sync.launched
    with pytest.raises(RuntimeError, match="after its chunk's all-reduce was launched"):
        _loss(net, 1, False).backward()
    sync.close()


def test_blocking_mode_only_notes_used_parameters_and_arm_is_a_no_op() -> None:
    net = _net()
    sync = GradSync([(list(net.parameters()), None)], overlap=False)
    assert sync.chunk_layout == [] and len(sync._handles) == len(list(net.parameters()))
    sync.arm()
    assert not sync._armed


def test_a_parameter_in_two_buckets_is_refused() -> None:
    p = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="each may be synced once"):
        GradSync([([p], None), ([p], None)])


def test_gradients_accumulate_in_the_sync_buffer_and_zero_grad_keeps_them_there() -> None:
    """Views (the default): the backward accumulates into the sync's own buffer, the
    all-reduce sums that buffer (no copy in or out: the storage never changes), zero_grad
    zeroes it in place; a gradient replaced from outside is copied in, not lost; a frozen
    parameter keeps its place as zeros and gets no gradient."""
    net, ref = _net(), _net()
    frozen = nn.Parameter(torch.ones(3, dtype=torch.float64), requires_grad=False)
    params = [*net.parameters(), frozen]
    sync = LocalSync([(params, None)])  # one chunk: all float64, under the cap
    storage = {id(p): p.grad.untyped_storage().data_ptr() for p in net.parameters()
               if p.grad is not None}
    assert len(storage) == len(list(net.parameters())) and len(set(storage.values())) == 1
    assert frozen.grad is None
    for it in range(2):
        for k in range(2):
            if k == 1:
                sync.arm()
            _loss(net, 10 * it + k, False).backward()
            _loss(ref, 10 * it + k, False).backward()
        sync.finish()
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert p.grad.untyped_storage().data_ptr() == storage[id(p)]  # in place
            assert torch.equal(p.grad, 2 * q.grad)
        # the gradients, then one flag per parameter
        assert frozen.grad is None
        assert sync.launched[-1] == sum(p.numel() for p in params) + len(params)
        sync.zero_grad()
        ref.zero_grad(set_to_none=True)
        assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    first = next(net.parameters())
    first.grad = None  # an optimizer's zero_grad(set_to_none=True): autograd allocates anew
    sync.arm()
    _loss(net, 99, False).backward()
    _loss(ref, 99, False).backward()
    sync.finish()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert p.grad.untyped_storage().data_ptr() == storage[id(p)]  # bound again
        assert torch.equal(p.grad, 2 * q.grad)
    sync.close()
    assert all(p.grad is None for p in net.parameters())  # the plan's buffers let go


class PeerSync(GradSync):
    """The "sum" adds what one other replica sent: gradients, then one flag per parameter."""

    def __init__(self, peer: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.peer = peer
        super().__init__(*args, **kwargs)

    def _all_reduce(self, buf: torch.Tensor, group: Any) -> Any:
        buf.add_(self.peer)
        return _Done()


@pytest.mark.parametrize("views", [True, False])
def test_a_parameter_no_replica_used_gets_no_gradient(views: bool) -> None:
    """As in one process, where the optimizer skips a parameter whose ``.grad`` is None (a
    zero gradient would still be moved by weight decay and momentum): ``used`` gets the sum,
    ``peer_only`` (used by the other replica only) gets the other's gradient, ``spare``
    (used by neither) none; zero_grad binds it again for the next iteration."""
    used, peer_only, spare = (nn.Parameter(torch.ones(2, dtype=torch.float64))
                              for _ in range(3))
    # one chunk, in reverse order (spare, peer_only, used): the other's gradients and flags
    peer = torch.tensor([0.0, 0.0, 2.0, 2.0, 1.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    sync = PeerSync(peer, [([used, peer_only, spare], None)], grad_views=views)
    for _ in range(2):
        sync.arm()
        (3 * used).sum().backward()
        sync.finish()
        want = {used: 4.0, peer_only: 2.0}
        for p, value in want.items():
            assert p.grad is not None
            assert torch.equal(p.grad, torch.full((2,), value, dtype=torch.float64))
        assert spare.grad is None
        if views:
            sync.zero_grad()
            assert spare.grad is not None and not spare.grad.any()  # bound again
        else:
            for p in (used, peer_only):
                p.grad = None
    sync.close()
