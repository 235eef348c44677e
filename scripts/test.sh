#!/usr/bin/env bash
# The test command (README, .ci/run): set up .venv if needed, lint, type-check,
# check generated protobuf code for drift, run the test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k planner -x
#
# The tests run on HETPILOT_TEST_WORKERS pytest-xdist workers (default 2; 0 runs them
# in one process). Most tests wait on subprocesses (daemons, agents, ranks): in one
# process the suite kept a 2-core machine 0.87 cores busy on average, on two workers 1.5.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${HETPILOT_VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH"

echo "== ruff"
ruff check .
echo "== mypy"
bash scripts/typecheck.sh
if [ -x scripts/gen_proto.sh ]; then
  echo "== protobuf drift"
  bash scripts/gen_proto.sh --check
fi
echo "== pytest"
python -m pytest -n "${HETPILOT_TEST_WORKERS:-2}" "$@"
