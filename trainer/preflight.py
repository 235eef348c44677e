"""What train-check tries in one process before any rank starts.

A job that cannot train under the runtime should be refused with one line
naming the key (exit 2), not fail as a traceback in a spawned rank after
seconds of start-up. :func:`preflight` builds the layers as the ranks do (on
copies), runs one microbatch of the dataset through them and the loss, in the
check's dtype, and refuses:

* a layer whose factory is not one, or returns no module, or a module sharing a
  parameter with another layer (ties are found on modules only) (``layers``);
* a layer whose forward writes in place into a tensor autograd saved for an earlier
  microbatch's backward (an EMA buffer updated with ``lerp_`` and used in a product):
  pipelines run several forwards before their backwards (``layers``);
* a layer that raises on that microbatch, e.g. one that casts to float32
  (``.float()``) in a float64 check (``layers``, naming the item);
* a loss that is not one floating number (``reduction='none'``) (``loss``);
* a layer whose forward writes into one of its parameters
  (``nn.Embedding(max_norm=...)`` renormalises the rows it looks up, in place):
  data-parallel replicas see other samples, so their copies would drift apart
  (``layers``, naming the item and the parameter);
* an optimizer whose step fails on a layer's gradients as the runtime hands them:
  a sparse embedding gradient stays sparse under a plan of one data-parallel group
  (``Adam`` refuses it) and is summed into the sync's dense buffer under several
  (``SparseAdam`` refuses that) (``optimizer``);
* an optimizer whose step couples the layers' parameters (one optimizer over all of
  them steps to other values than one per layer, as the runtime builds them: a
  gradient-norm clip over all its parameters), or that keeps state outside its
  ``state_dict`` (by which it moves with its layer to another rank) (``optimizer``);
* a buffer shared by two layers (the same module at two places in
  ``layers``) that the forward updates (BatchNorm's running statistics,
  spectral norm's vectors): each rank holding one of the layers would update
  its own copy, which no rule can merge into the one process's sequence of
  updates. Shared parameters are fine (ties); so are shared buffers that no
  forward changes (a rotary table).

It also says (a note, not a refusal) when the loss is not a mean over samples:
the loss of the global batch's outputs differs from the ``m/B``-weighted sum of
its microbatches' losses (on the same outputs, float64), as with
``cross_entropy(ignore_index=...)`` over padded targets or any masked mean. The
runtime, like gradient accumulation in one process, trains on that weighted sum,
so the objective then depends on the microbatch size; the reference takes the
same microbatches, so train-check cannot see it otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hetpilot.planner.errors import ValidationError
from torch import nn
from torch.utils import _pytree as pytree

from .activations import describe, flatten, map_tensors
from .layers import build_layer, copy_layers
from .loss_notes import MEAN_TOLERANCE, gradient_note, job_loss, mean_note, read_batch
from .optimizer_checks import OnJobParameters, checked_step
from .opwatch import OpWatch
from .pipeline import loss_problem, seeded
from .precision import Precision
from .reference import build_layers
from .replicas import hidden_reference
from .tensorparallel import matched, shared_parameters, split_problem

__all__ = ["MEAN_TOLERANCE", "preflight"]


def preflight(spec: dict[str, Any], where: str, microbatch: int, seed: int,
              dtype: torch.dtype | None, compute_dtype: torch.dtype | None = None,
              ranks_on: str = "cpu") -> list[str]:
    """Check ``spec`` (a loaded job, :func:`~hetpilot.trainer.jobspec.load_job`) on one
    microbatch, on the CPU; raise :class:`ValidationError` naming ``where['key']`` (module
    docstring); return notes for the user.

    ``ranks_on``: where the ranks compute. When it is not the CPU and the mixed-precision
    run fails for want of a CPU kernel in the low dtype (a float16 LSTM or RReLU: torch's
    CPU has none, CUDA has), the preflight runs again without autocast and says so in a
    note, instead of refusing a job its GPU ranks can train. (The degrees a ``tp_plan``
    can split the layers: :func:`split_degrees`.)"""
    try:
        return _preflight(spec, where, microbatch, seed, dtype, compute_dtype)
    except ValidationError as exc:
        if compute_dtype is None or ranks_on == "cpu" or not _lacks_cpu_kernel(exc):
            raise
        low = str(compute_dtype).removeprefix("torch.")
        notes = _preflight(spec, where, microbatch, seed, dtype, None)
        return [f"the preflight ran without {low} autocast, as this CPU has no {low} kernel "
                f"for the job ({exc}); the ranks compute on {ranks_on}", *notes]


_NO_CPU_KERNEL = ("not implemented for 'half'", "not implemented for 'bfloat16'",
                  "could not create a primitive")
"""What torch's CPU says when it has no kernel for a dtype (oneDNN's LSTM says the last)."""


def _lacks_cpu_kernel(exc: ValidationError) -> bool:
    text = f"{exc} {exc.__cause__ or ''}".lower()
    return any(words in text for words in _NO_CPU_KERNEL)


def _preflight(spec: dict[str, Any], where: str, microbatch: int, seed: int,
               dtype: torch.dtype | None, compute_dtype: torch.dtype | None) -> list[str]:

    def bad(key: str, problem: str) -> ValidationError:
        return ValidationError(f"{where}['{key}']", problem)

    with torch.random.fork_rng(devices=[]):
        layers, originals = _build(spec["layers"], seed, dtype, bad)
        precision = Precision(torch.float32, compute_dtype) if compute_dtype else Precision()
        x = read_batch(spec["dataset"], range(microbatch), 0, dtype, bad, seed)
        target = read_batch(spec["dataset"], range(microbatch), 1, dtype, bad, seed)
        before = [b.detach().clone() for b in _buffers(layers)]
        params = [[p.detach().clone() for p in layer.parameters()] for layer in layers]
        in_dtype = f" in {str(dtype).removeprefix('torch.')}" if dtype is not None else ""
        if compute_dtype is not None:
            in_dtype += f" under {str(compute_dtype).removeprefix('torch.')} autocast"
        drift: str | None = None  # the first layer returning floating values of another dtype
        islands: list[str] = []  # float64: layers computing part in a narrower dtype
        with precision.autocast(torch.device("cpu")):
            for i, layer in enumerate(layers):
                twin = _twin(layer, x)
                watch = OpWatch(dtype if dtype == torch.float64 and not compute_dtype else None)
                try:
                    with seeded(_PROBE_SEED, torch.device("cpu")), watch:
                        x = layer(x)
                except Exception as exc:
                    hint = _dtype_hint(exc, dtype, drift, low=compute_dtype, watch=watch)
                    raise bad("layers", f"item {i} ({type(layer).__name__}) failed on a "
                                        f"microbatch of {microbatch} samples{in_dtype}: "
                                        f"{type(exc).__name__}: {exc}{hint}"
                                        f"{_size_hint(spec, microbatch)}") from exc
                if watch.narrow:
                    islands.append(f"item {i} ({type(layer).__name__}): {watch.islands()}")
                if i + 1 < len(layers):  # a cut may follow: its activation must cross
                    try:
                        describe(flatten(x)[0])
                    except ValueError as exc:
                        raise bad("layers", f"item {i} ({type(layer).__name__}): {exc}") from exc
                if twin is not None:
                    _refuse_hidden_state(i, *twin, bad)
                    _refuse_overwritten_saved(i, *twin, bad)
                if drift is None and dtype == torch.float64 and not compute_dtype:
                    other = _other_float(x, dtype)
                    if other is not None:
                        drift = f"item {i} ({type(layer).__name__}) returned {other} values"
            try:
                loss = job_loss(spec, dtype)(x, target)
            except Exception as exc:
                raise bad("loss", f"failed on the last layer's output and a microbatch's "
                                  f"targets: {type(exc).__name__}: {exc}"
                                  f"{_dtype_hint(exc, dtype, None, 'the loss')}") from exc
        problem = loss_problem(loss)
        if problem is not None:
            raise bad("loss", problem)
        _check_metric(spec.get("metric"), x, target, precision, bad)
        probe = job_loss(spec, dtype)
        _refuse_loss_state(probe, x, target, precision, bad)
        _refuse_loss_on_parameters(spec["layers"], probe, x, target, precision, bad)
        _refuse_written_parameters(layers, params, bad)
        _refuse_shared_updates(layers, before, bad)
        checked_step(layers, loss, OnJobParameters(spec["optimizer"], originals), bad)
        notes = [] if not islands else [
            "parts of the model compute in a narrower dtype inside this float64 check (the "
            "layer casts and casts back), so those ops are checked in that dtype: "
            + "; ".join(islands[:4]) + ("; ..." if len(islands) > 4 else "")]
        if microbatch < spec["global_batch"]:
            note = mean_note(spec, microbatch, seed) or gradient_note(spec, microbatch, seed)
            if note is not None:
                notes.append(note)
    return notes


def split_degrees(spec: dict[str, Any], where: str, microbatch: int, seed: int,
                  dtype: torch.dtype | None, degrees: Sequence[int]
                  ) -> tuple[list[int], list[str], list[int]]:
    """Of ``degrees``, those every layer of ``spec`` runs split by its ``tp_plan`` (on one
    microbatch, in one process: :func:`~hetpilot.trainer.tensorparallel.split_problem`),
    why each other one does not (``degree t: item i (Name): why``), and the layers the plan
    splits (the others run whole on each rank of a stage)."""

    def bad(key: str, problem: str) -> ValidationError:
        return ValidationError(f"{where}['{key}']", problem)

    tp_plan = spec.get("tp_plan")
    if tp_plan is None or not degrees:
        return [], [], []
    ok, why, split = list(degrees), [], []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        layers, _ = _build(spec["layers"], seed, dtype, bad)
        shared = shared_parameters(layers)
        x = read_batch(spec["dataset"], range(microbatch), 0, dtype, bad, seed)
        for i, layer in enumerate(layers):
            if matched(layer, tp_plan, keep_whole=shared):
                split.append(i)
            for degree in list(ok):
                problem = _split_refusal(i, layer, x, tp_plan, degree, shared)
                if problem is not None:
                    ok.remove(degree)
                    why.append(f"degree {degree}: {problem}")
            with seeded(_PROBE_SEED, torch.device("cpu")):
                x = layer(x)
    return ok, why, split


def _split_refusal(i: int, layer: nn.Module, x: Any, tp_plan: dict[str, str], degree: int,
                   shared: set[int]) -> str | None:
    """Why layer ``i`` cannot run split ``degree`` ways by the plan (None: it can)."""
    styles = matched(layer, tp_plan, keep_whole=shared)
    if not styles:
        return None
    with seeded(_PROBE_SEED, torch.device("cpu")):
        problem = split_problem(layer, x, styles, degree)
    return None if problem is None else f"item {i} ({type(layer).__name__}): {problem}"


def _check_metric(metric: Any, output: Any, target: Any, precision: Precision,
                  bad: Callable[[str, str], ValidationError]) -> None:
    """The metric runs on one microbatch's output and targets and returns one number, as
    the epoch's evaluation calls it (a metric that raised had ended the run after its
    first epoch of training, with a traceback)."""
    if metric is None:
        return
    try:
        with torch.no_grad(), precision.autocast(torch.device("cpu")):
            value = metric(output, target)
        float(value)
    except Exception as exc:
        raise bad("metric", f"failed on the last layer's output and a microbatch's targets "
                            f"(it must return one number): {type(exc).__name__}: {exc}") from exc


_PROBE_SEED = 20_240_611
"""Seed of the generators for both runs of a layer in :func:`_refuse_hidden_state`."""


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.is_floating_point() or t.is_complex() else t


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Two outputs of a layer are the same pytree with the same values (floating leaves to
    1e-12 relative, NaN equal to NaN). Other objects compare by ``==``; one whose type
    keeps identity as equality (a ``torch.distributions.Normal`` a last layer returns for
    its loss) compares by its attributes, as a pytree: two equal distributions were
    never "the same", and the layer was refused as keeping state of its own."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb:
        return False
    for u, v in zip(la, lb, strict=True):
        if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor):
            if u.shape != v.shape or u.dtype != v.dtype or u.layout != v.layout:
                return False
            if u.layout != torch.strided:  # sparse: allclose and equal take dense tensors
                u, v = u.to_dense(), v.to_dense()
            if u.is_floating_point() or u.is_complex():
                if not torch.allclose(u.detach(), v.detach(), rtol=1e-12, atol=0.0,
                                      equal_nan=True):
                    return False
            elif not torch.equal(u, v):
                return False
        elif isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
            return False
        elif u is v:
            continue
        elif type(u).__eq__ is object.__eq__ and hasattr(u, "__dict__") \
                and type(u) is type(v):
            if depth < 4 and not _same(vars(u), vars(v), depth + 1):
                return False
        else:
            try:
                if bool(u != v):
                    return False
            except Exception:  # values that do not compare: not this check's business
                continue
    return True


def _twin(layer: nn.Module, x: Any) -> tuple[nn.Module, Any] | None:
    """A copy of ``layer`` and its input as they are before the layer runs (None: the layer
    cannot be copied)."""
    try:
        return copy_layers([layer])[0], map_tensors(lambda t: t.detach().clone(), x)
    except Exception:  # a module that cannot be deep-copied: not checked
        return None


def _refuse_hidden_state(i: int, layer: nn.Module, x: Any, bad: Any) -> None:
    """Run ``layer`` (a copy, :func:`_twin`) twice on ``x`` from the same parameters and
    buffers and with the same random draws: outputs that differ come from state outside the
    parameters and buffers, which the runtime neither moves, reconciles nor replays (a step
    counter or a tensor kept in a Python attribute, draws from a generator of the layer's
    own): each rank's copy would advance it by the microbatches it runs, recompute
    included, so that replicas and the one process would part."""
    buffers = [b.detach().clone() for b in layer.buffers()]
    # parameters too: one the forward writes (a running mean kept in a frozen Parameter)
    # is refused by _refuse_written_parameters, with the right words, not here
    params = [q.detach().clone() for q in layer.parameters()]
    outs = []
    with torch.no_grad():
        for _ in range(2):
            live = list(layer.buffers())
            if len(live) != len(buffers):
                return  # the forward registered buffers: nothing to replay from
            for b, value in zip(live, buffers, strict=True):
                b.copy_(value)
            for q, value in zip(layer.parameters(), params, strict=True):
                q.copy_(value)
            try:
                with seeded(_PROBE_SEED, torch.device("cpu")):
                    outs.append(layer(map_tensors(_clone, x)))
            except Exception:  # it ran once on the job's copy: this is not the place
                return
    if not _same(*outs):
        raise bad("layers", f"item {i} ({type(layer).__name__}) returns another output when run "
                            "again on the same microbatch, from the same parameters and "
                            "buffers and with the same random draws: it keeps state of its "
                            "own (a step counter or a tensor in a Python attribute, or a "
                            "generator of its own), which each rank would advance by the "
                            "microbatches it runs, so replicas would part; keep such state "
                            "in a buffer (register_buffer), which the runtime moves and "
                            "reconciles, and draw from torch's default generator")


def _refuse_loss_state(loss_fn: Any, x: Any, target: Any, precision: Precision,
                       bad: Any) -> None:
    """The loss run twice on the same output and targets with the same random draws: a
    value that differs comes from state of the loss's own (an annealing step counter in a
    closure), which each group's last stage would advance by its own microbatches only,
    so the groups, and the one process, would weigh their terms differently."""
    values = []
    with torch.no_grad():
        for _ in range(2):
            try:
                with seeded(_PROBE_SEED, torch.device("cpu")), \
                        precision.autocast(torch.device("cpu")):
                    values.append(loss_fn(map_tensors(_clone, x), map_tensors(_clone, target)))
            except Exception:  # it ran once already: this is not the place
                return
    if not _same(*values):
        raise bad("loss", "returns another value when called again on the same output and "
                          "targets, with the same random draws: it keeps state of its own "
                          "(a step counter in a closure or an attribute, or a generator of "
                          "its own), which each data-parallel group's last stage would "
                          "advance by its own microbatches only; keep such a schedule in a "
                          "layer's buffer (register_buffer), which the runtime reconciles")


def _refuse_loss_on_parameters(specs: Sequence[Any], loss_fn: Any, x: Any, target: Any,
                               precision: Precision, bad: Any) -> None:
    """A loss that reads parameters of layers before the last one directly (an L2 penalty
    over the model's weights in its closure): only the last stage runs the loss, so the
    penalty's gradients would land on that rank's copies of other stages' parameters, which
    no optimizer steps there, and it would read stale values. The last layer's own
    parameters are fine: the last stage holds them (a tie to them included)."""
    last = specs[-1]
    own = {id(q) for q in last.parameters()} if isinstance(last, nn.Module) else set()
    earlier = [(i, name, q) for i, m in enumerate(specs[:-1]) if isinstance(m, nn.Module)
               for name, q in m.named_parameters() if q.requires_grad and id(q) not in own]
    if not earlier:
        return
    with torch.enable_grad():
        try:
            with seeded(_PROBE_SEED, torch.device("cpu")), \
                    precision.autocast(torch.device("cpu")):
                value = loss_fn(map_tensors(lambda t: t.detach(), x), target)
            if not (isinstance(value, torch.Tensor) and value.requires_grad):
                return
            grads = torch.autograd.grad(value, [q for _, _, q in earlier], allow_unused=True)
        except Exception:  # not this check's business
            return
    used = [(i, name) for (i, name, _), g in zip(earlier, grads, strict=True) if g is not None]
    if used:
        i, name = used[0]
        raise bad("loss", f"reads parameter '{name}' of layers item {i} directly (a weight "
                          "penalty over the model's parameters in its closure?): only the "
                          "last stage runs the loss, so its gradient would land on a copy "
                          "that no optimizer steps; use the optimizer's weight_decay, or "
                          "compute the penalty in the layer that holds the weights and pass "
                          "it on in the output")


def _grad_input(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    return t.requires_grad_() if t.is_floating_point() or t.is_complex() else t


def _refuse_overwritten_saved(i: int, layer: nn.Module, x: Any, bad: Any) -> None:
    """Run ``layer`` (a copy, :func:`_twin`) forward on ``x`` twice, then backward the first
    output: a forward writing in place into a tensor that autograd saved for an earlier
    microbatch's backward (an EMA buffer updated with ``lerp_`` and then used in a matmul)
    fails that backward. One process accumulating gradients runs each microbatch's backward
    before the next forward; a pipeline runs several forwards first (gpipe, 1f1b), so such a
    layer failed in a rank. Other failures are not this check's business."""
    try:
        with torch.enable_grad(), seeded(_PROBE_SEED, torch.device("cpu")):
            first = layer(map_tensors(_grad_input, x))
            layer(map_tensors(_grad_input, x))
        leaves = [t for t in pytree.tree_leaves(first)
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not leaves:
            return
        total = sum(t.real.sum() if t.is_complex() else t.sum() for t in leaves)
        assert isinstance(total, torch.Tensor)
        total.backward()
    except RuntimeError as exc:
        if "modified by an inplace operation" not in str(exc):
            return
        raise bad("layers", f"item {i} ({type(layer).__name__}) writes in its forward, in "
                            "place, into a tensor that the backward of an earlier "
                            "microbatch needs (a buffer updated with lerp_/mul_/copy_ and "
                            "then used in a product): a pipeline runs several microbatches' "
                            "forwards before their backwards, so that backward would fail. "
                            "Use a copy where the tensor enters the computation "
                            "(F.linear(x, self.ema.clone()))") from exc
    except Exception:  # it ran once on the job's copy: this is not the place
        return


def _build(specs: Sequence[Any], seed: int, dtype: torch.dtype | None, bad: Any
           ) -> tuple[list[nn.Module], dict[int, tuple[nn.Parameter, nn.Parameter]]]:
    """Copies of the layers as the ranks build them (a copy keeps modules shared between
    layers shared: one deepcopy of the list), and each copy's parameter's original (by the
    copy's id: (copy, original)). Factories are called on the job's own objects first
    (uncast), as each rank calls them: a factory returning a module another layer shares
    parameters with (one it closes over) would lose the tie."""
    try:
        originals = [build_layer(spec, seed, i) for i, spec in enumerate(specs)]
        layers = build_layers(copy_layers(specs), seed, dtype)
    except ValueError as exc:
        if str(exc).startswith("layers: "):
            raise bad("layers", str(exc).removeprefix("layers: ")) from exc
        raise
    seen: dict[int, int] = {}
    for i, layer in enumerate(originals):
        for p in layer.parameters():
            first = seen.setdefault(id(p), i)
            if first != i and not (isinstance(specs[i], nn.Module)
                                   and isinstance(specs[first], nn.Module)):
                raise bad("layers", f"items {first} and {i} share a parameter, and one is a "
                                    "factory: the ranks build factories apart, so the tie "
                                    "would be lost; give tied layers as modules")
    hidden = hidden_reference(specs)
    if hidden is not None:
        raise bad("layers", hidden)
    origin = {id(c): (c, o) for layer, twin in zip(layers, originals, strict=True)
              for c, o in zip(layer.parameters(), twin.parameters(), strict=True)}
    return layers, origin


def _other_float(value: Any, dtype: torch.dtype) -> str | None:
    """The dtype of a floating tensor leaf of ``value`` that is not ``dtype``, if any."""
    # read the leaves, not map over them: a rebuilt PackedSequence refuses None as its data
    found = [str(t.dtype).removeprefix("torch.") for t in flatten(value)[0]
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype]
    return found[0] if found else None


def _size_hint(spec: dict[str, Any], microbatch: int) -> str:
    """Where a microbatch of one sample came from, when the job did not give the size:
    train-check picks the largest leaving each rank two microbatches, which may be 1
    (BatchNorm fails on one sample)."""
    if spec.get("microbatch_size") or microbatch != 1:
        return ""
    return (f" (train-check chose microbatches of 1 sample, so that each rank gets two of "
            f"global_batch {spec['global_batch']}; give the job a 'microbatch_size' to "
            "choose it)")


def _dtype_hint(exc: Exception, dtype: torch.dtype | None, drift: str | None,
                what: str = "a layer", low: torch.dtype | None = None,
                watch: OpWatch | None = None) -> str:
    text = str(exc).lower()  # "Double"/"Float" in most messages, "double"/"float" in conv's
    if dtype == torch.float64 and watch is not None and watch.last and watch.lacks_kernel() \
            and watch.last_inputs == [torch.float64] * len(watch.last_inputs) \
            and "double" in text:
        return (f" ({watch.last} has no float64 kernel: it failed on float64 inputs only; "
                "train-check runs float64, so the layer must take another path there; a "
                "transformers MoE takes experts_implementation=\"eager\" in its config)")
    if low == torch.float16 and any(words in text for words in _NO_CPU_KERNEL):
        return (" (torch has no float16 kernel for it on a CPU: on CPU ranks use --dtype "
                "bfloat16; GPU ranks have one, --device cuda)")
    if dtype == torch.float64 and "double" in text and ("float" in text or "half" in text):
        return (f" ({drift + '; ' if drift else ''}train-check runs float64: {what} must "
                "compute in its input's dtype, not cast to float32 with .float() or use "
                "float32 tensors of its own (class weights: pass them in the output's dtype, "
                "w.to(output.dtype), or give the loss as a module, which is cast)")
    return ""


def _buffers(layers: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [b for layer in layers for b in layer.buffers()]


def _refuse_written_parameters(layers: Sequence[nn.Module],
                               before: Sequence[Sequence[torch.Tensor]], bad: Any) -> None:
    """A parameter the forward wrote into (module docstring)."""
    for i, (layer, saved) in enumerate(zip(layers, before, strict=True)):
        for (name, p), was in zip(layer.named_parameters(), saved, strict=True):
            if not torch.equal(p.detach(), was):
                raise bad("layers", f"item {i} ({type(layer).__name__}) writes into its "
                                    f"parameter {name!r} in the forward (nn.Embedding's "
                                    "max_norm does): replicas seeing other samples would "
                                    "drift apart, as the optimizer is the only one that "
                                    "may change a parameter; compute the change in the "
                                    "forward without writing it back")


def _refuse_shared_updates(layers: Sequence[nn.Module], before: Sequence[torch.Tensor],
                           bad: Any) -> None:
    """A buffer of two layers that the forward changed (module docstring)."""
    uses: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(layers):
        for name, buf in layer.named_buffers(remove_duplicate=False):
            uses.setdefault(id(buf), []).append((i, name))
    for buf, was in zip(_buffers(layers), before, strict=True):
        where = uses[id(buf)]
        if len({i for i, _ in where}) > 1 and not torch.equal(buf, was):
            (a, name), (b, _) = where[0], next(u for u in where if u[0] != where[0][0])
            raise bad("layers", f"items {a} and {b} share the buffer {name!r} (the same "
                                f"{type(layers[a]).__name__} at two places?), which the "
                                "forward updates; ranks holding either layer would update "
                                "copies of it apart. Layers may share parameters, not "
                                "updated buffers: give each place its own module")
