#!/usr/bin/env bash
# Issue 14's NCCL checks across GPUs, in one run, for a machine with at least 2 GPUs (every
# machine lent so far had one, so these have NOT yet run). As bench/gpu/checks.sh, the
# packages the device lacks travel as wheels in .whl/ (hetpilot's own wheel among them).
# Usage, from the repository root:  OUT=dir bash bench/gpu/nccl_checks.sh
set -uo pipefail
OUT=${OUT:-bench/.tmp/gpu-nccl}
mkdir -p "$OUT"
source bench/gpu/lib.sh
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/bench/gpu  # nccl_job:job for --model
log="$OUT/nccl_checks.log"
gpus=$(python3 -P -c "import torch; print(torch.cuda.device_count())")
{
  nvidia-smi --query-gpu=index,name,memory.total --format=csv
  nvidia-smi topo -m
  python3 -P -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee "$log"
if [ "${gpus:-0}" -lt 2 ]; then
  echo "needs 2 GPUs, $gpus visible: nothing run" | tee -a "$log"; exit 2
fi
python3 -P bench/gpu/nccl_job.py plans "$OUT/plans"
run links 120 python3 -P -m torch.distributed.run --standalone --nproc-per-node 2 \
  bench/gpu/nccl_job.py links
for plan in one pp dp; do  # GPT-2 small in bf16, 3 epochs of 8 iterations, a report per 4
  ranks=2; [ "$plan" = one ] && ranks=1
  run "train_$plan" 240 python3 -P -m torch.distributed.run --standalone \
    --nproc-per-node "$ranks" -m hetpilot train --model nccl_job:job \
    --plan "$OUT/plans/$plan.json" --device-id "gpu:{local_rank}" --epochs 3 \
    --slot-iterations 4 --dtype bfloat16 --report "$OUT/train_$plan.jsonl"
done
run pytest_gpu 400 python3 -P -m pytest -m gpu -o addopts="" -q -p no:cacheprovider \
  tests/trainer/test_gpu.py
