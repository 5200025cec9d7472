#!/usr/bin/env bash
# epd-bench vllm, the product at BEFORE_REV (a git worktree, run with its own bench: it has no
# staged path) against this checkout, in interleaved pairs (this tree first), this checkout's .venv.
# Usage: vllm-compare.sh BEFORE_REV PREFIX FIRST LAST
# As run here: vllm-compare.sh a25abee docs/results/issue32/vllm 1 2
set -euo pipefail
before_rev=$1 prefix=$(realpath -m "$2") first=$3 last=$4
repo=$(git rev-parse --show-toplevel)
worktree=$(mktemp -d /tmp/epd-before-XXXX)
git -C "$repo" worktree add -q --detach "$worktree" "$before_rev"
trap 'git -C "$repo" worktree remove --force "$worktree"' EXIT
for i in $(seq "$first" "$last"); do
  for side in after before; do
    tree=$repo paths=epd-shm,epd-shm-staged,colocated
    [ "$side" = before ] && tree=$worktree paths=epd-shm,colocated
    (cd "$tree" && PYTHONPATH=$tree "$repo/.venv/bin/python" -c \
      "import sys; from bench.cli import main; sys.exit(main(sys.argv[1:]))" \
      vllm --paths "$paths" --plot '' --json "$prefix-$side-$i.json") || true
  done
done
