#!/usr/bin/env bash
# Side by side: the product at BEFORE_REV (a git worktree) against this checkout, in interleaved
# pairs (this tree first), each run with PYTHONPATH at its own tree and this checkout's .venv.
# Both sides run this checkout's bench/ (copied over the worktree's): the same harness and
# stand-in, only the product code differs.
# With AT_ONCE=1, a pair's two sides run at the same time, each its own `epd-bench` with its own
# processes, on the same cores for the same seconds: both meet the machine at the same pace (one
# after the other, the pace moved by up to a third between a pair's two runs), each with half the
# machine; compare their CPU per item (and the clients', the harness's own, as a control), not
# their items/s against runs alone.
# Usage: [AT_ONCE=1] [FUNC_TIMER=module:Class.method,...] compare.sh BEFORE_REV PREFIX FIRST LAST -- EPD_BENCH_ARGS...
# Pair i (FIRST..LAST) writes PREFIX-after-i.json and PREFIX-before-i.json; with FUNC_TIMER, each
# side also runs func_timer.py (as its sitecustomize), which writes PREFIX-{after,before}-i.timer.<pid>.
# As run here: compare.sh a25abee docs/results/issue32/cost 1 3 -- cost
#              compare.sh a25abee docs/results/issue32/ceiling 1 3 -- cost --ceiling --transports shm
#              FUNC_TIMER=prefill_side.publish:Publisher.__call__ compare.sh 2fb58e2 \
#                docs/results/issue32/publish 1 3 -- cost --ceiling --transports shm \
#                --images-per-request 8 --seconds 10
#              AT_ONCE=1 compare.sh 2da6bea docs/results/issue32/together-ceiling 1 3 -- cost \
#                --ceiling --transports shm
set -euo pipefail
before_rev=$1 prefix=$(realpath -m "$2") first=$3 last=$4
shift 5
repo=$(git rev-parse --show-toplevel)
worktree=$(mktemp -d /tmp/epd-before-XXXX)
git -C "$repo" worktree add -q --detach "$worktree" "$before_rev"
trap '[ -n "${FUNC_TIMER:-}" ] && rm -f "$repo/sitecustomize.py"; git -C "$repo" worktree remove --force "$worktree"' EXIT
rm -rf "$worktree/bench" && cp -r "$repo/bench" "$worktree/bench"
one_side() {  # tree side i -- EPD_BENCH_ARGS...
  local tree=$1 side=$2 i=$3
  shift 3
  (cd "$tree" && FUNC_TIMER_OUT="$prefix-$side-$i.timer" PYTHONPATH=$tree \
    "$repo/.venv/bin/python" -c "import sys; from bench.cli import main; sys.exit(main(sys.argv[1:]))" \
    "$@" --json "$prefix-$side-$i.json") || true  # a goal not met exits 1: the JSON is written
}
for i in $(seq "$first" "$last"); do
  for side in after before; do
    tree=$repo
    [ "$side" = before ] && tree=$worktree
    if [ -n "${FUNC_TIMER:-}" ]; then
      cp "$repo/docs/results/issue32/func_timer.py" "$tree/sitecustomize.py"
    fi
    if [ -n "${AT_ONCE:-}" ]; then
      one_side "$tree" "$side" "$i" "$@" &
    else
      one_side "$tree" "$side" "$i" "$@"
    fi
  done
  wait
  [ -z "${FUNC_TIMER:-}" ] || rm -f "$repo/sitecustomize.py" "$worktree/sitecustomize.py"
done
