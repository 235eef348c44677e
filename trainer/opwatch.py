"""Which torch ops a layer ran, for the preflight's words about dtypes.

Under :class:`OpWatch` (a ``TorchDispatchMode``: every aten op passes through it,
computing as it would) the preflight learns two things it could only guess
before:

* the op a layer failed in, and its inputs' dtypes: a float64 check refused for
  an op with no float64 kernel (``torch._grouped_mm``, the default experts path
  of transformers' MoE layers) is told that op's name, not advice about a
  ``.float()`` cast that is not there;
* the ops that computed in a lower precision inside a float64 run (a Llama
  RMSNorm and rotary embedding cast to float32 and back): those parts are
  checked in float32, which the check says in a ``note:``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpWatch"]

_CASTS = {"_to_copy", "to", "copy_", "copy", "clone", "detach", "view", "_unsafe_view",
          "expand", "slice", "select", "unsqueeze", "squeeze", "t", "transpose", "reshape",
          "permute", "lift_fresh", "alias", "empty_like", "zeros_like", "ones_like",
          "empty", "zeros", "ones", "arange", "full", "scalar_tensor"}
"""Ops that move or make values without computing on them: not an island by themselves."""


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", func)).split(".")[0]


def _dtypes(values: Any) -> list[torch.dtype]:
    return [t.dtype for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


class OpWatch(TorchDispatchMode):
    """Records the last op dispatched (with its floating input dtypes) and, when
    ``wide`` is given, the ops whose floating outputs are narrower than it."""

    def __init__(self, wide: torch.dtype | None = None) -> None:
        super().__init__()
        self.wide = wide
        self.last: str | None = None
        self.last_inputs: list[torch.dtype] = []
        self.narrow: dict[str, torch.dtype] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = _name(func)
        self.last = f"torch.{name}" if name.startswith("_") else f"aten.{name}"
        self.last_inputs = [d for d in _dtypes((args, kwargs)) if d.is_floating_point]
        out = func(*args, **(kwargs or {}))
        if self.wide is not None and name not in _CASTS:
            for dtype in _dtypes(out):
                if dtype.is_floating_point and dtype.itemsize < self.wide.itemsize:
                    self.narrow.setdefault(name, dtype)
        return out

    def lacks_kernel(self) -> bool:
        """Whether the last op failed on inputs all of one floating dtype (so the dtype
        itself is what it has no kernel for, not a mix a cast made)."""
        return len(set(self.last_inputs)) == 1

    def islands(self) -> str:
        """The narrow ops seen, by dtype: ``"float32 (mul, rsqrt, mean)"``."""
        by: dict[str, list[str]] = {}
        for op, dtype in self.narrow.items():
            by.setdefault(str(dtype).removeprefix("torch."), []).append(op)
        return "; ".join(f"{d} ({', '.join(ops[:6])}{', ...' if len(ops) > 6 else ''})"
                         for d, ops in by.items())
