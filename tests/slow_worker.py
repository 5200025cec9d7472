"""The encode worker with a test fault: its tower sleeps, before each batch, the seconds written in
the file ``EPD_TEST_TOWER_DELAY_FILE`` names (none, or 0: no delay), so that a test slows a
running worker at once. Everything else is the real worker.

``python -m tests.slow_worker`` takes ``epd-encode-worker``'s flags."""

from __future__ import annotations

import os
import pathlib
import sys
import time

from encode_worker import cli
from epdserve.vision.tower import VisionTower

DELAY_FILE = "EPD_TEST_TOWER_DELAY_FILE"
_real_encode = VisionTower.encode


def _delayed_encode(self, *args, **kwargs):
    path = pathlib.Path(os.environ[DELAY_FILE])
    if path.exists():
        time.sleep(float(path.read_text() or 0))
    return _real_encode(self, *args, **kwargs)


def main() -> int:
    if DELAY_FILE not in os.environ:
        raise SystemExit(f"{DELAY_FILE} is not set")
    VisionTower.encode = _delayed_encode
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
