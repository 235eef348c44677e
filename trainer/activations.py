"""Activations as pytrees across a pipeline cut: flatten, describe, send, rebuild.

A layer may return any nesting of tuples, lists, dicts, namedtuples and dataclasses
(``nn.LSTM`` returns ``(out, (h, c))``, HuggingFace-style blocks return dicts or
dataclasses, registered as pytree nodes on first sight); the next stage's
first layer gets exactly that structure back. Following
``torch.distributed.pipelining``, the value is flattened with
``torch.utils._pytree`` into tensor leaves and everything else; a small
header carries the tree spec, each tensor's shape, dtype and whether it needs
a gradient, and the non-tensor leaves (metadata), then each tensor leaf goes
as its own message in its own dtype (integer token ids stay integers).

The backward message is one gradient per floating or complex leaf that required a
gradient, in leaf order; the sender of the forward knows which from its own
output, so no header is needed. A leaf whose gradient autograd left ``None``
(an output the next stage never used) is sent as zeros.

Tags: ``(2 * k + direction) << LEAF_BITS | slot``; slot 0 is the header,
slot 1 an overflow of a long header, slots from 2 the leaves. That allows
``2**LEAF_BITS - 2`` tensor leaves per activation and about ``2**20``
microbatches per iteration within a 31-bit tag.

Under gloo, CUDA tensors cross through host memory (:func:`through_host`): gloo's send
and recv take CPU tensors only. The sender sends a host copy of each leaf (kept with its
work until the send is done); the receiver receives into a host buffer and copies it to
its device. Under NCCL and on CPU nothing is copied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

__all__ = [
    "LEAF_BITS",
    "NATIVE_DTYPES",
    "Received",
    "as_bytes",
    "describe",
    "flatten",
    "grad_leaves",
    "map_tensors",
    "nbytes",
    "recv_activation",
    "recv_grads",
    "register_dataclasses",
    "send_activation",
    "send_grads",
    "tag",
    "through_host",
    "wire_device",
]

LEAF_BITS = 10
_HEADER_BYTES = 512
"""Fixed header message; a longer description spills into one overflow message."""


def tag(k: int, backward: bool, slot: int) -> int:
    return ((2 * k + (1 if backward else 0)) << LEAF_BITS) | slot


def register_dataclasses(value: Any) -> None:
    """Register the dataclass types in ``value`` that torch's pytree does not know as pytree
    nodes (``torch.utils._pytree.register_dataclass``), so that their tensors are leaves.

    Unregistered, a dataclass a layer returns is one opaque leaf: across a cut it went
    pickled in the header, its tensors without gradients, and the layers before the cut
    silently stopped learning. Registering is process-wide, as the user's own call would
    be; the receiving rank registers the types named in the tree spec
    (:func:`_register_spec_types`)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if id(v) in seen or isinstance(v, (torch.Tensor, str, bytes, int, float, type)):
            continue
        seen.add(id(v))
        if dataclasses.is_dataclass(v):
            if type(v) not in pytree.SUPPORTED_NODES:
                with contextlib.suppress(ValueError, TypeError):
                    pytree.register_dataclass(type(v))
            stack.extend(getattr(v, f.name, None) for f in dataclasses.fields(v))
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())


def _register_spec_types(spec: Any) -> None:
    node_type = getattr(spec, "type", None)
    if (isinstance(node_type, type) and dataclasses.is_dataclass(node_type)
            and node_type not in pytree.SUPPORTED_NODES):
        with contextlib.suppress(ValueError, TypeError):
            pytree.register_dataclass(node_type)
    # children(): torch deprecates the children_specs attribute (a FutureWarning per
    # message with a structseq, torch.max(dim=)'s result, crossing a cut)
    children = spec.children() if callable(getattr(spec, "children", None)) \
        else getattr(spec, "children_specs", ())
    for child in children:
        _register_spec_types(child)


def flatten(value: Any) -> tuple[list[Any], Any]:
    register_dataclasses(value)
    return pytree.tree_flatten(value)


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``fn`` on every tensor leaf of ``value``, other leaves unchanged."""
    register_dataclasses(value)
    return pytree.tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, value)


def _hidden_tensor(leaf: Any) -> str | None:
    """The attribute of an opaque (non-pytree) leaf that holds a tensor, if any."""
    attrs = getattr(leaf, "__dict__", None)
    if not isinstance(attrs, dict):
        return None
    for name, v in attrs.items():
        if isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and any(
                isinstance(x, torch.Tensor) for x in v)):
            return name
    return None


def nbytes(value: Any) -> int:
    """Bytes of all tensor leaves (what a cut after this value moves)."""
    leaves, _ = flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def grad_leaves(value: Any) -> list[torch.Tensor]:
    """The tensor leaves autograd can send a gradient to, in leaf order."""
    leaves, _ = flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


@dataclass
class Received:
    value: Any
    """The rebuilt activation; floating leaves that needed a gradient require one."""
    grad_inputs: list[torch.Tensor]
    """Those leaves, in leaf order (their ``.grad`` goes back after the backward)."""


def describe(leaves: list[Any]) -> list[Any]:
    """The header's description of flattened leaves; raises ValueError for an opaque leaf
    holding a tensor (which would cross without its gradient) and for a sparse tensor
    (which the wire cannot carry)."""
    out: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.layout != torch.strided:
                raise ValueError(
                    f"an activation crossing a pipeline cut is a {leaf.layout} tensor "
                    f"(shape {tuple(leaf.shape)}): activations cross as dense, strided "
                    "tensors. Build it in the layer that uses it, pass its indices and "
                    "values as two tensors, or send .to_dense()")
            out.append(("t", tuple(leaf.shape), str(leaf.dtype).removeprefix("torch."),
                        bool(leaf.requires_grad)))
        else:
            hidden = _hidden_tensor(leaf)
            if hidden is not None:
                raise ValueError(
                    f"an activation crossing a pipeline cut holds a tensor in "
                    f"{type(leaf).__qualname__}.{hidden}, an object torch's pytree cannot see "
                    "into: its tensors would cross without gradients. Return tuples, lists, "
                    "dicts, namedtuples or dataclasses, or register the class "
                    "(torch.utils._pytree.register_pytree_node)")
            out.append(("v", leaf))
    return out


def _dump_spec(spec: Any) -> tuple[str, Any]:
    """The tree spec as torch's JSON form; pickled only for node types it cannot name
    (a namedtuple not registered for serialisation)."""
    try:
        return "json", pytree.treespec_dumps(spec)
    except (TypeError, NotImplementedError):
        return "pickle", pickle.dumps(spec)


def _load_spec(dumped: tuple[str, Any]) -> Any:
    kind, data = dumped
    if kind == "json":
        return pytree.treespec_loads(data)
    with warnings.catch_warnings():  # unpickling a spec warns about torch-internal names
        warnings.simplefilter("ignore", FutureWarning)
        spec = pickle.loads(data)
    _register_spec_types(spec)  # a dataclass the sender registered (register_dataclasses)
    return spec


def through_host(device: torch.device) -> bool:
    """Whether point-to-point messages of ``device``'s tensors go through host memory: CUDA
    tensors under gloo, whose send and recv take CPU tensors only (its all_reduce and
    broadcast take CUDA ones). Under NCCL and on CPU a tensor goes as it is, uncopied."""
    return device.type == "cuda" and dist.get_backend() == "gloo"


def wire_device(device: torch.device) -> torch.device:
    """Where ``device``'s tensors cross between ranks: host memory where
    :func:`through_host`, else ``device`` itself."""
    return torch.device("cpu") if through_host(device) else device


NATIVE_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                           torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool})
"""The dtypes NCCL's send and recv take (its data type table). A tensor of another dtype
(complex, as an FNO's ``rfft`` leaves; int16; float8) crosses as its bytes, under every
backend, so that this path runs on the CPU too."""


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where its dtype is in :data:`NATIVE_DTYPES`, else a flat ``uint8`` view
    of its memory (``t`` contiguous), which a send reads and a receive fills."""
    return t if t.dtype in NATIVE_DTYPES else t.reshape(-1).view(torch.uint8)


def _to_wire(t: torch.Tensor) -> torch.Tensor:
    """What :func:`dist.isend` is given for ``t`` (contiguous): ``t``, or its host copy
    (which the caller keeps alive with the work until the send is done), as
    :func:`as_bytes`."""
    return as_bytes(t.to("cpu", copy=True) if through_host(t.device) else t)


def send_activation(value: Any, dst: int, k: int,
                    group: Any = None) -> list[tuple[Any, torch.Tensor]]:
    """Start sending ``value`` (non-blocking) to global rank ``dst`` over ``group`` (None:
    the default group); returns (work, buffer) pairs to wait on."""
    leaves, spec = flatten(value)
    blob = pickle.dumps((_dump_spec(spec), describe(leaves)), protocol=pickle.HIGHEST_PROTOCOL)
    device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), torch.device("cpu"))
    head = torch.zeros(_HEADER_BYTES, dtype=torch.uint8)
    n = len(blob)
    head[:8] = torch.tensor(list(n.to_bytes(8, "little")), dtype=torch.uint8)
    first = blob[: _HEADER_BYTES - 8]
    if first:
        head[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    wire = wire_device(device)  # the header, on the host where the tensors go through it
    messages = [(head.to(wire), tag(k, False, 0))]
    if n > _HEADER_BYTES - 8:
        rest = torch.frombuffer(bytearray(blob[_HEADER_BYTES - 8 :]), dtype=torch.uint8)
        messages.append((rest.to(wire), tag(k, False, 1)))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if len(tensors) > (1 << LEAF_BITS) - 2:
        raise ValueError(f"an activation has {len(tensors)} tensor leaves; at most "
                         f"{(1 << LEAF_BITS) - 2} can cross a pipeline cut")
    for i, t in enumerate(tensors):
        messages.append((_to_wire(t.detach().contiguous()), tag(k, False, 2 + i)))
    pending = []
    for tensor, message_tag in messages:
        work = dist.isend(tensor, dst=dst, tag=message_tag, group=group)
        assert work is not None
        pending.append((work, tensor))
    return pending


def recv_activation(src: int, k: int, device: torch.device, group: Any = None) -> Received:
    """Receive what :func:`send_activation` sent (blocking) and rebuild it."""
    staged, wire = through_host(device), wire_device(device)
    head = torch.empty(_HEADER_BYTES, dtype=torch.uint8, device=wire)
    dist.recv(head, src=src, tag=tag(k, False, 0), group=group)
    raw = bytes(head.cpu().numpy().tobytes())
    n = int.from_bytes(raw[:8], "little")
    blob = raw[8 : 8 + min(n, _HEADER_BYTES - 8)]
    if n > _HEADER_BYTES - 8:
        rest = torch.empty(n - (_HEADER_BYTES - 8), dtype=torch.uint8, device=wire)
        dist.recv(rest, src=src, tag=tag(k, False, 1), group=group)
        blob += bytes(rest.cpu().numpy().tobytes())
    dumped, described = pickle.loads(blob)  # from our own peer rank of the same job
    spec = _load_spec(dumped)
    leaves: list[Any] = []
    needs_grad: list[torch.Tensor] = []
    slot = 2
    for item in described:
        if item[0] == "v":
            leaves.append(item[1])
            continue
        _, shape, dtype, requires_grad = item
        buf = torch.empty(shape, dtype=getattr(torch, dtype), device=wire)
        dist.recv(as_bytes(buf), src=src, tag=tag(k, False, slot), group=group)
        if staged:
            buf = buf.to(device, copy=True)
        slot += 1
        if requires_grad and (buf.is_floating_point() or buf.is_complex()):
            buf.requires_grad_(True)
            needs_grad.append(buf)
        leaves.append(buf)
    return Received(pytree.tree_unflatten(leaves, spec), needs_grad)


def send_grads(inputs: list[torch.Tensor], dst: int, k: int,
               group: Any = None) -> list[tuple[Any, torch.Tensor]]:
    """Send the gradient of each received leaf that needed one (zeros where autograd left none)."""
    pending = []
    for i, leaf in enumerate(inputs):
        g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        g = _to_wire(g.contiguous())
        work = dist.isend(g, dst=dst, tag=tag(k, True, 2 + i), group=group)
        assert work is not None
        pending.append((work, g))
    return pending


def recv_grads(outputs: list[torch.Tensor], src: int, k: int,
               group: Any = None) -> list[torch.Tensor]:
    """The gradients of this stage's output leaves that required one, in leaf order."""
    grads = []
    for i, leaf in enumerate(outputs):
        staged = through_host(leaf.device)
        g = torch.empty_like(leaf, memory_format=torch.contiguous_format,
                             device="cpu" if staged else leaf.device)
        dist.recv(as_bytes(g), src=src, tag=tag(k, True, 2 + i), group=group)
        grads.append(g.to(leaf.device, copy=True) if staged else g)
    return grads
