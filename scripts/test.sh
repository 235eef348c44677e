#!/usr/bin/env bash
# The test command (README, .ci/run): set up .venv if needed, lint, check generated
# protobuf code for drift, run the test suite with the type-check beside it.
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
if [ -x scripts/gen_proto.sh ]; then
  echo "== protobuf drift"
  bash scripts/gen_proto.sh --check
fi
# mypy (about a minute of one core) runs beside the tests; its report follows theirs
mypy_log=$(mktemp)
trap 'rm -f "$mypy_log"' EXIT
bash scripts/typecheck.sh > "$mypy_log" 2>&1 &
mypy_pid=$!
echo "== pytest (mypy beside it)"
tests=0
python -m pytest -n "${HETPILOT_TEST_WORKERS:-2}" "$@" || tests=$?
echo "== mypy"
mypy=0
wait "$mypy_pid" || mypy=$?
cat "$mypy_log"
if [ "$tests" -ne 0 ] || [ "$mypy" -ne 0 ]; then
  echo "scripts/test.sh: failed (pytest exit $tests, mypy exit $mypy)" >&2
  exit 1
fi
