"""``hetpilot train-check``: the runtime against one process taking the same steps, float64.

Takes a job (``--job MODULE:FN``, the same job function ``hetpilot train``
runs; default: a small tanh MLP) and draws random valid plans for N local
ranks until every layer boundary has been cut at least once (after
tuple/dict-output layers and between tied layers included): several groups,
uneven samples, every schedule (gpipe, 1f1b, custom), recompute on and off,
one device idle in the last plan. Each plan is checked before any rank
starts, then the N spawned gloo ranks run it for a few iterations and switch
live to the next (layers, tied parameters and optimizer state move between
ranks). After each plan every replica of every layer (parameters and
buffers) and the mean loss are compared with
:class:`~hetpilot.trainer.reference.ReferenceRun`, which takes the same steps
in one process on the same microbatches, accumulating gradients in float64.
Exit 0 when the largest absolute difference is at most ``--tolerance``
(1e-9); otherwise the report names the layer and tensor that differ most.

**Rounding noise.** A gradient that is zero in exact arithmetic (a bias right
before BatchNorm, the key bias of attention) is rounding noise, different in
every order of summation, and Adam scales noise up to steps of up to
``lr * noise / eps``: with ``nn.Linear`` + ``BatchNorm1d`` and Adam at lr 1e-2
such a bias differed by 1.7e-9 at 4 ranks while every other tensor agreed to
1e-14. So the float64 check steps two copies of the reference whose
parameters start a few ulps away (each multiplied by ``1 + u * 4 eps``, ``u``
uniform in [-1, 1]) when a difference is above the tolerance, and compares
again: a tensor's difference is counted beyond :data:`NOISE_FACTOR` times the
larger of the copies' distances from the reference there. For a tensor that
follows its gradient they stay within ~1e-14 and change nothing, while a noise
tensor's copies drift as far as the runtime does, and the report names it. A
bug confined to such a tensor (which the loss does not depend on) is not seen;
any other is. A run within the tolerance costs no second pass.

Before any rank starts, the job runs one microbatch in one process
(:mod:`hetpilot.trainer.preflight`): what cannot train is refused (exit 2)
naming the key, and a loss that is not a mean over samples gets a note.

With ``--dtype bfloat16`` or ``float16`` the ranks run mixed precision
(:mod:`hetpilot.trainer.precision`) and are compared twice, layer by layer
(all of a layer's floating tensors as one vector, L2 norms; integer buffers
must be equal), and by the mean loss:

* **correctness**, against one process in the same mixed precision (autocast,
  the same casts at the plan's cuts, the same loss scale and skipped steps):
  ``|run - ref| / |ref - start|``, the error relative to how far the
  reference moved the layer, at most :data:`SAME_PRECISION_TOLERANCE` (0.5).
  Measured on the shipped examples at 2 and 4 ranks: 0 (mlp), <= 0.09
  (resnet), <= 0.30 (gpt: the key bias, whose exact gradient is zero, is
  rounding noise that Adam turns into full-size steps); a lost or
  mis-weighted gradient is an error of order 1;
* **precision**, against plain float32 in one process: ``|run - ref| / |ref|``
  at most :data:`MIXED_TOLERANCE` (bfloat16 0.1, float16 0.05). Measured on
  the same runs: <= 0.046 (bfloat16), <= 0.015 (float16).

The references compute on one thread, as each rank does: on the machine's 2
threads a kernel summed in another order, and ``testing.activation_jobs:decoder_tiny``
(``nn.TransformerDecoderLayer``, causal mask, Adam, whose key biases' noise
Adam turns into full steps) was 0.75 from one process in bfloat16; on one
thread it is exactly equal. Where either comparison is above its tolerance,
both are redone beyond noise floors, tensor by tensor (L2 distances, then
over the layer as above). Against the same precision, a tensor counts beyond
:data:`MIXED_NOISE_FACTOR` (2) times the distance two copies of that
reference, started 4 float32 ulps away, end from it (on 2 threads
``decoder_tiny`` was 0.0035 beyond them); the same job with one rank's loss
1.2x too heavy stays at 0.70, and 3x at 3.1 (``misweighted_decoder_tiny``).
Against float32, a tensor counts beyond how far one process in the low dtype
is from float32 there: a model that bfloat16 itself moves 55% (``mobile_tiny``: depthwise
convolutions, InstanceNorm after a 1x1 conv) shows the model's sensitivity,
not the runtime's error, which the same-precision comparison bounds; the mean
loss likewise, beyond the copies' losses or one process's own loss.

Dropout and other random draws in a layer's forward are compared exactly:
each stage's forward of each microbatch draws from generators seeded by the
data position, the group, the stage's first layer and the microbatch
(:func:`hetpilot.trainer.pipeline.microbatch_seed`), and the reference seeds
the same way; dataset items are read under per-item seeds
(:mod:`hetpilot.trainer.itemseed`), the dataset's own generators included.
Randomness elsewhere (in the loss) must be deterministic.

With ``--device cuda`` every rank computes on GPU 0 (NCCL refuses two ranks on
one GPU, so they talk over gloo: its all-reduce and broadcast take CUDA
tensors, its send and recv do not, so activations, gradients and moved layer
state cross through host memory, :func:`hetpilot.trainer.activations.through_host`),
and the references compute on the same GPU with the same per-microbatch seeds
(CUDA's generator too), then everything is compared on the CPU. The preflight
still runs on the CPU. With ``--backend nccl`` (a machine with at least N GPUs)
rank r computes on GPU r and the ranks talk over NCCL, as ``hetpilot train`` does
under torchrun on such a host: activations, gradients, the gradient sync and moved
layer state cross between GPUs as CUDA tensors; the references compute on GPU 0.
**Not yet run**: no machine with two GPUs has been lent to this project.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from hetpilot.planner.errors import ValidationError
from hetpilot.planner.serde import plan_from_dict, plan_to_dict
from hetpilot.planner.types import Plan
from torch import nn

from .jobspec import load_job
from .launch import BACKENDS, spawn
from .layers import copy_layers
from .plans import check_plan, random_plan
from .preflight import preflight, split_degrees
from .statediff import (
    MIXED_NOISE_FACTOR,
    NOISE_FACTOR,
    Difference,
    Floors,
    _compare,
    _floors,
    _noisiest,
    _perturb,
)

__all__ = ["BUILTIN_JOB", "MIXED_TOLERANCE", "Difference", "make_layers", "run_check",
           "summarize_plan"]

SCHEDULE_CYCLE = ("1f1b", "custom", "gpipe")
BUILTIN_JOB = "hetpilot.trainer.examples:mlp"
"""The job train-check runs without ``--job``."""
MIXED_TOLERANCE = {"bfloat16": 0.1, "float16": 0.05}
"""Default tolerance against plain float32 under mixed precision (module docstring)."""
SAME_PRECISION_TOLERANCE = 0.5
"""Against one process in the same mixed precision (module docstring)."""
NOISE_COPIES = 2
"""References started a few ulps away that measure the noise floor."""


def make_layers(num_layers: int, width: int = 6, d_in: int = 4, d_out: int = 2) -> list[Any]:
    """Factories of a small tanh MLP chain (layer 0: d_in->width, last: width->d_out)."""

    def factory(i: int) -> Any:
        def build() -> nn.Module:
            a = d_in if i == 0 else width
            if i == num_layers - 1:
                return nn.Linear(a, d_out)
            return nn.Sequential(nn.Linear(a, width), nn.Tanh())

        return build

    return [factory(i) for i in range(num_layers)]


def _dataset(size: int, seed: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(size, 2, generator=gen, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, y)


def _adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def summarize_plan(plan: Plan) -> str:
    parts = []
    for g in plan.groups:
        stages = " | ".join(
            f"{'+'.join(s.devices)}[{s.layers[0]},{s.layers[1]}){'R' if s.recompute else ''}"
            for s in g.stages
        )
        parts.append(f"{g.samples}: {stages}")
    return f"{plan.schedule:6s} " + "  ;  ".join(parts)


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> None:
    from .runtime import Trainer, TrainerConfig

    device = _rank_device(cfg["device"], cfg["backend"], rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = load_job(cfg["job"], "--job")
    plans = [plan_from_dict(p) for p in cfg["plans"]]
    trainer = Trainer(
        spec["layers"], spec["loss"], spec["optimizer"], spec["dataset"],
        TrainerConfig(global_batch=spec["global_batch"], device_id=f"local:{rank}",
                      seed=cfg["seed"], dtype=getattr(torch, cfg["dtype"]), device=device,
                      tp_plan=spec.get("tp_plan")),
    )
    out = Path(cfg["out"])
    if rank == 0:  # rank 0's modules are the runtime's starting point: the reference's too
        torch.save({layer: module.state_dict() for layer, module in enumerate(spec["layers"])
                    if isinstance(module, nn.Module)}, out / "init.pt")
    for i, plan in enumerate(plans):
        trainer.switch(plan, i + 1)
        applied, losses, scales = [], [], []  # float16: a step the loss scaler skips, the reference skips
        for _ in range(cfg["iterations"]):
            scaler = trainer.loss_scaler
            skipped = scaler.skipped if scaler is not None else 0
            scales.append(scaler.scale if scaler is not None else 1.0)
            losses.append(trainer.train_epoch(max_iterations=1)["loss"])
            applied.append(scaler is None or scaler.skipped == skipped)
        state = trainer.holdings.full_states()  # split layers gathered: full tensors
        torch.save(state, out / f"plan{i}_rank{rank}.pt")
        if rank == 0:
            torch.save({"applied": applied, "scales": scales, "loss": sum(losses) / len(losses),
                        "switch": dict(trainer.last_switch)}, out / f"plan{i}.pt")


def _device(name: str) -> torch.device:
    """``--device``: the CPU, or GPU 0, where the references compute (and every rank, over
    gloo)."""
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def _rank_device(name: str, backend: str, rank: int) -> torch.device:
    """Where rank ``rank`` computes: under NCCL on its own GPU, else where ``--device`` says."""
    return torch.device("cuda", rank) if backend == "nccl" else _device(name)


def check_backend(backend: str, device: str, ranks: int, gpus: int, nccl: bool) -> None:
    """Refuse a ``--backend`` this machine cannot run, naming the flag, before any rank
    starts (``gpus``: CUDA devices visible; ``nccl``: torch built with NCCL)."""
    if backend not in BACKENDS:
        raise ValidationError("--backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "nccl":
        return
    if device != "cuda":
        raise ValidationError("--backend", "nccl needs --device cuda")
    if not nccl:
        raise ValidationError("--backend", "nccl: this torch was built without NCCL")
    if gpus < ranks:
        raise ValidationError("--backend", f"nccl takes one GPU per rank: --ranks {ranks} needs "
                                           f"{ranks} CUDA devices, {gpus} visible here")


def _microbatch(global_batch: int, ranks: int) -> int:
    """The largest microbatch size leaving at least two microbatches per rank."""
    fits = [m for m in range(1, global_batch + 1)
            if global_batch % m == 0 and global_batch // m >= 2 * ranks]
    return max(fits) if fits else 1


def draw_plans(rng: random.Random, ranks: int, num_layers: int, global_batch: int,
               microbatch: int, degrees: Sequence[int] = (),
               split: set[int] | None = None) -> list[Plan]:
    """Random valid plans until every layer boundary has been a cut (at least three plans;
    schedules in turn, recompute on in every other plan, the last leaves one device idle).
    With ``degrees`` (those a job's ``tp_plan`` can split its layers, at most ``ranks``),
    plans with tensor-parallel stages come between them, so the ranks switch live from
    degree 1 to degree t and back: one plan per degree on one group (with pipeline cuts
    where ranks are left), and on 4 ranks or more also a plan of two uneven groups that
    split layers differently (degree 2 in one). Each of those is drawn again (up to 50
    times) until each of its tensor-parallel stages holds a layer of ``split`` (those the
    ``tp_plan`` splits)."""
    devices = [f"local:{r}" for r in range(ranks)]
    uncovered = set(range(1, num_layers))
    schedules = list(SCHEDULE_CYCLE)
    rng.shuffle(schedules)
    plans: list[Plan] = []
    limit = max(3, 4 * num_layers)
    while len(plans) < 3 or (uncovered and len(plans) < limit):
        i = len(plans)
        groups = (rng.randint(min(2, ranks), ranks) if i == 0 else max(1, ranks // 2)
                  if i == 1 else 1 if uncovered else None)
        plans.append(random_plan(
            rng, devices, num_layers, global_batch, microbatch, schedules[i % len(schedules)],
            groups=groups, prefer_cuts=uncovered, recompute_p=0.5 if i % 2 == 0 else 0.0))
    last = plans[-1]
    plans.append(random_plan(rng, devices, num_layers, global_batch, microbatch,
                             schedules[len(plans) % len(schedules)], leave_idle=True,
                             recompute_p=0.0 if any(s.recompute for g in last.groups
                                                    for s in g.stages) else 0.5))
    if not degrees:
        return plans
    def draw(schedule: str, groups: int, degree: int, recompute_p: float) -> Plan:
        for _ in range(50):
            plan = random_plan(rng, devices, num_layers, global_batch, microbatch, schedule,
                               groups=groups, tp_degrees=(degree,), recompute_p=recompute_p)
            if split is None or tp_stages(plan, split) == tp_stages(plan):
                break
        return plan

    tp_plans = [draw(schedules[i % len(schedules)], 1, d, 0.5 if i % 2 else 0.0)
                for i, d in enumerate(degrees)]
    if ranks >= 4 and 2 in degrees:
        tp_plans.append(draw(schedules[len(tp_plans) % len(schedules)], 2, 2, 0.3))
    mixed: list[Plan] = []
    for i, plan in enumerate(plans):  # 1 -> t -> 1 -> ...
        mixed.append(plan)
        if i < len(tp_plans):
            mixed.append(tp_plans[i])
    return mixed


def tp_stages(plan: Plan, split: set[int] | None = None) -> int:
    """The tensor-parallel stages of ``plan`` (with ``split``: those holding one of these
    layers, which the job's ``tp_plan`` splits)."""
    return sum(1 for g in plan.groups for s in g.stages if s.tp > 1 and (
        split is None or not split.isdisjoint(range(*s.layers))))


def run_check(
    ranks: int,
    *,
    job: str = BUILTIN_JOB,
    seed: int = 0,
    iterations: int = 2,
    timeout_s: float = 300.0,
    dtype: str = "float64",
    tolerance: float | None = None,
    log: Any = print,
    device: str = "cpu",
    backend: str = "gloo",
) -> dict[str, Difference]:
    """Run the check (module docstring); return, per reference, the largest difference and
    where it is: absolute in float64, relative (to the reference's change) under mixed
    precision. Where a float64 difference is above ``tolerance`` (default 1e-9), the
    comparison is redone beyond each tensor's rounding-noise floor (module docstring),
    which costs two more reference runs only then. ``device="cuda"``: the ranks share GPU
    0 over gloo, or with ``backend="nccl"`` take a GPU each, and the references compute on
    GPU 0 (module docstring)."""
    from .reference import ReferenceRun, build_layers

    if device not in ("cpu", "cuda"):
        raise ValidationError("--device", f"must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValidationError("--device", "cuda: no CUDA device here "
                                          "(torch.cuda.is_available() is false); use --device cpu")
    import torch.distributed as dist

    check_backend(backend, device, ranks, torch.cuda.device_count() if device == "cuda" else 0,
                  dist.is_nccl_available())
    mixed = dtype in MIXED_TOLERANCE
    spec = load_job(job, "--job")
    num_layers, batch = len(list(spec["layers"])), int(spec["global_batch"])
    microbatch = int(spec.get("microbatch_size") or _microbatch(batch, ranks))
    param_dtype, compute_dtype = next(iter(_references(dtype).values()))
    for note in preflight(spec, f"--job: {job}()", microbatch, seed, param_dtype,
                          compute_dtype, ranks_on=device):  # refused here, before any rank
        log(f"note: {note}")
    degrees, why, split = split_degrees(spec, f"--job: {job}()", microbatch, seed, param_dtype,
                                 [d for d in (2, 4) if d <= ranks])
    if why and not degrees:  # its tp_plan splits no layer any way these ranks allow
        raise ValidationError(f"--job: {job}()['tp_plan']", why[0])
    for reason in why:
        log(f"note: no tensor-parallel stage of {reason}")
    tensor_parallel = spec.get("tp_plan") is not None
    rng = random.Random(seed)
    plans = draw_plans(rng, ranks, num_layers, batch, microbatch, degrees, set(split))
    devices = [f"local:{r}" for r in range(ranks)]
    for plan in plans:  # refused here, before any rank starts
        check_plan(plan, devices, num_layers, batch, tensor_parallel=tensor_parallel)
    cfg = {"plans": [plan_to_dict(p) for p in plans], "job": job, "iterations": iterations,
           "seed": seed, "dtype": dtype, "device": device, "backend": backend}
    with tempfile.TemporaryDirectory(prefix="hetpilot-train-check-") as tmp:
        cfg["out"] = tmp
        started = time.monotonic()
        spawn(_worker, ranks, (cfg,), timeout_s, backend=backend)
        took = time.monotonic() - started
        init = torch.load(Path(tmp) / "init.pt", map_location="cpu", weights_only=True)

        def reference(fresh: bool, ref_dtype: torch.dtype, compute: torch.dtype | None,
                      perturb: int | None = None) -> ReferenceRun:
            own = _own_job(job, spec, fresh=fresh)
            layers = build_layers(list(own["layers"]), seed, ref_dtype)
            for layer, state in init.items():
                layers[layer].load_state_dict(state)
            if perturb is not None:
                _perturb(layers, perturb)
            return ReferenceRun(layers, own["loss"], own["optimizer"], own["dataset"],
                                batch, seed=seed, dtype=ref_dtype, compute_dtype=compute,
                                device=_device(device))

        with _one_thread():  # as each rank computes (launch.init_local): the same kernels
            refs = {label: reference(r > 0, ref_dtype, compute)
                    for r, (label, (ref_dtype, compute)) in enumerate(_references(dtype).items())}
            names = [type(m).__name__ for m in refs[next(iter(refs))].layers]
            worst = _compare_plans(Path(tmp), plans, ranks, refs, [], names, mixed, log)
            if _above(worst, dtype, tolerance):
                log(f"above the tolerance: again, with each tensor's "
                    f"rounding-noise floor from {NOISE_COPIES} copies of the reference started "
                    "4 ulps away" + (f", and float32's less the drift of {dtype} in one process "
                                     "from it" if mixed else ""))
                refs = {label: reference(True, *kinds) for label, kinds in _references(dtype).items()}
                first = next(iter(_references(dtype).values()))
                copies = [reference(True, *first, perturb=c + 1) for c in range(NOISE_COPIES)]
                worst = _compare_plans(Path(tmp), plans, ranks, refs, copies, names, mixed, log)
    where = ""
    if backend == "nccl":
        where = f" on cuda:0-{ranks - 1} over NCCL"
    elif device == "cuda":
        where = " on cuda:0"
    log(f"{ranks} ranks{where}, {len(plans)} plans, "
        f"microbatch {microbatch}, {dtype}, {took:.1f} s")
    if tensor_parallel:
        log(f"tensor-parallel stages checked: {sum(tp_stages(p, set(split)) for p in plans)}")
    return worst


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch computing with one thread, as each rank does. With more, a kernel may sum in
    another order than the ranks' (a matmul's blocks), and the reference drifts from them
    by rounding noise that depends on the machine's cores: the same bfloat16 check was 0.75
    off on 2 threads and exactly equal on 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _limit(label: str, dtype: str, tolerance: float | None) -> float:
    """The tolerance of the comparison with reference ``label`` (module docstring)."""
    if label == dtype:
        return 1e-9 if tolerance is None else tolerance
    if label.startswith(dtype):
        return SAME_PRECISION_TOLERANCE
    return MIXED_TOLERANCE[dtype] if tolerance is None else tolerance


def _above(worst: dict[str, Difference], dtype: str, tolerance: float | None) -> bool:
    return any(diff.value > _limit(label, dtype, tolerance) for label, diff in worst.items())


def _compare_plans(tmp: Path, plans: list[Plan], ranks: int, refs: dict[str, Any],
                   copies: list[Any], names: list[str], mixed: bool,
                   log: Any) -> dict[str, Difference]:
    """Step each reference (and the perturbed ``copies`` of the first, for the noise
    floors) through the plans the ranks ran, comparing after each plan with what the ranks
    saved in ``tmp``; per reference, the largest difference (beyond the floors, with
    ``copies``: :func:`_floors`)."""
    worst = {label: Difference(beyond_noise=bool(copies)) for label in refs}
    for i, plan in enumerate(plans):
        info = torch.load(tmp / f"plan{i}.pt", map_location="cpu", weights_only=False)
        held = [torch.load(tmp / f"plan{i}_rank{rank}.pt", map_location="cpu", weights_only=True)
                for rank in range(ranks)]
        skips = info["applied"].count(False)
        log(f"plan v{i + 1} ({len(info['applied'])} it"
            f"{f', {skips} skipped by the loss scaler' if skips else ''}): "
            f"{summarize_plan(plan)}")
        before = {label: ref.states() for label, ref in refs.items()}
        losses = {label: _steps(ref, plan, info) for label, ref in refs.items()}
        after = {label: ref.states() for label, ref in refs.items()}
        floors: dict[str, Floors] = {}
        copy_losses = [_mean(_steps(copy, plan, info)) for copy in copies]
        if copies:
            floors = _floors(before, after, [c.states() for c in copies], mixed)
        first_loss = _mean(losses[next(iter(refs))])
        for label, ref in refs.items():
            same = ref.compute_dtype is not None or not mixed
            factor = NOISE_FACTOR if not mixed else MIXED_NOISE_FACTOR if same else 1.0
            here = _compare(held, after[label], before[label] if same else None, names, mixed,
                            floors.get(label), factor)
            ref_loss = _mean(losses[label])
            # the mean loss, beyond its floor too: the copies' losses (the same precision),
            # or the low-precision process's own loss against float32's
            loss_floor = 0.0 if label not in floors else factor * (
                max(abs(c - ref_loss) for c in copy_losses) if same
                else abs(first_loss - ref_loss))
            scale = max(abs(ref_loss), 1e-30) if mixed else 1.0
            here.update(max(abs(info["loss"] - ref_loss) - loss_floor, 0.0) / scale,
                        "the mean loss")
            if label not in floors:
                log(f"  vs {label}: loss {info['loss']:.6g} (reference {ref_loss:.6g}), "
                    f"{'relative' if mixed else 'max |diff|'} = {here.value:.3e} at "
                    f"{here.where}")
            else:
                what = "rounding noise" if same else f"{next(iter(refs))}'s own drift"
                log(f"  vs {label}: beyond {what} {here.value:.3e} at {here.where}")
                noisiest = _noisiest(held, after[label], before[label] if same else None,
                                     floors[label], names, mixed)
                log(f"  {what}: {noisiest}; the mean loss's floor {loss_floor:.3e}")
                top = factor * max((f for layer in floors[label] for f in layer.values()),
                                   default=0.0)
                if not mixed and (loss_floor, top) > (worst[label].loss_floor,
                                                      worst[label].floor):
                    worst[label].loss_floor, worst[label].floor = loss_floor, top
                    worst[label].noisiest = f"plan v{i + 1}: {noisiest}"
            worst[label].update(here.value, f"plan v{i + 1}, {here.where}")
        log(f"  {sum(len(h) for h in held)} layer replicas; switch: {info['switch']}")
    return worst


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _steps(ref: Any, plan: Plan, info: dict[str, Any]) -> list[float]:
    """``ref`` takes the iterations the ranks took under ``plan`` (float16: the same loss
    scales, the same skipped steps); their losses."""
    scaled = ref.compute_dtype is not None
    return [ref.step(plan, apply=taken, scale=scale if scaled else 1.0)
            for taken, scale in zip(info["applied"], info["scales"], strict=True)]


def _own_job(job: str, spec: dict[str, Any], fresh: bool) -> dict[str, Any]:
    """The job's objects for one reference, as a rank has them: ``spec`` itself, or (``fresh``)
    the job function called again. Not copies of the layers: the optimizer factory or the loss
    may close over the job's own modules (parameter groups chosen by identity, ``p is
    head.weight``), which a copy's parameters are not. A job function returning the same
    module objects again (a cached model) gets copies (ties kept by the memo)."""
    if not fresh:
        return spec
    own = load_job(job, "--job")
    if any(a is b for a, b in zip(own["layers"], spec["layers"], strict=True)):
        own = {**own, "layers": copy_layers(own["layers"])}
    return own


def _references(dtype: str) -> dict[str, tuple[torch.dtype, torch.dtype | None]]:
    """What the ranks are compared with: label -> (parameter dtype, autocast dtype)."""
    if dtype not in MIXED_TOLERANCE:
        return {dtype: (getattr(torch, dtype), None)}
    return {f"{dtype} in one process": (torch.float32, getattr(torch, dtype)),
            "float32 in one process": (torch.float32, None)}


def inconclusive(diff: Difference, limit: float) -> str | None:
    """Why a float64 check that found nothing beyond its noise floors saw nothing: rounding
    noise alone moved the mean loss by more than the tolerance, so a runtime error of that
    size would have been discounted as noise (a BatchNorm normalising 2 values a channel,
    whose runs two ulps apart part within a few steps). None when the floors allow it."""
    if not diff.beyond_noise or diff.loss_floor <= limit:
        return None
    return (f"rounding noise alone moves the mean loss by up to {diff.loss_floor:.3e} "
            f"({NOISE_FACTOR:g}x how far {NOISE_COPIES} copies of the reference started 4 ulps "
            f"away end from it), above the tolerance {limit:g}, so nothing that size could be "
            f"told from noise ({diff.noisiest}). The model is chaotic at this size: give the "
            "job a larger microbatch_size (a BatchNorm over few values a channel amplifies "
            "rounding), check fewer steps (--iterations 1), or a lower learning rate")


def rank_failure(text: str, rank: int) -> str:
    """One line for a rank's traceback ``text``: the exception and the innermost frame."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    error = next((line for line in reversed(lines)
                  if not line.startswith(("File ", "^", "~")) and ":" in line), "?")
    frames = [line for line in lines if line.startswith("File ")]
    at = ""
    if frames:
        parts = frames[-1].split('"')
        lineno = frames[-1].partition(", line ")[2].partition(",")[0]
        if len(parts) > 1 and lineno:
            at = f" (at {parts[1]}:{lineno})"
    return f"rank {rank} failed while training: {error}{at}"


def main(ranks: int, seed: int, tolerance: float | None, timeout_s: float,
         job: str = BUILTIN_JOB, iterations: int = 2, dtype: str = "float64",
         device: str = "cpu", backend: str = "gloo") -> int:
    try:
        worst = run_check(ranks, job=job, seed=seed, iterations=iterations,
                          timeout_s=timeout_s, dtype=dtype, tolerance=tolerance, device=device,
                          backend=backend)
    except ValidationError as exc:
        print(f"hetpilot train-check: error: {exc}", file=sys.stderr)
        return 2
    except TimeoutError as exc:
        print(f"hetpilot train-check: error: {exc}", file=sys.stderr)
        return 1
    except torch.multiprocessing.ProcessRaisedException as exc:  # the job failed in a rank
        print(str(exc).strip(), file=sys.stderr)  # its traceback: the user's code in it
        print(f"hetpilot train-check: error: --job: {rank_failure(str(exc), exc.error_index)}",
              file=sys.stderr)
        return 2
    except torch.multiprocessing.ProcessExitedException as exc:  # killed: memory, a signal
        print(f"hetpilot train-check: error: {exc}", file=sys.stderr)
        return 1
    ok = True
    for label, diff in worst.items():
        limit = _limit(label, dtype, tolerance)
        fine = diff.value <= limit
        ok = ok and fine
        if fine and (why := inconclusive(diff, limit)) is not None:
            print(f"vs {label}: INCONCLUSIVE: {why}")
            ok = False
            continue
        if fine and diff.beyond_noise and diff.floor > limit:
            print(f"note: a tensor's rounding-noise floor is above the tolerance "
                  f"({diff.noisiest}): a difference there up to {NOISE_FACTOR:g}x its floor "
                  f"counts as noise; the mean loss, which rounding moved by "
                  f"{diff.loss_floor:.3e} at most, barely depends on it")
        kind = "relative difference" if label != dtype else "absolute difference"
        if diff.beyond_noise:
            kind += (" beyond rounding noise" if label.startswith(dtype) else
                     f" beyond {dtype} in one process's own drift")
        print(f"vs {label}: largest {kind} {diff.value:.3e} at {diff.where} "
              f"(tolerance {limit:g}) {'ok' if fine else 'FAIL'}")
    return 0 if ok else 1
