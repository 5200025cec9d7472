#!/usr/bin/env bash
# Where one process's CPU per item goes, by callable (func_timer.py): one ceiling run over SHM
# of this checkout, the named callables timed in every process that imports them.
# Usage: breakdown.sh PREFIX IMAGES_PER_REQUEST 'module:Class.method,...'
# Writes PREFIX.json (epd-bench cost) and PREFIX.timer.<pid> (one file per timed process).
set -euo pipefail
prefix=$(realpath -m "$1") images=$2 spec=$3
repo=$(git rev-parse --show-toplevel)
trap 'rm -f "$repo/sitecustomize.py"' EXIT
cp "$repo/docs/results/issue32/func_timer.py" "$repo/sitecustomize.py"
(cd "$repo" && FUNC_TIMER=$spec FUNC_TIMER_OUT="$prefix.timer" PYTHONPATH=$repo \
  "$repo/.venv/bin/python" -c "import sys; from bench.cli import main; sys.exit(main(sys.argv[1:]))" \
  cost --ceiling --transports shm --images-per-request "$images" --seconds 10 \
  --json "$prefix.json" > /dev/null) || true  # a goal not met exits 1
