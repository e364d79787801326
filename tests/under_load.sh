#!/usr/bin/env bash
# Runs pytest ROUNDS times in a row with BUSY processes spinning on the CPUs beside it (stress-ng's
# cpu stressor where it is installed, plain shell loops otherwise), stopping at the first red round.
# The multi-process modules (Ray, disaggregation, data and tensor parallelism) are the default: a
# test that reads a log once, or waits for a guessed time, fails here first.
#   usage: tests/under_load.sh [ROUNDS] [pytest args...]     (make test-stress ROUNDS=5)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
shift || true
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests/test_ray.py tests/test_disagg.py tests/test_disagg_serving.py
                              tests/test_data_parallel.py tests/test_tensor_parallel.py)
busy=${BUSY:-2}
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap stop EXIT
if command -v stress-ng >/dev/null; then
  stress-ng --cpu "$busy" --quiet & pids+=($!)
else
  for _ in $(seq "$busy"); do (while :; do :; done) & pids+=($!); done
fi
for i in $(seq "$rounds"); do
  start=$(date +%s)
  .venv/bin/python -m pytest -q "${args[@]}"
  echo "under load ($busy busy): round $i of $rounds green in $(( $(date +%s) - start )) s"
done
