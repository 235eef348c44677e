"""Checkpoint directory layout: atomic commits, the ``latest`` pointer, export.

A checkpoint directory ``DIR`` (shared by all ranks) holds one subdirectory
per committed save::

    DIR/step-00000123/meta.json        the position (epoch, step, plan, ...)
    DIR/step-00000123/layer00003.pt    per-layer files, any names
    DIR/step-00000123/tied00000.pt     ({"keys": [...], "param": t, "optim": ...})
    DIR/latest                         "step-00000123"

Why: overwriting files in place and replacing ``meta.json`` last mixes two
epochs when a rank dies between the two (the position says epoch 5, some
layers are epoch 6). Here a save writes everything into a fresh staging
directory (``DIR/.staging-step00000123``), which no reader looks at; only
after every rank has written its files does rank 0 write ``meta.json``,
fsync, rename the staging directory to ``step-...`` (atomic) and atomically
replace ``latest``. A crash at any point leaves the previous commit whole;
the leftover staging directory is removed by the next save.

Readers (:func:`resolve`) follow ``latest``; if it is missing or dangling they
take the newest ``step-*`` directory (every one is complete: it only gets its
name once ``meta.json`` is in it), and else the legacy flat layout
(``DIR/meta.json`` and ``DIR/layer*.pt``), so old checkpoints still load.

These are pure file helpers: who writes what, and the barriers between the
phases, are the trainer's (:meth:`hetpilot.trainer.runtime.Trainer.save_checkpoint`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LATEST",
    "META",
    "begin_save",
    "commit",
    "export_state_dict",
    "has_checkpoint",
    "layer_file",
    "read_file",
    "read_meta",
    "resolve",
    "staging_dir",
    "step_dirs",
    "tied_file",
    "write_file",
]

META = "meta.json"
LATEST = "latest"
_STEP = re.compile(r"step-(\d+)")
_STAGING = ".staging-"
_TRASH = ".trash-"


def layer_file(layer: int) -> str:
    return f"layer{layer:05d}.pt"


def tied_file(tie: int) -> str:
    return f"tied{tie:05d}.pt"


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def staging_dir(directory: str | Path, step: int) -> Path:
    """Where every rank writes its files of the save at ``step`` (before the commit)."""
    return Path(directory) / f"{_STAGING}step{step:08d}"


def _fsync_dir(path: Path) -> None:
    """Make renames and new entries in ``path`` durable (a no-op where the FS refuses)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def begin_save(directory: str | Path, step: int) -> Path:
    """Rank 0, before any rank writes: drop what crashed saves left, make a fresh staging dir.

    Saves of one job never overlap, so every staging directory found here is
    a leftover (its files may be from another epoch) and is removed.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.name.startswith((_STAGING, _TRASH)):
            _remove(entry)
    staging = staging_dir(root, step)
    staging.mkdir()
    return staging


def write_file(staging: Path, name: str, obj: Any) -> None:
    """Write ``obj`` (``torch.save``) as ``staging/name`` and fsync it.

    fsync before the commit: the rename must not become durable before the data.
    """
    if "/" in name or name in ("", ".", "..", META):
        raise ValueError(f"not a checkpoint file name: {name!r}")
    with (staging / name).open("wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file, fsync, ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def step_dirs(directory: str | Path) -> list[tuple[int, Path]]:
    """The committed ``step-*`` directories of ``directory``, oldest first."""
    root = Path(directory)
    found = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for entry in entries:
        m = _STEP.fullmatch(entry.name)
        if m and (entry / META).is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def commit(directory: str | Path, step: int, meta: dict[str, Any], keep: int = 2) -> Path:
    """Rank 0, after every rank has written into :func:`staging_dir`: make the save visible.

    ``meta.json`` goes in last, the staging directory is renamed to
    ``step-...`` and ``latest`` replaced, each made durable before the next;
    then all but the newest ``keep`` commits up to this one are removed, and
    commits past it (a timeline abandoned by resuming from an earlier one).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(directory)
    staging = staging_dir(root, step)
    with (staging / META).open("w") as fh:
        fh.write(json.dumps(meta, indent=1))
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(staging)
    target = root / _step_name(step)
    trash = None
    if target.exists():  # the same step saved again: set the old one aside first
        trash = root / f"{_TRASH}{target.name}.{os.getpid()}"
        target.rename(trash)
    staging.rename(target)
    _fsync_dir(root)
    _write_atomic(root / LATEST, target.name + "\n")
    if trash is not None:
        _remove(trash)
    older = [path for s, path in step_dirs(root) if s < step]
    for path in older[: max(0, len(older) - (keep - 1))]:
        _remove(path)
    for s, path in step_dirs(root):
        if s > step:
            _remove(path)
    return target


def resolve(directory: str | Path) -> Path | None:
    """The directory holding the checkpoint to load from ``directory``, or None if none.

    ``latest`` first, then the newest complete ``step-*``, then the legacy
    flat layout (``directory`` itself, when ``meta.json`` sits in it).
    """
    root = Path(directory)
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        name = ""
    if _STEP.fullmatch(name) and (root / name / META).is_file():
        return root / name
    found = step_dirs(root)
    if found:
        return found[-1][1]
    if (root / META).is_file():
        return root
    return None


def has_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` holds a checkpoint to resume from (or export)."""
    return resolve(directory) is not None


def read_meta(where: Path) -> dict[str, Any]:
    """``meta.json`` of a resolved checkpoint directory (see :func:`resolve`)."""
    meta: dict[str, Any] = json.loads((where / META).read_text())
    return meta


def read_file(where: Path, name: str, map_location: Any = "cpu") -> Any:
    """A file written by :func:`write_file`, from a resolved checkpoint directory."""
    return torch.load(where / name, map_location=map_location, weights_only=True)


def _no_checkpoint(directory: Path) -> ValueError:
    if not directory.is_dir():
        return ValueError(f"{str(directory)!r} is not a directory")
    return ValueError(f"no checkpoint in {str(directory)!r} (no {LATEST!r}, no step-* "
                      f"directory with {META}, no {META})")


def export_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """The checkpointed model as one ``state_dict`` of ``nn.Sequential(*layers)``.

    Keys are ``"{layer}.{name}"``: each layer file's module state, then every
    key a ``tied*.pt`` file lists gets its tensor (a tied parameter is saved
    once, apart from the layers that use it). Raises ValueError naming what
    is missing. ``directory`` is a checkpoint directory or one commit in it.
    """
    root = Path(directory)
    where = resolve(root)
    if where is None:
        raise _no_checkpoint(root)
    try:
        num_layers = int(read_meta(where)["num_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{str(where / META)!r}: unreadable ({exc})") from exc
    per_layer: list[dict[str, torch.Tensor]] = []
    for layer in range(num_layers):
        path = where / layer_file(layer)
        if not path.is_file():
            raise ValueError(f"{str(where)!r} has no {layer_file(layer)} "
                             f"(the checkpoint is of {num_layers} layers)")
        state = read_file(where, layer_file(layer))
        per_layer.append(dict(state["module"]))
    for path in sorted(where.glob("tied*.pt")):
        state = read_file(where, path.name)
        for key in state["keys"]:
            head, _, name = str(key).partition(".")
            if not head.isdigit() or not name or int(head) >= num_layers:
                raise ValueError(f"{str(path)!r}: key {key!r} names no layer of {num_layers}")
            per_layer[int(head)][name] = state["param"]
    return {f"{layer}.{name}": value
            for layer, state in enumerate(per_layer) for name, value in state.items()}
