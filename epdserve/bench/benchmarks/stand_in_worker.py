"""The encode worker with its media work taken out, for ``epd-bench cost --ceiling`` only: a tower
that costs nothing (zero rows of the right shape, from one buffer) and items that need no decoding
or preprocessing (each item's tower inputs made once per grid, then reused). Everything else is the
real worker: ZMQ intake (hashing each payload), the batch queue, the prepare, tower and stage
threads, the send ring and checksums, the room table, the room stream and the writes. What it
sustains is the control plane's ceiling.

``python -m epdserve.bench.benchmarks.stand_in_worker`` takes ``epd-encode-worker``'s flags."""

from __future__ import annotations

import sys

from encode_worker import cli
from encode_worker.messages import TowerInputs
from encode_worker.prepare import Prepare
from epdserve.bench.benchmarks.towers import free_encode
from epdserve.vision.tower import VisionTower

_inputs_by_grid: dict[tuple[int, int, int] | None, TowerInputs] = {}
_real_tower_inputs = Prepare._tower_inputs


def _tower_inputs_once_per_grid(self: Prepare, job, shm_pixels) -> TowerInputs:
    key = tuple(job.grid_thw) if job.grid_thw is not None else None
    inputs = _inputs_by_grid.get(key)
    if inputs is None:
        inputs = _inputs_by_grid[key] = _real_tower_inputs(self, job, shm_pixels)
    return inputs


def main() -> int:
    Prepare._tower_inputs = _tower_inputs_once_per_grid
    VisionTower.encode = free_encode
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
