#!/usr/bin/env bash
# Side by side: the tree at BEFORE_REV (a git worktree) against this checkout, each run with
# PYTHONPATH at its own tree and this checkout's .venv, in interleaved pairs (this tree first).
# Usage: compare.sh BEFORE_REV PREFIX AFTER_NAME FIRST LAST -- EPD_BENCH_ARGS...
# Pair i (FIRST..LAST) writes PREFIX-AFTER_NAME-i.json and PREFIX-before-i.json.
# As run here: compare.sh 064d5af docs/results/issue31/handshake-router/hs exact 6 8 -- handshake
set -euo pipefail
before_rev=$1 prefix=$(realpath -m "$2") after_name=$3 first=$4 last=$5
shift 6
repo=$(git rev-parse --show-toplevel)
worktree=$(mktemp -d /tmp/epd-before-XXXX)
git -C "$repo" worktree add -q --detach "$worktree" "$before_rev"
trap 'git -C "$repo" worktree remove --force "$worktree"' EXIT
for i in $(seq "$first" "$last"); do
  for side in "$after_name" before; do
    tree=$repo
    [ "$side" = before ] && tree=$worktree
    (cd "$tree" && PYTHONPATH=$tree "$repo/.venv/bin/python" -c \
      "import sys; from bench.cli import main; sys.exit(main(sys.argv[1:]))" \
      "$@" --json "$prefix-$side-$i.json")
  done
done
