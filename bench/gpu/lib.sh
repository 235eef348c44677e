# Sourced by bench/gpu/checks.sh and nccl_checks.sh: the wheels the device lacks (it has no
# network) installed from .whl/, and run NAME LIMIT_S COMMAND..., which logs to $log.
export PYTHONUNBUFFERED=1
# as python3 -P, for the processes torchrun starts too: the repository root holds a
# hetpilot/ folder that would hide the installed package
export PYTHONSAFEPATH=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
run() {  # name, limit in s, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$log"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$log"
}
