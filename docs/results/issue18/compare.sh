#!/bin/bash
# epd-bench before issue 18 (2d2af75, a worktree at /work/old-2d2af75) and after (main, /work/main),
# side by side: ABBA order per benchmark. Handshake runs 5-6 and the 1-image e2e runs 3-4 were
# reruns of the same command per side (docs/performance.md).
set -u
OUT=/work/main/docs/results/issue18
mkdir -p $OUT
PY=/work/main/.venv/bin/python
run() {  # run <label> <tree> <bench>
  local label=$1 tree=$2 bench=$3 extra=()
  [ "$bench" = e2e ] && extra=(--plot "")
  echo "== $(date -u +%H:%M:%S) $bench $label"
  (cd "$tree" && PYTHONPATH="$tree" OMP_WAIT_POLICY=PASSIVE timeout 900 "$PY" -m bench.cli "$bench" \
     --json "$OUT/$bench-$label.json" "${extra[@]}") 2>&1 | grep -v -e nanobind -e leaked | tail -14
}
for bench in encode receive handshake e2e; do
  run before-1 /work/old-2d2af75 $bench
  run after-1 /work/main $bench
  run after-2 /work/main $bench
  run before-2 /work/old-2d2af75 $bench
done
echo "== $(date -u +%H:%M:%S) done"
