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

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hetpilot.planner.errors import ValidationError
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.data import default_collate

from .activations import describe, flatten, map_tensors
from .itemseed import read_items
from .opwatch import OpWatch
from .pipeline import loss_problem, seeded
from .precision import Precision
from .reference import build_layers
from .replicas import hidden_reference
from .runtime import build_layer, copy_layers, place_loss

__all__ = ["MEAN_TOLERANCE", "preflight"]

MEAN_TOLERANCE = 1e-9
"""Relative difference (float64) above which the loss is not taken for a mean over samples."""


def preflight(spec: dict[str, Any], where: str, microbatch: int, seed: int,
              dtype: torch.dtype | None, compute_dtype: torch.dtype | None = None,
              ranks_on: str = "cpu") -> list[str]:
    """Check ``spec`` (a loaded job, :func:`~hetpilot.trainer.jobspec.load_job`) on one
    microbatch, on the CPU; raise :class:`ValidationError` naming ``where['key']`` (module
    docstring); return notes for the user.

    ``ranks_on``: where the ranks compute. When it is not the CPU and the mixed-precision
    run fails for want of a CPU kernel in the low dtype (a float16 LSTM or RReLU: torch's
    CPU has none, CUDA has), the preflight runs again without autocast and says so in a
    note, instead of refusing a job its GPU ranks can train."""
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
        x = _batch(spec["dataset"], range(microbatch), 0, dtype, bad, seed)
        target = _batch(spec["dataset"], range(microbatch), 1, dtype, bad, seed)
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
                loss = _loss(spec, dtype)(x, target)
            except Exception as exc:
                raise bad("loss", f"failed on the last layer's output and a microbatch's "
                                  f"targets: {type(exc).__name__}: {exc}"
                                  f"{_dtype_hint(exc, dtype, None, 'the loss')}") from exc
        problem = loss_problem(loss)
        if problem is not None:
            raise bad("loss", problem)
        _check_metric(spec.get("metric"), x, target, precision, bad)
        probe = _loss(spec, dtype)
        _refuse_loss_state(probe, x, target, precision, bad)
        _refuse_loss_on_parameters(spec["layers"], probe, x, target, precision, bad)
        _refuse_written_parameters(layers, params, bad)
        _refuse_shared_updates(layers, before, bad)
        _step(layers, loss, _OnJobParameters(spec["optimizer"], originals), bad)
        notes = [] if not islands else [
            "parts of the model compute in a narrower dtype inside this float64 check (the "
            "layer casts and casts back), so those ops are checked in that dtype: "
            + "; ".join(islands[:4]) + ("; ..." if len(islands) > 4 else "")]
        if microbatch < spec["global_batch"]:
            note = _mean_note(spec, microbatch, seed) or _gradient_note(spec, microbatch, seed)
            if note is not None:
                notes.append(note)
    return notes


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


class _OnJobParameters:
    """The job's optimizer factory as preflight calls it: on the job's own parameters, then
    pointed at the copies preflight steps. The ranks and train-check's reference hand the
    factory the job's own parameters, so a factory choosing parameter groups by identity
    (``p is emb.weight``) works there; called on copies, it put every parameter in the
    other group, and preflight refused valid jobs (an SGD group without weight decay for a
    sparse embedding: 'add(sparse, dense) is not supported')."""

    def __init__(self, factory: Any, origin: dict[int, tuple[nn.Parameter, nn.Parameter]]
                 ) -> None:
        self.factory = factory
        self.origin = origin

    def _original(self, p: nn.Parameter) -> nn.Parameter:
        held = self.origin.get(id(p))
        return held[1] if held is not None else p

    def __call__(self, params: Sequence[nn.Parameter]) -> Any:
        originals = [self._original(p) for p in params]
        optim = self.factory(originals)
        back = {id(o): p for o, p in zip(originals, params, strict=True)}
        for group in optim.param_groups:
            group["params"] = [back.get(id(q), q) for q in group["params"]]
        # and in the optimizer's own attributes: a wrapper clipping the gradient norm over
        # the list it was given (``self.params``) clipped the originals, which have no
        # gradients here, so its coupling went unseen and it was not refused
        _repoint(optim, back, depth=2)
        return optim

    def dense_copies(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """:func:`_dense_copies`, each copy mapped to its parameter's original."""
        out = _dense_copies(params)
        for p, q in zip(params, out, strict=True):
            self.origin[id(q)] = (q, self._original(p))
        return out


def _repoint(obj: Any, back: dict[int, nn.Parameter], depth: int) -> None:
    """Point the parameters an optimizer keeps in its attributes (lists, tuples, dicts of
    them; an optimizer it wraps, ``depth`` levels down) at their copies in ``back`` (by
    the original's id). Lists and dicts change in place, so what shares them still does."""
    def mapped(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return back.get(id(value), value)
        if isinstance(value, list):
            value[:] = [mapped(v) for v in value]
        elif isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(mapped(v) for v in value)
        elif isinstance(value, dict):
            for k in list(value):
                value[k] = mapped(value[k])
        elif depth > 0 and isinstance(value, torch.optim.Optimizer):
            for group in value.param_groups:  # a wrapped optimizer steps its own groups
                group["params"] = [back.get(id(q), q) for q in group["params"]]
            _repoint(value, back, depth - 1)
        return value

    try:
        attributes = list(vars(obj).items())
    except TypeError:  # no __dict__
        return
    for name, value in attributes:
        if name in ("param_groups", "state", "defaults") or name.startswith("__"):
            continue
        new = mapped(value)
        if new is not value:
            object.__setattr__(obj, name, new)


def _batch(data: Any, indices: Sequence[int], which: int, dtype: torch.dtype | None,
           bad: Any, seed: int) -> Any:
    """Inputs (0) or targets (1) of ``indices``, read (seeded per item, as in epoch 0),
    collated and cast as the ranks do."""
    try:
        value = default_collate(read_items(data, indices, which, seed, 0))
    except (TypeError, RuntimeError) as exc:
        what = "inputs" if which == 0 else "targets"
        raise bad("dataset", f"the {what} of items {indices[0]}-{indices[-1]} cannot be "
                             f"batched (torch's default_collate): {exc}") from exc
    if dtype is None:
        return value
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, value)


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


def _loss(spec: dict[str, Any], dtype: torch.dtype | None) -> Any:
    """The job's loss as the ranks use it: a copy of a loss module cast to ``dtype``."""
    loss = spec["loss"]
    return place_loss(copy.deepcopy(loss), None, dtype) if isinstance(loss, nn.Module) else loss


def _buffers(layers: Sequence[nn.Module]) -> list[torch.Tensor]:
    return [b for layer in layers for b in layer.buffers()]


def _step(layers: Sequence[nn.Module], loss: torch.Tensor, factory: _OnJobParameters,
          bad: Any) -> None:
    """The backward, then each layer's optimizer (over its parameters not already given to
    an earlier layer's, as the runtime builds them) steps on the copies with the gradients
    in each form the runtime may hand them: a sparse embedding gradient as the backward
    leaves it (one group: Adam refuses it), then dense (several groups: the sync sums it
    into a dense buffer, which SparseAdam refuses)."""
    if not loss.requires_grad:
        return
    try:
        loss.backward()
    except RuntimeError as exc:  # e.g. an in-place op on what the backward needs
        raise bad("layers", f"the backward of one microbatch failed, as it would in one "
                            f"process: {type(exc).__name__}: {exc}") from exc
    _refuse_coupled_steps(layers, factory, bad)
    _refuse_state_outside_state_dict(layers, factory, bad)
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        params = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        params = [p for p in params if p.requires_grad]  # as the runtime: frozen ones left out
        if not params:
            continue
        forms = ["dense"]
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            forms.insert(0, "sparse")  # as the backward leaves them: plans of one group
        for form in forms:
            if form == "dense":
                for p in params:
                    if p.grad is not None and p.grad.is_sparse:
                        p.grad = p.grad.to_dense()
            try:
                optim = factory(params)  # held: a scheduler's step wrapper holds it weakly
                optim.step()
            except Exception as exc:
                how = ("sparse, as the backward leaves them under a plan of one data-parallel "
                       "group" if form == "sparse" else "dense, summed over replicas")
                hint = ("; a sparse embedding needs an optimizer taking both sparse and dense "
                        "gradients (SGD, Adagrad), or sparse=False" if len(forms) > 1 else "")
                if "closure" in str(exc).lower():
                    hint += ("; the runtime calls step() without a closure, as its layers' "
                             "forwards run on other ranks: optimizers re-evaluating the loss "
                             "(LBFGS, SAM) are not supported")
                raise bad("optimizer", f"its step failed on item {i}'s ({type(layer).__name__}) "
                                       f"gradients as the runtime hands them ({how}): "
                                       f"{type(exc).__name__}: {exc}{hint}") from exc


COUPLED_TOLERANCE = 1e-6
"""Relative difference (to the largest change) between one optimizer over all the layers'
parameters and one per layer, above which the optimizer is not taken for per-layer."""


def _refuse_coupled_steps(layers: Sequence[nn.Module], factory: _OnJobParameters,
                          bad: Any) -> None:
    """An optimizer whose step on one layer's parameters depends on other layers' gradients
    (a wrapper clipping the gradient norm over all its parameters, a norm or trust ratio
    taken over the whole model): the runtime gives each layer (and each tied parameter) an
    optimizer of its own, as the layers sit on different ranks, so that such a step would
    train other values than the one optimizer over the model the job means. Seen on copies
    of the parameters and gradients (dense), one step over all of them against one step per
    layer (the parameter lists as in :func:`_step`). A factory failing here is left to
    :func:`_step`."""
    lists: list[list[nn.Parameter]] = []
    items: list[int] = []
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        params = [p for p in layer.parameters() if id(p) not in seen and p.grad is not None]
        seen.update(id(p) for p in layer.parameters())
        if params:
            lists.append(params)
            items.append(i)
    if len(lists) < 2:
        return

    together = [factory.dense_copies(params) for params in lists]
    apart = [factory.dense_copies(params) for params in lists]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optim = factory([q for qs in together for q in qs])
            optim.step()
            for qs in apart:
                optim = factory(qs)
                optim.step()
    except Exception:  # _step says what fails
        return
    moved = diff = 0.0
    where = ""
    for i, params, a, b in zip(items, lists, together, apart, strict=True):
        for p, u, v in zip(params, a, b, strict=True):
            if u.numel() == 0 or not (u.is_floating_point() or u.is_complex()):
                continue
            moved = max(moved, float((u.detach() - p.detach()).abs().max()))
            d = float((u.detach() - v.detach()).abs().max())
            if d > diff:
                diff, where = d, f"item {i} ({type(layers[i]).__name__})"
    if diff > COUPLED_TOLERANCE * max(moved, 1e-30) and diff > 0.0:
        raise bad("optimizer", "one optimizer over all the layers' parameters steps them to "
                               "other values than one optimizer per layer does (largest "
                               f"difference {diff:.3g}, {where}, against a largest change of "
                               f"{moved:.3g}): its step couples parameters of different "
                               "layers (a gradient-norm clip or a norm taken over all its "
                               "parameters), or the factory builds another optimizer (or "
                               "settings) depending on which parameters it is given, and "
                               "the runtime gives each layer an optimizer "
                               "of its own, as layers sit on different ranks; clip or "
                               "normalise per parameter or per layer, or use an element-wise "
                               "optimizer (SGD, Adam, AdamW, ...)")


def _dense_copies(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """Leaf copies of ``params`` with copies of their gradients (dense)."""
    out = []
    for p in params:
        q = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        assert p.grad is not None
        q.grad = (p.grad.to_dense() if p.grad.is_sparse else p.grad).detach().clone()
        out.append(q)
    return out


def _refuse_state_outside_state_dict(layers: Sequence[nn.Module], factory: _OnJobParameters,
                                     bad: Any) -> None:
    """An optimizer keeping state its ``state_dict`` does not hold (a step count in a
    Python attribute driving an lr warm-up): a layer's optimizer moves to another rank by
    its ``state_dict`` when a plan switch moves the layer (and a checkpoint holds that
    only), so such state would restart there. Seen on copies of the first layer's
    parameters with gradients: after two steps, one more step of the optimizer against one
    of a fresh optimizer given its ``state_dict``. A factory failing here is left to
    :func:`_step`."""
    params = next(([p for p in layer.parameters() if p.grad is not None]
                   for layer in layers if any(p.grad is not None for p in layer.parameters())),
                  [])
    if not params:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ran = factory.dense_copies(params)
            optim = factory(ran)
            optim.step()
            optim.step()
            moved = factory.dense_copies(ran)
            fresh = factory(moved)
            fresh.load_state_dict(copy.deepcopy(optim.state_dict()))
            optim.step()
            fresh.step()
    except Exception:  # _step says what fails
        return
    diff = max((float((a.detach() - b.detach()).abs().max()) for a, b in
                zip(ran, moved, strict=True) if a.numel() and a.is_floating_point()),
               default=0.0)
    change = max((float((a.detach() - p.detach()).abs().max()) for a, p in
                  zip(ran, params, strict=True) if a.numel() and a.is_floating_point()),
                 default=0.0)
    if diff > COUPLED_TOLERANCE * max(change, 1e-30):
        raise bad("optimizer", f"{type(optim).__name__} steps otherwise after a fresh one "
                               "is given its state_dict (largest difference "
                               f"{diff:.3g}, against a change of {change:.3g}): it keeps state "
                               "outside its state_dict (a step count in a Python attribute), "
                               "which is lost when a plan switch moves a layer and its "
                               "optimizer to another rank, or at a checkpoint; keep it in "
                               "self.state or param_groups (torch's lr schedulers step "
                               "param_groups' 'lr'), or return it from state_dict")
    # A scheduler stepped from a hook sets the next step's lr after this one: the
    # parameters agree, but its count restarted in the fresh one (LambdaLR's lr parts).
    try:
        drift = _numbers_apart(optim.state_dict(), fresh.state_dict())
    except Exception:  # a state_dict that fails here fails where it is used
        drift = None
    if drift is not None:
        raise bad("optimizer", f"{type(optim).__name__}'s state_dict {drift} parts after a "
                               "step from a fresh one given its state_dict: it keeps state "
                               "outside its state_dict (a learning-rate scheduler stepped "
                               "from a hook counts its own steps), which is lost when a plan "
                               "switch moves a layer and its optimizer to another rank, or at "
                               "a checkpoint; keep the schedule in param_groups or "
                               "self.state, or return the scheduler's state from state_dict")


def _numbers_apart(ours: Any, theirs: Any, where: str = "") -> str | None:
    """Where two state_dicts first hold numbers apart (a relative difference above 1e-9;
    ``['param_groups'][0]['lr']``), or None. Tensors are left to the parameters' check.
    Read from ``state_dict()``, not ``param_groups``: a wrapper holding a scheduler may keep
    a ``param_groups`` attribute that loading leaves stale."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in ours:
            if key in theirs:
                found = _numbers_apart(ours[key], theirs[key], f"{where}[{key!r}]")
                if found is not None:
                    return found
    elif isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)):
        for i, (u, v) in enumerate(zip(ours, theirs, strict=False)):
            found = _numbers_apart(u, v, f"{where}[{i}]")
            if found is not None:
                return found
    elif isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) \
            and not isinstance(ours, bool) and not isinstance(theirs, bool) \
            and abs(ours - theirs) > 1e-9 * max(abs(ours), abs(theirs), 1e-30):
        return where
    return None


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


def _eval_float64(spec: dict[str, Any], seed: int) -> tuple[list[nn.Module], Any, Any]:
    """For the notes' comparisons: copies of the layers in float64 and eval mode, the loss
    cast alike, and ``batch(start, stop, which)``: the inputs (0) or targets (1) of samples
    ``start..stop`` as the ranks read them, in float64."""
    layers = build_layers(copy_layers(spec["layers"]), seed, torch.float64)
    for layer in layers:
        layer.eval()

    def batch(start: int, stop: int, which: int) -> Any:
        return _batch(spec["dataset"], range(start, stop), which, torch.float64, None, seed)

    return layers, _loss(spec, torch.float64), batch


def _mean_note(spec: dict[str, Any], m: int, seed: int) -> str | None:
    """The loss of the first global batch's outputs and targets against the ``m/B``-weighted
    sum of its microbatches' losses, on the same outputs (each microbatch's forward, float64,
    layers in eval mode; the outputs concatenated along the batch dimension), so that only
    the loss is compared. Outputs that do not concatenate (a layer returning in-batch
    similarities, ``m x m`` logits as CLIP's head does): the forward of the first two
    microbatches as one against the mean of their losses, the model and loss together. None
    when they agree, or when the model does not run in float64."""
    b = spec["global_batch"]
    try:
        layers, loss, batch = _eval_float64(spec, seed)

        def forward(x: Any) -> Any:
            for layer in layers:
                x = layer(x)
            return x

        # no gradients here: a layer checkpointing itself would warn that none will come
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            outs = [forward(batch(k, k + m, 0)) for k in range(0, b, m)]
            losses = [float(loss(x, batch(k, k + m, 1))) for x, k in zip(outs, range(0, b, m),
                                                                           strict=True)]
            parts = sum((m / b) * v for v in losses)
            try:
                whole = float(loss(_concat(outs), batch(0, b, 1)))
                coupled = False
            except Exception:  # outputs that do not concatenate: two microbatches as one
                if b < 2 * m:
                    return None
                whole = float(loss(forward(batch(0, 2 * m, 0)), batch(0, 2 * m, 1)))
                parts, coupled = (losses[0] + losses[1]) / 2, True
    except Exception:  # a model that runs only in its own dtype
        return None
    if abs(whole - parts) <= MEAN_TOLERANCE * max(1.0, abs(whole)):
        return None
    if coupled:
        return (f"the objective couples the samples of a microbatch: the first two "
                f"microbatches of {m} give a loss of {whole:.6g} as one and a mean of "
                f"{parts:.6g} apart (a layer comparing samples with each other, such as "
                "in-batch negatives in a contrastive head). Every plan trains on microbatches "
                f"of {m}, so the objective depends on the microbatch size; train-check "
                "compares like with like. See docs/trainer.md, 'Loss'.")
    return (f"the loss is not a mean over samples: on the first global batch's outputs it is "
            f"{whole:.6g}, but the {m}/{b}-weighted sum of its microbatches' losses is "
            f"{parts:.6g} (a mean over a varying count or weight, such as cross_entropy's "
            "ignore_index on padded targets or its class weights (weight=w), or a loss "
            "comparing samples with each other, such as a contrastive loss's in-batch "
            "negatives). Every plan trains on the weighted sum, as gradient accumulation "
            "does, so the objective depends on the microbatch size; "
            "train-check compares like with like. See docs/trainer.md, 'Loss'.")


def _gradient_note(spec: dict[str, Any], m: int, seed: int) -> str | None:
    """The gradients of the first global batch's mean loss taken as one batch against the
    ``m/B``-weighted sum of its microbatches' gradients (float64, layers in eval mode), for
    a loss that is a mean (:func:`_mean_note` found nothing). They differ when the model
    computes over the microbatch: in its forward (a layer centring by the microbatch's
    mean, routing or quantising by it: the outputs differ too, and the note says so) or
    only in its backward (``Embedding(scale_grad_by_freq=True)`` divides each row's
    gradient by its count in the microbatch). None when they agree, or when the model does
    not run in float64 or take the whole batch at once."""
    b = spec["global_batch"]
    try:
        layers, loss, batch = _eval_float64(spec, seed)
        params = [(i, name, p) for i, layer in enumerate(layers)
                  for name, p in layer.named_parameters() if p.requires_grad]

        def grads(spans: Sequence[tuple[int, int]]) -> tuple[list[torch.Tensor], list[Any]]:
            for _, _, p in params:
                p.grad = None
            outs = []
            for start, stop in spans:
                x = batch(start, stop, 0)
                for layer in layers:
                    x = layer(x)
                outs.append(map_tensors(lambda t: t.detach(), x))
                ((stop - start) / b * loss(x, batch(start, stop, 1))).backward()
            return [torch.zeros_like(p) if p.grad is None else
                    p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
                    for _, _, p in params], outs

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            whole, whole_out = grads([(0, b)])
            parts, parts_out = grads([(k, k + m) for k in range(0, b, m)])
    except Exception:  # a model that runs only in its own dtype, or on m samples at a time
        return None
    if not params:
        return None
    scale = max(1.0, max(float(g.abs().max()) if g.numel() else 0.0 for g in whole))
    diffs = [float((g - h).abs().max()) if g.numel() else 0.0
             for g, h in zip(whole, parts, strict=True)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    if diffs[worst] <= MEAN_TOLERANCE * scale:
        return None
    i, name, _ = params[worst]
    where = (f"for item {i} ({type(layers[i]).__name__}) {name!r} the first global batch's "
             "gradient taken as one batch and the sum of its microbatches' gradients differ "
             f"by {diffs[worst]:.3g} (layers in eval mode)")
    if _outputs_differ(whole_out[0], parts_out):
        why = ("and so do its outputs: a layer computes over the microbatch in its forward "
               "(centring or normalising by the microbatch's own statistics outside "
               "BatchNorm, routing or quantising by them)")
    else:
        why = ("although its outputs and the loss, a mean over samples, agree: a backward "
               "works on the microbatch's gradient as a whole (Embedding(scale_grad_by_freq="
               "True) divides a row's gradient by its count in the microbatch; a gradient "
               "hook that clamps or normalises sees one microbatch's gradient, not the "
               "batch's)")
    return (f"the gradients depend on how samples are grouped into microbatches: {where}, "
            f"{why}. Every plan trains on microbatches of {m}, so training depends on the "
            "microbatch size; train-check compares like with like. See docs/trainer.md, "
            "'Loss'.")


def _outputs_differ(whole: Any, parts: Sequence[Any]) -> bool:
    """Whether the whole batch's outputs differ from its microbatches' concatenated (False
    when they do not concatenate)."""
    try:
        joined = _concat(parts)
    except Exception:
        return False
    a, b = pytree.tree_leaves(whole), pytree.tree_leaves(joined)
    return len(a) != len(b) or any(
        isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
        and x.is_floating_point()
        and float((x - y).abs().max()) > MEAN_TOLERANCE * max(1.0, float(x.abs().max()))
        for x, y in zip(a, b, strict=False))


def _concat(values: Sequence[Any]) -> Any:
    """Microbatch outputs as one batch: tensor leaves concatenated along dimension 0; other
    leaves must be equal (ValueError otherwise)."""
    flat = [pytree.tree_flatten(v) for v in values]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise ValueError("the microbatches' outputs differ in structure")
    leaves = []
    for column in zip(*(leaves for leaves, _ in flat), strict=True):
        if all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in column):
            leaves.append(torch.cat(column))
        elif all(not isinstance(v, torch.Tensor) and v == column[0] for v in column):
            leaves.append(column[0])
        else:
            raise ValueError("an output leaf does not concatenate")
    return pytree.tree_unflatten(leaves, spec)
