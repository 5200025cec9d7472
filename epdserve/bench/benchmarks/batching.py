"""`epd-bench batching`: what the batching window does, side by side at several windows.

One real ``EncodeWorker`` per window (ZMQ intake, the batch queue, prepare / tower / stage
threads, send ring, commit in its own room table), delivering into a null sink
(``bench.encode_pipeline``'s: writes complete without moving a byte), the same small tower,
images and settings on every one; only ``--batch-window-s`` differs. Two loads, rounds
interleaved (the order reversed every other round), medians:

* **bursts**: ``burst`` items sent to intake at once (all in flight, as the dispatcher sends a
  request's items), then wait until every room committed; repeated. Reported: the batch sizes the
  scheduler formed (the worker's own ``epd_encoder_batch_items`` histogram) and items/s. Without
  a window the first batch of a burst is the one item that was there when the tower stage looked.
* **lone items**: one item, wait until it committed, the next; reported: each item's
  ``queue_s`` (intake -> its batch entered the tower: the window's wait is in it), median and
  max, against the window.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

from epdserve.bench.benchmarks.encode_pipeline import NullSink, batch_buckets, rooms_committed
from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.rounds import in_round
from epdserve.bench.benchmarks.towers import bench_tower, noise_images

WINDOWS_S = (0.0, 0.002, 0.005)


@dataclass
class Level:
    window_s: float
    burst_items_per_s: list[float] = field(default_factory=list)
    batches: Counter = field(default_factory=Counter)
    lone_queue_s: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"window {self.window_s * 1e3:g} ms"


class Worker:
    """One worker at one window, and the rooms it delivers into a null sink."""

    def __init__(self, tower, window_s: float, items: int):
        from encode_worker.config import WorkerConfig
        from encode_worker.worker import EncodeWorker

        config = WorkerConfig(
            model=tower.model_id,
            dtype=str(tower.dtype).removeprefix("torch."),
            bind="127.0.0.1",
            bootstrap_port=0,
            intake_port=0,
            batch_items=8,
            batch_window_s=window_s,
            queue_items=max(items, 8),
            cache_bytes=0,
            ring_bytes=256 << 20,
        )
        self.tower = tower
        self.worker = EncodeWorker(
            config, tower=tower, transports={"loopback": NullSink(copies_in_submit=True)}
        ).start()
        self.sent = 0

    def close(self) -> None:
        self.worker.stop()

    def send(self, images: list[bytes], rows: int) -> tuple[float, list[int]]:
        """Send ``images`` all at once; when the last room committed, and the rooms."""
        from epdserve.wire.intake import AsyncIntakeClient, IntakeRequest
        from epdserve.wire.offers import LoopbackOffer
        from epdserve.wire.rooms import Registration

        worker = self.worker
        wire = self.tower.info.wire_width
        nbytes = rows * wire * self.tower.dtype.itemsize
        rooms = worker.table.mint(len(images), 300)
        for room in rooms:
            offer = LoopbackOffer(kind="loopback", region=0, offset=0, capacity=nbytes)
            worker.table.register(
                Registration(
                    room=room,
                    generation=1,
                    rows=rows,
                    width=wire,
                    dtype=str(self.tower.dtype).removeprefix("torch."),
                    offers=[offer],
                )
            )
        requests = []
        for room in rooms:
            self.sent += 1
            requests.append(
                IntakeRequest(
                    request_id=f"b{self.sent}",
                    source="bytes",
                    encode_handshake={
                        "bootstrap_room": room,
                        "bootstrap_host": "127.0.0.1",
                        "bootstrap_port": worker.bootstrap_port,
                    },
                )
            )

        async def send_all() -> list:
            intake = AsyncIntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
            try:
                return await asyncio.gather(
                    *(intake.send(request, image) for request, image in zip(requests, images))
                )
            finally:
                intake.close()

        if not all(reply.ok for reply in asyncio.run(send_all())):
            raise RuntimeError("the worker refused an item: its queue is sized for a burst")
        finished, delivered = worker.loop.run(rooms_committed(worker.table, rooms))
        if delivered != len(rooms):
            raise RuntimeError(f"{len(rooms) - delivered} items not delivered")
        return finished, rooms


def run(
    windows: tuple[float, ...] = WINDOWS_S,
    burst: int = 8,
    bursts: int = 12,
    lone: int = 20,
    size: int = 224,
    rounds: int = 3,
    progress=print,
) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from epdserve.vision.images import image_from_bytes
    from epdserve.vision.tower import VisionTower

    tower = VisionTower.load(bench_tower(2, 64, 3584), dtype="float32")
    images = noise_images(burst, size, size)
    grid = tower.processor(images=[image_from_bytes(images[0])], return_tensors="pt")
    rows = tower.rows_per_item(grid["image_grid_thw"])[0]
    levels = [Level(window) for window in windows]
    workers = {}
    try:
        for level in levels:
            workers[level.window_s] = Worker(tower, level.window_s, burst)
            workers[level.window_s].send(images, rows)  # warm-up
        for round_index in range(rounds):
            for level in in_round(levels, round_index):
                worker = workers[level.window_s]
                before = batch_buckets(worker.worker)
                started = time.monotonic()
                for _ in range(bursts):
                    worker.send(images, rows)
                level.burst_items_per_s.append(burst * bursts / (time.monotonic() - started))
                level.batches += batch_buckets(worker.worker) - before
                for index in range(lone):
                    _, (room,) = worker.send([images[index % burst]], rows)
                    timings = worker.worker.table.view(room).commit.timings
                    level.lone_queue_s.append(timings.queue_s)
            progress(
                f"  round {round_index + 1}/{rounds}: "
                + ", ".join(f"{lv.name} {lv.burst_items_per_s[-1]:.1f}/s" for lv in levels)
            )
    finally:
        for worker in workers.values():
            worker.close()
    return {
        "size": size,
        "burst": burst,
        "bursts_per_round": bursts,
        "lone_items_per_round": lone,
        "rounds": rounds,
        "tower": {"depth": 2, "hidden": 64, "out_width": 3584, "dtype": "float32"},
        "levels": {
            level.name: {
                "window_s": level.window_s,
                "burst_items_per_s": statistics.median(level.burst_items_per_s),
                "burst_items_per_s_rounds": level.burst_items_per_s,
                "batches": {label: n for label, n in level.batches.items() if n},
                "items_per_batch_mean": burst * bursts * rounds / sum(level.batches.values()),
                "lone_queue_ms_median": statistics.median(level.lone_queue_s) * 1e3,
                "lone_queue_ms_max": max(level.lone_queue_s) * 1e3,
            }
            for level in levels
        },
    }


def main(args) -> int:
    windows = tuple(float(w) for w in args.windows.split(","))
    print(
        f"epd-bench batching: windows {', '.join(f'{w * 1e3:g} ms' for w in windows)}; bursts of "
        f"{args.burst} {args.size}x{args.size} images and lone items, null sink, "
        f"{args.rounds} rounds"
    )
    report = run(windows, args.burst, args.bursts, args.lone, args.size, args.rounds)
    print(
        f"\n{'level':14s} {'burst items/s':>13s}  batches formed (items: count), mean   "
        "lone item queue ms (median / max)"
    )
    for name, row in report["levels"].items():
        batches = " ".join(f"{label}:{n}" for label, n in row["batches"].items())
        print(
            f"  {name:12s} {row['burst_items_per_s']:13.1f}  {batches}, "
            f"{row['items_per_batch_mean']:.2f}   {row['lone_queue_ms_median']:.2f} / "
            f"{row['lone_queue_ms_max']:.2f}"
        )
    base = report["levels"][next(iter(report["levels"]))]["burst_items_per_s"]
    print("burst items/s against the first level (same run):")
    for name, row in report["levels"].items():
        print(f"  {name:12s} {row['burst_items_per_s'] / base:5.2f}")
    write_json(args.json, report)
    return 0
