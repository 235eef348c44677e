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
#
# The two first installs are the long steps, so pip shows its progress there
# (download bars when stdout is a terminal); an update after pyproject.toml
# changes stays quiet, and a re-run with nothing to do takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${HETPILOT_VENV:-.venv}
TORCH_REQ=${HETPILOT_TORCH:-torch==2.13.0}
stamp="$VENV/.hetpilot-installed"

# Figures measured on a 2-core VM with the CPU torch build (README, "Two commands").
if [ ! -f "$stamp" ]; then
  echo "setup: first set-up of $VENV takes about 1.5 minutes (1 min 21 s on a 2-core VM)" \
       "plus downloads (190 MB for torch's CPU wheel, less for the 60 others);" \
       "$VENV grows to about 1.7 GB. Later runs take seconds." >&2
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# pip's "a new release of pip is available" notice is noise here
quiet_pip=(--disable-pip-version-check)
if [ "$TORCH_REQ" != "skip" ] && ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: [1/2] installing $TORCH_REQ (the largest download)" >&2
  "$VPY" -m pip install "${quiet_pip[@]}" --progress-bar on "$TORCH_REQ" \
    2> >(grep -v "is ignored: it is neither" >&2)
fi
if [ ! -f "$stamp" ]; then
  echo "setup: [2/2] installing hetpilot (editable), its dependencies and dev tools" >&2
  "$VPY" -m pip install "${quiet_pip[@]}" --progress-bar on -e ".[dev]" \
    2> >(grep -v "is ignored: it is neither" >&2)
  touch "$stamp"
  echo "setup: done; 'source $VENV/bin/activate' puts hetpilot on your PATH" >&2
elif [ pyproject.toml -nt "$stamp" ]; then
  # pyproject.toml changed: mostly "Requirement already satisfied" lines, so quiet
  echo "setup: pyproject.toml changed; updating $VENV" >&2
  "$VPY" -m pip install "${quiet_pip[@]}" -q -e ".[dev]" \
    2> >(grep -v "is ignored: it is neither" >&2)
  touch "$stamp"
fi
