"""Pre-flight notes on a loss that is not a mean over samples, and the batches they read.

The runtime, like gradient accumulation in one process, trains on the ``m/B``-weighted
sum of the microbatches' losses. When the loss of the global batch's outputs differs from
that sum (on the same outputs, float64), as with ``cross_entropy(ignore_index=...)`` over
padded targets or any masked mean, the objective depends on the microbatch size; the
reference takes the same microbatches, so train-check cannot see it otherwise. These are
notes, not refusals.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.data import default_collate

from .activations import map_tensors
from .itemseed import read_items
from .layers import copy_layers, place_loss
from .reference import build_layers

__all__ = ["MEAN_TOLERANCE", "gradient_note", "job_loss", "mean_note", "read_batch"]


MEAN_TOLERANCE = 1e-9
"""Relative difference (float64) above which the loss is not taken for a mean over samples."""


def read_batch(data: Any, indices: Sequence[int], which: int, dtype: torch.dtype | None,
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


def job_loss(spec: dict[str, Any], dtype: torch.dtype | None) -> Any:
    """The job's loss as the ranks use it: a copy of a loss module cast to ``dtype``."""
    loss = spec["loss"]
    return place_loss(copy.deepcopy(loss), None, dtype) if isinstance(loss, nn.Module) else loss


def eval_float64(spec: dict[str, Any], seed: int) -> tuple[list[nn.Module], Any, Any]:
    """For the notes' comparisons: copies of the layers in float64 and eval mode, the loss
    cast alike, and ``batch(start, stop, which)``: the inputs (0) or targets (1) of samples
    ``start..stop`` as the ranks read them, in float64."""
    layers = build_layers(copy_layers(spec["layers"]), seed, torch.float64)
    for layer in layers:
        layer.eval()

    def batch(start: int, stop: int, which: int) -> Any:
        return read_batch(spec["dataset"], range(start, stop), which, torch.float64, None, seed)

    return layers, job_loss(spec, torch.float64), batch


def mean_note(spec: dict[str, Any], m: int, seed: int) -> str | None:
    """The loss of the first global batch's outputs and targets against the ``m/B``-weighted
    sum of its microbatches' losses, on the same outputs (each microbatch's forward, float64,
    layers in eval mode; the outputs concatenated along the batch dimension), so that only
    the loss is compared. Outputs that do not concatenate (a layer returning in-batch
    similarities, ``m x m`` logits as CLIP's head does): the forward of the first two
    microbatches as one against the mean of their losses, the model and loss together. None
    when they agree, or when the model does not run in float64."""
    b = spec["global_batch"]
    try:
        layers, loss, batch = eval_float64(spec, seed)

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


def gradient_note(spec: dict[str, Any], m: int, seed: int) -> str | None:
    """The gradients of the first global batch's mean loss taken as one batch against the
    ``m/B``-weighted sum of its microbatches' gradients (float64, layers in eval mode), for
    a loss that is a mean (:func:`mean_note` found nothing). They differ when the model
    computes over the microbatch: in its forward (a layer centring by the microbatch's
    mean, routing or quantising by it: the outputs differ too, and the note says so) or
    only in its backward (``Embedding(scale_grad_by_freq=True)`` divides each row's
    gradient by its count in the microbatch). None when they agree, or when the model does
    not run in float64 or take the whole batch at once."""
    b = spec["global_batch"]
    try:
        layers, loss, batch = eval_float64(spec, seed)
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
