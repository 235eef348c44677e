"""The layers and ties one rank holds, and their hand-off between ranks when a plan changes.

:class:`Holdings` keeps this rank's layer modules, each with its own optimizer over its
untied parameters, and the ties it holds (parameters shared between layers,
:mod:`hetpilot.trainer.replicas`), each with an optimizer of its own. On a switch,
:meth:`Holdings.hand_over` moves each layer and tie to its new holders: a layer nobody
held yet is built (seeded) or read from the checkpoint being resumed; otherwise its first
old holder sends its state (module, optimizer, non-persistent buffers) as one
``torch.save`` blob. Every rank walks the same owners in the same order, so each send
meets its receive.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint as ckpt
from . import tensorparallel as tp
from .activations import wire_device
from .layers import LayerSpec, OptimizerFactory, build_layer
from .placement import Owners, tie_holders
from .precision import cast_floating
from .replicas import Tie, full_state, load_nonpersistent, nonpersistent_buffers, tie_param

__all__ = ["Holdings", "recv_state", "send_state"]


def send_state(state: dict[str, Any], dst: int, device: torch.device) -> int:
    """Send ``state`` to rank ``dst`` (its size, then its bytes); returns the bytes sent."""
    buf = io.BytesIO()
    torch.save(state, buf)
    wire = wire_device(device)  # host memory under gloo on CUDA
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(wire)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=wire), dst=dst)
    dist.send(data, dst=dst)
    return data.numel()


def recv_state(src: int, device: torch.device) -> dict[str, Any]:
    """Receive what :func:`send_state` sent from rank ``src``, onto ``device``."""
    wire = wire_device(device)  # host memory under gloo on CUDA
    size = torch.zeros(1, dtype=torch.int64, device=wire)
    dist.recv(size, src=src)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=wire)
    dist.recv(data, src=src)
    state: dict[str, Any] = torch.load(
        io.BytesIO(data.cpu().numpy().tobytes()), map_location=device, weights_only=True
    )
    return state


class Holdings:
    """This rank's layers and ties, with their optimizers."""

    def __init__(self, specs: Sequence[LayerSpec], ties: list[Tie], *, rank: int, seed: int,
                 device: torch.device, param_dtype: torch.dtype | None,
                 optimizer: OptimizerFactory) -> None:
        self.specs = list(specs)
        self.ties = ties
        self.rank = rank
        self.seed = seed
        self.device = device
        self.param_dtype = param_dtype
        self.optimizer = optimizer
        self.held: dict[int, nn.Module] = {}
        self.optims: dict[int, torch.optim.Optimizer | None] = {}
        self.tie_optims: dict[int, torch.optim.Optimizer | None] = {}
        """The ties this rank holds (any of their layers), each with its own optimizer."""
        self.tie_of: dict[int, list[int]] = {}
        """layer -> indices of the ties it uses."""
        for t, tie in enumerate(ties):
            for layer in tie.layers:
                self.tie_of.setdefault(layer, []).append(t)
        self.ckpt_dir: Path | None = None
        """The checkpoint being resumed: layers and ties nobody holds are read from it."""
        self.sharded: dict[int, Any] = {}
        """Layers held split over a tensor-parallel stage's mesh (layer -> mesh); every other
        layer is held whole (:mod:`hetpilot.trainer.tensorparallel`)."""
        self.meshes: dict[tuple[int, ...], Any] = {}
        """Tensor-parallel stages' device meshes by their ranks (None where this rank is not
        one of them), made by :func:`~hetpilot.trainer.rankpart.build_part` and kept across
        plans: DTensor caches sharding decisions by a mesh's ranks, so a mesh made again
        for the same ranks must be the same live group (a destroyed one's name would come
        back from the cache)."""

    # -- one layer or tie -------------------------------------------------------

    def tied_names(self, layer: int) -> set[str]:
        return {name for t in self.tie_of.get(layer, ()) for name in self.ties[t].names_in(layer)}

    def install(self, layer: int, state: dict[str, Any] | None = None) -> None:
        """Hold ``layer``: its module, moved here, with an optimizer over its untied parameters."""
        spec = self.specs[layer]
        module = build_layer(spec, self.seed, layer)
        if module is not spec:
            self._refuse_hidden_ties(layer, module)
        module.to(device=self.device)
        if self.param_dtype is not None:
            cast_floating(module, self.param_dtype)
        tied = {id(module.get_parameter(n)) for n in self.tied_names(layer)}
        # Frozen parameters are left out: no optimizer steps them, and a layer of only frozen
        # ones (a distillation teacher) gets none, where the common factory
        # ``Adam(p for p in params if p.requires_grad)`` raised on an empty list.
        params = [p for p in module.parameters() if id(p) not in tied and p.requires_grad]
        optim = self.optimizer(params) if params else None
        if state is not None:
            missing, unexpected = module.load_state_dict(state["module"], strict=False)
            if unexpected or set(missing) - self.tied_names(layer):
                raise ValueError(f"layer {layer}: the saved state does not fit the module "
                                 f"(missing {missing}, unexpected {unexpected})")
            if optim is not None and state.get("optim") is not None:
                optim.load_state_dict(state["optim"])
            load_nonpersistent(module, state.get("nonpersistent") or {})
        self.held[layer] = module
        self.optims[layer] = optim

    def _refuse_hidden_ties(self, layer: int, module: nn.Module) -> None:
        others = {id(p) for at, m in self.held.items() if at != layer for p in m.parameters()}
        if any(id(p) in others for p in module.parameters()):
            raise ValueError(f"layer {layer}: its factory returned a module sharing a parameter "
                             "with another layer; pass tied layers as modules, not factories")

    def layer_state(self, layer: int) -> dict[str, Any]:
        """The layer's module and optimizer state, without tied parameters (moved once, apart)."""
        optim = self.optims[layer]
        tied = self.tied_names(layer)
        return {
            "module": {k: v for k, v in self.held[layer].state_dict().items() if k not in tied},
            "optim": optim.state_dict() if optim is not None else None,
            "nonpersistent": nonpersistent_buffers(self.held[layer]),
        }

    def install_tie(self, t: int, state: dict[str, Any] | None = None) -> None:
        """Hold tie ``t`` (a layer of it is held here): its value and its own optimizer."""
        param = tie_param(self.ties[t], self.held)
        optim = self.optimizer([param]) if param.requires_grad else None
        if state is not None:
            with torch.no_grad():
                param.copy_(state["param"])
            if optim is not None and state.get("optim") is not None:
                optim.load_state_dict(state["optim"])
        self.tie_optims[t] = optim

    def tie_state(self, t: int) -> dict[str, Any]:
        return {
            "keys": list(self.ties[t].keys),
            "param": tie_param(self.ties[t], self.held).detach(),
            "optim": optim.state_dict() if (optim := self.tie_optims[t]) is not None else None,
        }

    def ckpt_layer_state(self, layer: int) -> dict[str, Any] | None:
        """Layer ``layer`` from the checkpoint being resumed (None: build it afresh)."""
        return self._ckpt_read(ckpt.layer_file(layer))

    def ckpt_tie_state(self, t: int) -> dict[str, Any] | None:
        """Tie ``t`` from the checkpoint being resumed (None: keep the module's own value)."""
        return self._ckpt_read(ckpt.tied_file(t))

    def _ckpt_read(self, name: str) -> dict[str, Any] | None:
        if self.ckpt_dir is None:
            return None
        state: dict[str, Any] = ckpt.read_file(self.ckpt_dir, name, map_location=self.device)
        return state

    # -- tensor-parallel stages -------------------------------------------------

    def shard(self, layer: int, mesh: Any, tp_plan: Mapping[str, str]) -> bool:
        """Split held ``layer`` over ``mesh`` as ``tp_plan`` says (every rank of the mesh
        calls this with the same layer); its optimizer follows with its state split the same
        way. Returns whether any submodule was split (else the layer stays whole: replicated)."""
        whole = self.held[layer]
        tied = [whole.get_parameter(n) for n in self.tied_names(layer)]
        styles = tp.matched(whole, tp_plan, keep_whole=[id(p) for p in tied])
        if not styles:
            return False
        state = self.layer_state(layer)
        # a copy: a layer given as a module is the job's own object, which install() reuses
        # when the layer is gathered back; the tied parameters stay shared (not copied)
        module = tp.parallelize(copy.deepcopy(whole, {id(p): p for p in tied}), mesh, styles)
        tied_ids = {id(p) for p in tied}
        params = [p for p in module.parameters() if id(p) not in tied_ids and p.requires_grad]
        optim = self.optimizer(params) if params else None
        if optim is not None and state["optim"] is not None:
            saved = state["optim"]
            saved["state"] = {
                i: {k: tp.shard_like(v, params[i]) if isinstance(v, torch.Tensor) else v
                    for k, v in st.items()}
                for i, st in saved["state"].items()}
            optim.load_state_dict(saved)
        self.held[layer] = module
        self.optims[layer] = optim
        self.sharded[layer] = mesh
        return True

    def full_layer_state(self, layer: int) -> dict[str, Any]:
        """:meth:`layer_state` with full tensors; collective over the layer's mesh where it
        is split (every rank of the stage calls it for the same layers in the same order)."""
        state = self.layer_state(layer)
        return tp.full_tensors(state) if layer in self.sharded else state

    def unshard(self) -> None:
        """Collective over each split layer's mesh: hold every split layer whole again
        (full tensors), in layer order (the same on every rank of a mesh)."""
        for layer in sorted(self.sharded):
            state = self.full_layer_state(layer)
            del self.sharded[layer]
            self.install(layer, state)

    # -- all of them ------------------------------------------------------------

    def clear(self) -> None:
        self.sharded.clear()
        self.held.clear()
        self.optims.clear()
        self.tie_optims.clear()

    def full_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """Collective over each tensor-parallel stage: every held layer's ``state_dict`` and
        non-persistent buffers, split layers gathered to full tensors (train-check)."""
        return {layer: {k: v.detach().clone() for k, v in
                        tp.full_tensors(full_state(module)).items()}
                for layer, module in sorted(self.held.items())}

    def reload(self) -> None:
        """Reload every held layer and tie from :attr:`ckpt_dir`, whole."""
        self.sharded.clear()
        for layer in list(self.held):
            self.install(layer, self.ckpt_layer_state(layer))
        for t in list(self.tie_optims):  # after the layers: the tie lives in them
            self.install_tie(t, self.ckpt_tie_state(t))

    def all_optims(self) -> list[torch.optim.Optimizer]:
        return [o for o in [*self.optims.values(), *self.tie_optims.values()] if o is not None]

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for o in self.all_optims() for group in o.param_groups
                for p in group["params"] if p.grad is not None]

    def untied_params(self, first: int, end: int) -> list[nn.Parameter]:
        tied = {id(tie_param(self.ties[t], self.held)) for t in self.tie_optims}
        return [p for layer in range(first, end) for p in self.held[layer].parameters()
                if id(p) not in tied]

    def hand_over(self, old: Owners, new: Owners) -> int:
        """Collective: move every layer and tie from its ``old`` holders to its ``new`` ones,
        drop what this rank no longer holds; returns the bytes this rank sent. Split layers
        are gathered whole first (:meth:`unshard`): layers move as full tensors."""
        self.unshard()
        moved = 0
        for layer, (was, now) in enumerate(zip(old, new, strict=True)):
            if not was:  # nobody holds it yet: build it (seeded) or load it from a checkpoint
                if self.rank in now:
                    self.install(layer, self.ckpt_layer_state(layer))
                continue
            for dst in now:
                if dst in was:
                    continue
                if self.rank == was[0]:
                    moved += send_state(self.layer_state(layer), dst, self.device)
                elif self.rank == dst:
                    self.install(layer, recv_state(was[0], self.device))
        for t, tie in enumerate(self.ties):  # after the layers: a tie needs one of its layers
            was, now = tie_holders(tie.layers, old), tie_holders(tie.layers, new)
            for dst in now:
                if dst in was:
                    continue
                if not was:
                    if self.rank == dst:
                        self.install_tie(t, self.ckpt_tie_state(t))
                elif self.rank == was[0]:
                    moved += send_state(self.tie_state(t), dst, self.device)
                elif self.rank == dst:
                    self.install_tie(t, recv_state(was[0], self.device))
            if self.rank in was and self.rank not in now:
                del self.tie_optims[t]
        for layer in list(self.held):
            if self.rank not in new[layer]:
                del self.held[layer]
                del self.optims[layer]
        return moved
