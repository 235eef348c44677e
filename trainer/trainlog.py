"""The training log ``hetpilot train`` prints, and its TensorBoard scalars.

One line per slot on rank 0's stdout, from the slot's record (the runtime's
report, :meth:`hetpilot.trainer.runtime.Trainer.fit`)::

    step 40 | epoch 1 | loss 2.3417 | 1.21e+03 samples/s | 9.68e+03 tokens/s | 0.0265 s/it | plan v2 | local:0,local:1

tokens/s where the job's inputs are token ids (an integer tensor, or a dict's
``input_ids``): samples/s times the tokens a sample has. ``--log-format json``
prints the records themselves instead (as before), and ``--report FILE``
keeps every rank's records either way. ``--tensorboard DIR`` writes the same
figures as scalars (``torch.utils.tensorboard``; the ``tensorboard`` package is
an optional dependency, ``pip install 'hetpilot[tensorboard]'``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["TrainLog", "line", "tensorboard_problem", "tokens_per_sample"]

SCALARS = ("loss", "samples_per_s", "tokens_per_s", "iteration_s", "plan_version",
           "eval_metric")
"""What goes to TensorBoard (``train/<name>``), at the record's step."""


def tokens_per_sample(sample: Any) -> int | None:
    """Tokens in one sample of the job's inputs (a microbatch, as ``job()["sample"]``):
    its ``input_ids``, else its only integer tensor; None where it holds no token ids."""
    if isinstance(sample, dict) and isinstance(sample.get("input_ids"), torch.Tensor):
        ids = sample["input_ids"]
    else:
        ints = [t for t in pytree.tree_leaves(sample) if isinstance(t, torch.Tensor)
                and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
        if len(ints) != 1:
            return None
        ids = ints[0]
    if ids.dim() < 2 or ids.shape[0] == 0:
        return None
    return int(ids[0].numel())


def _rate(value: float) -> str:
    return f"{value:.3g}" if value < 1e4 else f"{value:.3e}"


def line(record: dict[str, Any], tokens: int | None, devices: list[str]) -> str:
    """The log line of one slot's record (module docstring)."""
    parts = [f"step {record.get('step')}", f"epoch {record.get('epoch')}"]
    loss = record.get("loss")
    parts.append(f"loss {loss:.4f}" if isinstance(loss, float) else "loss -")
    if record.get("eval_metric") is not None:
        parts.append(f"eval {record['eval_metric']:.4f}")
    samples = float(record.get("samples_per_s") or 0.0)
    parts.append(f"{_rate(samples)} samples/s")
    if tokens:
        parts.append(f"{_rate(samples * tokens)} tokens/s")
    parts.append(f"{float(record.get('iteration_s') or 0.0):.3g} s/it")
    parts.append(f"plan v{record.get('plan_version')}")
    if record.get("closed_by") == "switch":
        parts.append("(switched)")
    parts.append(",".join(devices) if devices else "-")
    return " | ".join(parts)


def tensorboard_problem() -> str | None:
    """Why ``--tensorboard`` cannot be used here (None when it can)."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        return (f"--tensorboard: needs the tensorboard package ({exc}); "
                "pip install 'hetpilot[tensorboard]'")
    return None


class TrainLog:
    """Rank 0's log: a line per record on stdout, and scalars in ``tensorboard_dir``."""

    def __init__(self, tokens: int | None, devices: Any, tensorboard_dir: str | None = None,
                 json_lines: bool = False) -> None:
        self.tokens = tokens
        self.devices = devices  # () -> the running plan's devices
        self.json_lines = json_lines
        self.writer: Any = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir)

    def __call__(self, record: dict[str, Any]) -> str:
        import json

        text = json.dumps(record) if self.json_lines else line(record, self.tokens,
                                                                self.devices())
        if self.writer is not None:
            step = int(record.get("step") or 0)
            values = {**record, "tokens_per_s": float(record.get("samples_per_s") or 0.0)
                      * self.tokens if self.tokens else None}
            for name in SCALARS:
                if isinstance(values.get(name), (int, float)):
                    self.writer.add_scalar(f"train/{name}", float(values[name]), step)
            self.writer.flush()
        return text

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
