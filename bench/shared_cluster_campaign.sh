#!/usr/bin/env bash
# The shared-cluster campaign in one command, with modest sizes, as root (users and
# small file systems are made for the run and removed after):
#
#   sudo bash bench/shared_cluster_campaign.sh RESULTS_DIR
#
# In order: tenancy, agent death and output flood (bench/agent_tenancy.py), owner B's rank
# attacking owner A's launch, the agent and the daemon from inside (bench/rank_attacks.py),
# per-launch limits against one owner's memory hog and fork bomb (bench/launch_limits.py), host
# take-over and agent death on the daemon's side (bench/host_campaign.py), full disk
# (bench/full_disk_campaign.py), a short load run (bench/controlplane_load.py). Each
# part's JSON and log go to RESULTS_DIR; summary.json says how each part ended.
# Exit 0 when every part ran and found nothing; 1 when a part found a breach, failed
# or was skipped (a campaign with a part missing is not a clean one); 2 on bad use.
# Sizes: TRIALS, FLOOD_MIB, MEMORY_MAX, TASKS_MAX, HOST_ROUNDS, DISK_ROUNDS, LOAD_AGENTS,
# LOAD_SECONDS.
set -u

usage="usage: bash bench/shared_cluster_campaign.sh RESULTS_DIR (as root)"
[ $# -eq 1 ] || { echo "$usage" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "shared_cluster_campaign: needs root (unix users, tmpfs mounts)" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || { echo "shared_cluster_campaign: no $PY (run scripts/setup.sh or set PYTHON)" >&2; exit 2; }
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$ROOT" || exit 2

TRIALS=${TRIALS:-2} FLOOD_MIB=${FLOOD_MIB:-16} HOST_ROUNDS=${HOST_ROUNDS:-1}
MEMORY_MAX=${MEMORY_MAX:-1G} TASKS_MAX=${TASKS_MAX:-256}
DISK_ROUNDS=${DISK_ROUNDS:-1} LOAD_AGENTS=${LOAD_AGENTS:-100,200} LOAD_SECONDS=${LOAD_SECONDS:-10}

declare -A rc
part() {  # part NAME CMD...: run, log to OUT/NAME.log, keep its exit code
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" >"$OUT/$name.log" 2>&1
    rc[$name]=$?
    echo "   exit ${rc[$name]} after $((SECONDS - t0)) s; last line: $(tail -n 1 "$OUT/$name.log")"
}

part tenancy "$PY" bench/agent_tenancy.py --trials "$TRIALS" --flood-mib "$FLOOD_MIB" \
    --out "$OUT/agent_tenancy.json"
part rank_attacks "$PY" bench/rank_attacks.py --out "$OUT/rank_attacks.json"
part limits "$PY" bench/launch_limits.py --memory-max "$MEMORY_MAX" --tasks-max "$TASKS_MAX" \
    --out "$OUT/launch_limits.json"
part host_takeover "$PY" bench/host_campaign.py --rounds "$HOST_ROUNDS" \
    --out "$OUT/host_campaign.json" --keep "$OUT/host_campaign"
part full_disk "$PY" bench/full_disk_campaign.py --rounds "$DISK_ROUNDS" \
    --out "$OUT/full_disk.json" --keep "$OUT/full_disk"
part load "$PY" bench/controlplane_load.py --agents "$LOAD_AGENTS" --seconds "$LOAD_SECONDS" \
    --budget 120

# What the scripts' exit codes do not say: a part skipped inside agent_tenancy.py
# (exit 0), agent death slower than "a few seconds", and the load run (it exits 0
# whatever it measured: a lost report or a refused registration is a breach here).
"$PY" - "$OUT" "${rc[tenancy]}" "${rc[rank_attacks]}" "${rc[limits]}" "${rc[host_takeover]}" \
    "${rc[full_disk]}" "${rc[load]}" <<'EOF'
import json, sys
from pathlib import Path

out, codes = Path(sys.argv[1]), dict(zip(
    ("tenancy", "rank_attacks", "limits", "host_takeover", "full_disk", "load"),
    map(int, sys.argv[2:8])))
findings = {name: ([] if code == 0 else [f"exit {code}: see {name}.log"])
            for name, code in codes.items()}
FEW_S = 10.0  # "no process outlives its agent by more than a few seconds"
try:
    t = json.loads((out / "agent_tenancy.json").read_text())
    for part in ("tenancy", "flood"):
        if "skipped" in t.get(part, {}):
            findings["tenancy"].append(f"{part} skipped: {t[part]['skipped']}")
    for kind, r in t.get("agent_death", {}).items():
        if max(r["seconds_until_none"], default=0) > FEW_S:
            findings["tenancy"].append(f"agent death ({kind}): processes lived "
                                       f"{max(r['seconds_until_none'])} s after kill -9")
except (OSError, ValueError, KeyError) as exc:
    findings["tenancy"].append(f"no readable agent_tenancy.json ({exc})")
steps = []
for line in (out / "load.log").read_text(errors="replace").splitlines():
    if line.startswith("{"):
        steps.append(json.loads(line))
(out / "controlplane_load.json").write_text(json.dumps(steps, indent=1) + "\n")
if not steps:
    findings["load"].append("no step measured")
for s in steps:
    if s["lost"] or s["register_failed"]:
        findings["load"].append(f"{s['agents']} agents: {s['lost']} report(s) lost, "
                                f"{s['register_failed']} registration(s) refused")
summary = {name: {"exit": codes[name], "findings": f} for name, f in findings.items()}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
bad = {n: f for n, f in findings.items() if f}
for name, f in bad.items():
    print(f"   {name}: " + "; ".join(f))
sys.exit(1 if bad else 0)
EOF
status=$?
echo "results in $OUT (summary.json; each part's JSON and .log)"
if [ $status -eq 0 ]; then echo "SHARED CLUSTER CAMPAIGN OK"; else echo "SHARED CLUSTER CAMPAIGN FAILED"; fi
exit $status
