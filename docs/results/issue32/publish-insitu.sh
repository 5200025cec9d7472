#!/usr/bin/env bash
# The receiver's publish step (Publisher.__call__): its thread CPU per item inside the running
# prefill process (func_timer.py), and the whole cost report: the product at BEFORE_REV (a
# worktree) against this checkout, in interleaved pairs, 8-image requests on the ceiling over SHM,
# 10 s each.
# Usage: publish-insitu.sh BEFORE_REV PREFIX FIRST LAST
# Writes PREFIX-{after,before}-i.json (epd-bench cost) and PREFIX-{after,before}-i.timer.<pid>
# (func_timer.py's lines, from the prefill process).
set -euo pipefail
before_rev=$1 prefix=$(realpath -m "$2") first=$3 last=$4
repo=$(git rev-parse --show-toplevel)
worktree=$(mktemp -d /tmp/epd-before-XXXX)
git -C "$repo" worktree add -q --detach "$worktree" "$before_rev"
trap 'rm -f "$repo/sitecustomize.py"; git -C "$repo" worktree remove --force "$worktree"' EXIT
rm -rf "$worktree/bench" && cp -r "$repo/bench" "$worktree/bench"
for i in $(seq "$first" "$last"); do
  for side in after before; do
    tree=$repo
    [ "$side" = before ] && tree=$worktree
    cp "$repo/docs/results/issue32/func_timer.py" "$tree/sitecustomize.py"
    (cd "$tree" && FUNC_TIMER=prefill_side.publish:Publisher.__call__ \
      FUNC_TIMER_OUT="$prefix-$side-$i.timer" PYTHONPATH=$tree \
      "$repo/.venv/bin/python" -c "import sys; from bench.cli import main; sys.exit(main(sys.argv[1:]))" \
      cost --ceiling --transports shm --images-per-request 8 --seconds 10 \
      --json "$prefix-$side-$i.json" > /dev/null) || true  # a goal not met exits 1
    rm -f "$tree/sitecustomize.py"
  done
done
