#!/usr/bin/env bash
# The README's first command: set up (idempotent), then run hetpilot's main
# job on the built-in example data. Everything it writes goes to hetpilot-demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
H=.venv/bin/hetpilot
if $H demo --help >/dev/null 2>&1; then
  exec $H demo "$@"
fi
# Until the full live demo exists: plan, judge, compare, simulate.
out=hetpilot-demo
mkdir -p "$out"
ex=examples
echo "== hetpilot plan (examples/cluster.json: 4 unequal devices on 3 hosts; bert-base; batch 144)"
$H plan --cluster $ex/cluster.json --model $ex/model.json --batch 144 --microbatch 8 --out $out/plan.json
$H evaluate --cluster $ex/cluster.json --model $ex/model.json --plan $out/plan.json --batch 144 \
  | tee $out/plan.evaluation.json
echo
echo "== the same batch under the plans users would otherwise pick (reference model, spec v1 section 5)"
printf '%-22s %12s %10s\n' policy iteration_s speedup
best=$(.venv/bin/python -c "import json;print(json.load(open('$out/plan.evaluation.json'))['iteration_s'])")
for policy in even-dp uniform-pp megatron balanced-homogeneous; do
  $H plan --cluster $ex/cluster.json --model $ex/model.json --batch 144 --microbatch 8 \
    --policy $policy --out $out/$policy.json
  t=$($H evaluate --cluster $ex/cluster.json --model $ex/model.json --plan $out/$policy.json \
      | .venv/bin/python -c "import json,sys;print(json.load(sys.stdin)['iteration_s'])")
  .venv/bin/python -c "print(f'{\"$policy\":<22} {$t:12.4f} {$t/$best:9.2f}x')"
done
.venv/bin/python -c "print(f'{\"hetpilot\":<22} {$best:12.4f} {1:9.2f}x')"
echo
echo "== hetpilot sim: 60 epochs with a slowed device, a throttled link, a price change and a failure"
echo "   (emulated events from examples/scenario.json; budget 5.0/hour)"
COLUMNS=120 $H sim --scenario $ex/scenario.json --policy lyapunov,static,budget-greedy --table \
  --plot $out/sim.png | tail -n 12
echo
echo "wrote $out/plan.json, $out/plan.evaluation.json and $out/sim.png"
