#!/usr/bin/env bash
# compare.sh's pairs run at once instead of one after the other: the product at BEFORE_REV (a git
# worktree) and this checkout, each its own `epd-bench` with its own processes, side by side on
# the same cores for the same seconds, so that both meet the machine at the same pace (one after
# the other, the pace moved by up to a third between the two runs of a pair). Each side has half
# the machine: compare their CPU per item (and the harness's own, the clients', as a control),
# not their items/s against runs alone.
# Usage: together.sh BEFORE_REV PREFIX FIRST LAST -- EPD_BENCH_ARGS...
# Round i (FIRST..LAST) writes PREFIX-after-i.json and PREFIX-before-i.json.
# As run here: together.sh 2da6bea docs/results/issue32/together-ceiling 1 5 -- cost --ceiling \
#                --transports shm --images-per-request 8
set -euo pipefail
before_rev=$1 prefix=$(realpath -m "$2") first=$3 last=$4
shift 5
repo=$(git rev-parse --show-toplevel)
worktree=$(mktemp -d /tmp/epd-before-XXXX)
git -C "$repo" worktree add -q --detach "$worktree" "$before_rev"
trap 'git -C "$repo" worktree remove --force "$worktree"' EXIT
rm -rf "$worktree/bench" && cp -r "$repo/bench" "$worktree/bench"
for i in $(seq "$first" "$last"); do
  for side in after before; do
    tree=$repo
    [ "$side" = before ] && tree=$worktree
    (cd "$tree" && PYTHONPATH=$tree \
      "$repo/.venv/bin/python" -c "import sys; from bench.cli import main; sys.exit(main(sys.argv[1:]))" \
      "$@" --json "$prefix-$side-$i.json" > /dev/null || true) &  # a goal not met exits 1
  done
  wait
done
