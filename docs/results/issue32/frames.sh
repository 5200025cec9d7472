#!/usr/bin/env bash
# The room stream client's frame policy alone, side by side in one checkout: `epd-bench
# handshake` as it is (step_frames: a step's calls of a kind in one frame, more than 8 in two)
# against the same with one frame per step and kind (whole_frames.py), in interleaved pairs.
# Usage: frames.sh PREFIX FIRST LAST -- EPD_BENCH_ARGS...   (writes PREFIX-{split,whole}-i.json)
# As run here: frames.sh docs/results/issue32/frames 1 2 -- handshake --seconds 1.5 --rounds 3
#              frames.sh docs/results/issue32/frames-ceiling 1 3 -- cost --ceiling \
#                --transports shm --images-per-request 8
# (frames16-*.json: the first form, 1-3, when step_frames sent at most 16 rooms a frame.)
set -euo pipefail
prefix=$(realpath -m "$1") first=$2 last=$3
shift 4
repo=$(git rev-parse --show-toplevel)
cd "$repo"
for i in $(seq "$first" "$last"); do
  PYTHONPATH=. .venv/bin/python -c "import sys; from bench.cli import main; sys.exit(main(sys.argv[1:]))" \
    "$@" --json "$prefix-split-$i.json" || true  # a goal not met exits 1: the JSON is written
  PYTHONPATH=. .venv/bin/python docs/results/issue32/whole_frames.py "$@" --json "$prefix-whole-$i.json" || true
done
