# Sourced by bench/gpu/checks.sh and nccl_checks.sh: the wheels the device lacks (it has no
# network) installed from .whl/, and run NAME LIMIT_S COMMAND..., which logs to $log.
# The wheels used so far (Python 3.12, manylinux): cvxpy 1.9.3, clarabel 0.11.1, osqp 1.1.3,
# qdldl 0.1.9.post1, scs 3.2.7.post2, highspy 1.16.0, sparsediffpy 0.6.1, grpcio 1.85.3,
# grpcio-health-checking and grpcio-reflection 1.85.1, protobuf 7.36.2, cffi 2.1.1,
# pycparser 3.12, and hetpilot's own (pip wheel --no-deps --no-build-isolation -w .whl .).
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
