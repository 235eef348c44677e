"""Model profile (spec v1 section 2) measured on a sample microbatch, no hand-written numbers.

The layers are run one at a time, each on the previous layer's output, on a
sample microbatch of ``m`` samples; the numbers are divided by ``m``. A
layer's input and output may be any pytree (tensors, tuples, lists, dicts,
nested, non-tensor leaves), flattened with ``torch.utils._pytree`` as the
runtime does at a cut. Per layer:

* ``fwd_gflop`` / ``bwd_gflop``: ``torch.utils.flop_counter.FlopCounterMode``
  around the layer's forward and around its backward. The backward starts
  from ones-like gradients on every floating output leaf that requires one
  and includes the input gradient of every input leaf that needs one: a
  floating leaf that required a gradient in the previous layer's output (so
  never layer 0's input nor integer token ids, and nothing after a run of
  parameter-free layers on the raw input; a layer whose output needs no
  gradient has ``bwd_gflop`` 0). The counter knows matmuls, convolutions and
  attention (CPU flash attention included, with torch's own SDPA formulas,
  which count the full score matrix even for causal attention), and the CPU
  oneDNN LSTM/GRU kernel (its matmuls; backward counted as twice the
  forward); element-wise ops count as 0;
* ``out_mb``: the bytes of all tensor leaves of the output (what a cut after
  the layer moves);
* ``act_mb``: the bytes of the tensors autograd saves for the backward
  (``torch.autograd.graph.saved_tensors_hooks``, each tensor counted once,
  parameters excluded);
* ``param_mb``: the layer's parameter and buffer bytes (not per sample). A
  parameter tied between layers (an embedding and an LM head sharing one
  weight) counts on every layer that holds it, since every stage holding one
  of those layers stores a copy.

Profiling runs on copies of the layers given as modules (one
``copy.deepcopy`` over all of them (:func:`~hetpilot.trainer.layers.copy_layers`), so tied parameters stay tied within the
copy): the user's modules keep their parameters, gradients and buffers
(BatchNorm running statistics) as they were. Factories are called.

:func:`layer_times` also measures seconds per layer (median of repeats),
which the benchmark turns into a reference-model prediction.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from .activations import register_dataclasses
from .layers import copy_layers
from .precision import Precision, cast_floating, precision_for
from .tensorparallel import matched, shared_parameters

__all__ = ["flop_counter", "layer_times", "profile_model"]

LayerSpec = nn.Module | Callable[[], nn.Module]

_aten = torch.ops.aten


def _sdpa_cpu_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                   out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


def _sdpa_cpu_backward_flop(grad_out_shape: Any, query_shape: Any, key_shape: Any,
                            value_shape: Any, *args: Any, out_shape: Any = None,
                            **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape))


def _mkldnn_rnn_flop(input_shape: Any, w_ih_shape: Any, w_hh_shape: Any, *args: Any,
                     out_shape: Any = None, **kwargs: Any) -> int:
    """One direction of one layer of a oneDNN RNN (CPU float32 ``nn.LSTM`` / ``nn.GRU``):
    the input and hidden projections of every step, ``2 n G (I + H)`` for ``n``
    steps times batch and ``G`` gate rows."""
    gates, d_in = w_ih_shape
    steps = 1
    for size in input_shape:
        steps *= size
    return int(2 * (steps // d_in) * gates * (d_in + w_hh_shape[1]))


def _mkldnn_rnn_backward_flop(input_shape: Any, w_ih_shape: Any, w_hh_shape: Any, *args: Any,
                              out_shape: Any = None, **kwargs: Any) -> int:
    """Input, hidden and weight gradients: twice the forward."""
    return 2 * _mkldnn_rnn_flop(input_shape, w_ih_shape, w_hh_shape)


def _custom_mapping() -> dict[Any, Any]:
    """Formulas torch's counter lacks: the CPU flash attention kernels (same
    signature prefix as the CUDA ones, so torch's SDPA formulas apply) and the
    oneDNN RNN layer (other RNN paths decompose into counted matmuls)."""
    mapping: dict[Any, Any] = {}
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu_flop),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward",
                           _sdpa_cpu_backward_flop),
                          ("mkldnn_rnn_layer", _mkldnn_rnn_flop),
                          ("mkldnn_rnn_layer_backward", _mkldnn_rnn_backward_flop)):
        op = getattr(_aten, name, None)
        if op is not None:
            mapping[op] = formula
    return mapping


class _GlobalOnly:
    """Stands in for ``FlopCounterMode``'s module tracker, which attributes FLOPs to modules
    by hooks on every module's inputs and outputs: only the total is read here, and those
    hooks broke a layer that calls ``autograd.grad`` in its forward (a gradient penalty:
    "A leaf node was passed to _will_engine_execute_node but we are currently running
    autograd.grad()"), a layer that trains."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *args: object) -> None:
        return None


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts CPU attention, totals only."""
    mode = FlopCounterMode(display=False, custom_mapping=_custom_mapping())
    if hasattr(mode, "mod_tracker"):  # torch's private attribute; without it, as it was
        mode.mod_tracker = _GlobalOnly()  # type: ignore[assignment]
    return mode


def _instantiate(layers: Sequence[LayerSpec]) -> list[nn.Module]:
    """Copies of the modules (one memo, so parameters shared by identity stay
    shared among the copies) and freshly built factories."""
    memo: dict[int, Any] = {}
    built = []
    for spec in layers:
        if isinstance(spec, nn.Module):
            try:
                built.append(copy_layers([spec], memo)[0])
            except Exception as exc:
                raise TypeError(f"layer {len(built)} ({type(spec).__name__}) cannot be copied "
                                f"for profiling: {exc}") from exc
        else:
            built.append(spec())
    return built


def _leaves(value: Any) -> list[torch.Tensor]:
    register_dataclasses(value)  # as the runtime does: a dataclass's tensors are leaves
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _leaves(value))


def _microbatch_size(sample: Any) -> int:
    for t in _leaves(sample):
        if t.dim() > 0:
            return int(t.shape[0])
    raise ValueError("sample has no tensor with a batch dimension")


def _layer_input(value: Any, first: bool) -> Any:
    """``value`` detached; a floating leaf that required a gradient requires one again
    (the runtime's rule at a cut), behind a copy, so that a layer writing into its input
    (``ReLU(inplace=True)``) writes into the copy, as the runtime's stages let it
    (:mod:`hetpilot.trainer.pipeline`), not into an autograd leaf. Layer 0 gets a private
    copy, so an in-place op cannot touch the caller's sample."""

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if first:
            return t.detach().clone()
        if t.requires_grad and t.is_floating_point():
            return t.detach().requires_grad_().clone()
        return t.detach()

    # An unregistered dataclass would be one opaque leaf: its tensors kept their graph, so
    # the next layer's timed backward ran into this one's freed graph, and the profile
    # gave the layer no output bytes and no backward (a user's job, 2026-11-24).
    register_dataclasses(value)
    return pytree.tree_map(leaf, value)


def _backward(output: Any) -> None:
    """Ones-like gradients into every floating output leaf that requires one."""
    roots = [t for t in _leaves(output) if t.requires_grad and t.is_floating_point()]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])


def _needs_backward(output: Any) -> bool:
    return any(t.requires_grad and t.is_floating_point() for t in _leaves(output))


def _forward(layer: nn.Module, inp: Any, precision: Precision, cpu: torch.device) -> Any:
    """The layer's output as a cut after it carries it (cast to the wire dtype)."""
    with precision.autocast(cpu):
        y = layer(inp)
    return pytree.tree_map(lambda t: precision.wire(t) if isinstance(t, torch.Tensor) else t, y)


def _note_allreduces(layer: nn.Module, tp_plan: Mapping[str, str] | None, shared: set[int],
                     reduced: list[int]) -> list[Any]:
    """Hooks appending to ``reduced`` the bytes of each output of ``layer``'s row-parallel
    submodules by ``tp_plan`` (each is all-reduced over a tensor-parallel stage)."""
    if not tp_plan:
        return []

    def note(_module: nn.Module, _inputs: Any, out: Any) -> None:
        reduced.append(_nbytes(out))

    return [layer.get_submodule(name).register_forward_hook(note)
            for name, style in matched(layer, tp_plan, keep_whole=shared).items()
            if style == "rowwise"]


def profile_model(
    layers: Sequence[LayerSpec],
    sample: Any,
    *,
    name: str = "model",
    optimizer_factor: float = 3.0,
    dtype: torch.dtype | None = None,
    tp_plan: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The spec section 2 model dict of ``layers`` run on ``sample`` (a microbatch, any pytree
    of tensors whose first dimension is the microbatch).

    ``dtype`` is the job's ``--dtype`` (:mod:`hetpilot.trainer.precision`), so the
    memory terms of spec 5.4 follow it: a plain cast profiles the cast model; mixed
    precision (bfloat16/float16) keeps float32 parameters (``param_mb``: the master
    weights) and runs each layer under autocast, with its output cast to the compute
    dtype as it crosses a cut (``out_mb``, and ``act_mb`` of the next layer). Low-dtype
    copies of the layer's own parameters that autocast saves for the backward are not
    counted in ``act_mb`` (they do not grow with the microbatch).

    With a job's ``tp_plan`` (:mod:`hetpilot.trainer.tensorparallel`), each layer it splits
    also gets spec 5.6's ``tp_allreduces`` (the row-parallel submodules' outputs in one
    forward: each is all-reduced over the stage) and ``tp_comm_mb`` (their mean bytes per
    sample: what one all-reduce moves). Submodules holding a tied parameter are not split."""
    precision = precision_for(dtype)
    m = _microbatch_size(sample)
    modules = _instantiate(layers)
    if precision.param_dtype is not None:
        for module in modules:
            cast_floating(module, precision.param_dtype)
        cast = precision.param_dtype
        sample = pytree.tree_map(lambda t: t.to(cast) if isinstance(t, torch.Tensor)
                                 and t.is_floating_point() else t, sample)
    cpu = torch.device("cpu")
    x: Any = sample
    out_layers = []
    shared = shared_parameters(modules)
    with torch.enable_grad():
        for i, layer in enumerate(modules):
            inp = _layer_input(x, first=i == 0)
            param_ptrs = {p.data_ptr() for p in layer.parameters()}
            param_shapes = {tuple(p.shape) for p in layer.parameters()}
            saved: dict[int, int] = {}

            def pack(t: torch.Tensor, saved: dict[int, int] = saved,
                     param_ptrs: set[int] = param_ptrs,
                     param_shapes: set[tuple[int, ...]] = param_shapes) -> torch.Tensor:
                ptr = t.data_ptr()
                cast_param = precision.mixed and t.dtype == precision.compute_dtype \
                    and tuple(t.shape) in param_shapes
                if ptr not in param_ptrs and not cast_param:
                    saved[ptr] = max(saved.get(ptr, 0), t.numel() * t.element_size())
                return t

            reduced: list[int] = []  # bytes of each row-parallel output (an all-reduce)
            hooks = _note_allreduces(layer, tp_plan, shared, reduced)
            with flop_counter() as fwd_count, \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = _forward(layer, inp, precision, cpu)
            for hook in hooks:
                hook.remove()
            bwd_flops = 0
            if _needs_backward(y):
                with flop_counter() as bwd_count:
                    _backward(y)
                bwd_flops = bwd_count.get_total_flops()
            param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
            param_bytes += sum(b.numel() * b.element_size() for b in layer.buffers())
            out_layers.append({
                "name": f"{i}:{type(layer).__name__}",
                "fwd_gflop": fwd_count.get_total_flops() / m / 1e9,
                "bwd_gflop": bwd_flops / m / 1e9,
                "out_mb": _nbytes(y) / m / 1e6,
                "act_mb": sum(saved.values()) / m / 1e6,
                "param_mb": param_bytes / 1e6,
            })
            if reduced:
                out_layers[-1]["tp_comm_mb"] = sum(reduced) / len(reduced) / m / 1e6
                out_layers[-1]["tp_allreduces"] = len(reduced)
            x = y
    return {"name": name, "optimizer_factor": optimizer_factor, "layers": out_layers}


def layer_times(
    layers: Sequence[LayerSpec], sample: Any, *, repeats: int = 5
) -> list[tuple[float, float]]:
    """Median (forward, backward) seconds of each layer on ``sample`` (run on copies of
    the modules, as :func:`profile_model`; a layer whose output needs no gradient
    has backward 0)."""
    out = []
    modules = _instantiate(layers)
    x: Any = sample
    with torch.enable_grad():
        for i, layer in enumerate(modules):
            fwd, bwd = [], []
            y: Any = None
            for _ in range(repeats):
                inp = _layer_input(x, first=i == 0)
                started = time.perf_counter()
                y = layer(inp)
                mid = time.perf_counter()
                _backward(y)
                end = time.perf_counter()
                fwd.append(mid - started)
                bwd.append(end - mid)
            out.append((statistics.median(fwd), statistics.median(bwd)))
            x = y
    return out
