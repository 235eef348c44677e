#!/usr/bin/env bash
# Regenerate the committed Python code of the hetpilot.v1 protos
# (proto/hetpilot/v1/*.proto, compiled with -I proto so modules import as
# hetpilot.v1.*): *_pb2.py, *_pb2_grpc.py and their .pyi stubs (mypy-protobuf).
#   scripts/gen_proto.sh          regenerate in place
#   scripts/gen_proto.sh --check  exit 1 when the committed code differs
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HETPILOT_VENV:-.venv}
PY="$VENV/bin/python"
[ -x "$PY" ] || PY=python3
BIN=$(dirname "$(command -v "$PY")")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$PY" -m grpc_tools.protoc -I proto \
  --plugin=protoc-gen-mypy="$BIN/protoc-gen-mypy" \
  --plugin=protoc-gen-mypy_grpc="$BIN/protoc-gen-mypy_grpc" \
  --python_out="$out" --grpc_python_out="$out" \
  --mypy_out="quiet:$out" --mypy_grpc_out="quiet:$out" \
  proto/hetpilot/v1/*.proto
gen="$out/hetpilot/v1"
if [ "${1:-}" = "--check" ]; then
  status=0
  for f in "$gen"/*; do
    name=$(basename "$f")
    if ! cmp -s "$f" "proto/hetpilot/v1/$name"; then
      echo "drift: proto/hetpilot/v1/$name differs from what scripts/gen_proto.sh generates" >&2
      status=1
    fi
  done
  for f in proto/hetpilot/v1/*_pb2*.py proto/hetpilot/v1/*_pb2*.pyi; do
    [ -e "$f" ] || continue
    [ -e "$gen/$(basename "$f")" ] || { echo "drift: stale $f" >&2; status=1; }
  done
  [ $status -eq 0 ] && echo "protobuf code up to date"
  exit $status
fi
rm -f proto/hetpilot/v1/*_pb2*.py proto/hetpilot/v1/*_pb2*.pyi
cp "$gen"/* proto/hetpilot/v1/
echo "generated: $(cd "$gen" && ls | tr '\n' ' ')"
