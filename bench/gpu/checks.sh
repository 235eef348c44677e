#!/usr/bin/env bash
# Issue 14's GPU checks in one run (bench/RESULTS-gpu.md): the device has no network, so
# the packages it lacks travel as wheels in .whl/ (hetpilot's own wheel among them).
# Usage, on a CUDA machine, from the repository root:  OUT=dir bash bench/gpu/checks.sh
set -uo pipefail
OUT=${OUT:-bench/.tmp/gpu}
mkdir -p "$OUT"
source bench/gpu/lib.sh
log="$OUT/checks.log"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -P -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  python3 -P -c "
from hetpilot.agents.config import AgentConfig
from hetpilot.agents.probes import _cuda_devices
for d in _cuda_devices(AgentConfig()):
    print('agent CUDA probe:', d.index, d.name, d.tflops, 'TFLOP/s in', d.probe_dtype, 'on', d.probe_shape)"
} 2>&1 | tee "$log"
run lm_bf16_m8 180 python3 -P bench/gpu_lm.py --dtype bfloat16 --steps 40 --rounds 4 \
  --json "$OUT/lm_bf16_m8.json"
run lm_bf16_m32 120 python3 -P bench/gpu_lm.py --dtype bfloat16 --batch 64 --micro 32 \
  --steps 20 --rounds 3 --json "$OUT/lm_bf16_m32.json"
run lm_fp32_m8 150 python3 -P bench/gpu_lm.py --dtype float32 --steps 15 --rounds 3 \
  --json "$OUT/lm_fp32_m8.json"
run pytest_gpu 200 python3 -P -m pytest -m gpu -o addopts="" -q -p no:cacheprovider \
  tests/trainer/test_gpu.py
