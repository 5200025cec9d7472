"""`epd-bench ARGS` with the room stream client's frames as before `step_frames`: one step's calls
of a kind in one frame (up to MAX_BATCH rooms), for a side-by-side run of the frame policy alone.
Usage: PYTHONPATH=. .venv/bin/python docs/results/issue32/whole_frames.py handshake --json F"""

import sys

import wire.room_stream
from bench.cli import main
from wire.rooms import MAX_BATCH

wire.room_stream.FRAME_ROOMS_WHOLE = MAX_BATCH
sys.exit(main(sys.argv[1:]))
