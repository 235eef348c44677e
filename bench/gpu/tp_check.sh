#!/usr/bin/env bash
# Issue 40's GPU check, prepared and NOT run yet (no GPU was lent to the session that wrote
# it): a tensor-parallel stage of 2 gloo ranks sharing GPU 0 (DTensor collectives on CUDA
# tensors over gloo), by train-check and by its pytest. One command, on a CUDA machine,
# from the repository root:  OUT=dir bash bench/gpu/tp_check.sh
# TP across GPUs (NCCL, one GPU per rank) needs a machine with several: the second run.
set -uo pipefail
OUT=${OUT:-bench/.tmp/gpu}
mkdir -p "$OUT"
source bench/gpu/lib.sh
log="$OUT/tp_check.log"
run train_check_gpt_tp_cuda 300 python3 -P -m hetpilot train-check --ranks 2 \
  --job hetpilot.trainer.examples:gpt_tp --device cuda
run pytest_gpu_tp 300 python3 -P -m pytest -m gpu -o addopts="" -q -p no:cacheprovider \
  tests/trainer/test_gpu.py -k tensor_parallel
if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
  run train_check_gpt_tp_nccl4 300 python3 -P -m hetpilot train-check --ranks 4 \
    --job hetpilot.trainer.examples:gpt_tp --device cuda --backend nccl
fi
