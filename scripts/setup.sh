#!/usr/bin/env bash
# Create .venv (idempotent) with torch, the project and its dev tools.
#
# torch is installed before the project so that pip never resolves an
# unpinned torch: on a machine without a GPU that would pull several GB of
# CUDA packages. HETPILOT_TORCH overrides the requirement, e.g.
#   HETPILOT_TORCH="torch==2.13.0" (default, the CPU build where a local wheel exists)
#   HETPILOT_TORCH="skip"         (keep whatever torch the venv already has)
# GPU users: create .venv yourself, install the torch build for your CUDA
# version into it, then run this script; it keeps that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${HETPILOT_VENV:-.venv}
TORCH_REQ=${HETPILOT_TORCH:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if [ "$TORCH_REQ" != "skip" ] && ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: installing $TORCH_REQ" >&2
  "$VPY" -m pip install -q "$TORCH_REQ" 2> >(grep -v "is ignored: it is neither" >&2)
fi
stamp="$VENV/.hetpilot-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing hetpilot (editable) and dev tools" >&2
  "$VPY" -m pip install -q -e ".[dev]" 2> >(grep -v "is ignored: it is neither" >&2)
  touch "$stamp"
fi
