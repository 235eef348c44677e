#!/usr/bin/env bash
# mypy cannot follow setuptools' package-dir mapping (planner/ -> hetpilot.planner),
# so check a tree of symlinks laid out like the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
root=.build/typecheck
rm -rf "$root" && mkdir -p "$root/hetpilot"
for f in hetpilot/*.py hetpilot/py.typed; do ln -s "$PWD/$f" "$root/hetpilot/"; done
for pair in planner:planner sim:sim daemon:daemon agents:agents trainer:trainer client:client adapt:adapt demo:demo; do
  src=${pair%%:*}; dst=${pair##*:}
  [ -d "$src" ] && ln -s "$PWD/$src" "$root/hetpilot/$dst"
done
[ -d proto/hetpilot/v1 ] && ln -s "$PWD/proto/hetpilot/v1" "$root/hetpilot/v1"
cd "$root" && mypy --config-file "$OLDPWD/pyproject.toml" -p hetpilot
