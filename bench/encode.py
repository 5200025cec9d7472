"""`epd-bench encode`: what delivery costs the encode worker, and what batching buys, side by side.

A small Qwen2.5-VL-architecture tower whose output width is a real one (3584, as Qwen2.5-VL-7B),
so the bytes moved per item are real (448x448 -> 256 rows x 3584: 3.7 MB in float32, the default
because CPUs without bf16 arithmetic run small bf16 towers several times slower; 1.8 MB in bf16).

Every configuration runs the same real ``EncodeWorker`` (ZMQ intake, prepare / tower / stage
threads, the scheduler's batching, send ring, checksum, the sender on the handshake loop, begin
write and commit in the worker's own room table); only the sink differs:

* ``delivered``: a ``PrefillReceiver`` in another process registers every room over HTTP,
  long-polls, and verifies and copies out each item written over ``--transport``;
* ``null``: the bench registers every room in the worker's table in-process, offering a sink
  that completes each write without moving a byte, started as the measured transport is (on the
  handshake loop, as a copy for SHM, in the background for Mooncake).

The clock runs from minting the rooms (registration included) until the last item is published
by the receiver (``delivered``) or committed (``null``). Each configuration, at batches of up to 8
and of 1, has its own worker, started and warmed up once; rounds are interleaved (the order
reversed every other round) and the median is reported, with the batch sizes the scheduler really
formed (the worker's ``epd_encoder_batch_items`` histogram over the timed rounds).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from bench.results import write_json
from bench.rounds import in_round
from data_plane.offers import LoopbackOffer
from data_plane.transport import CompletedTransfer, Transfer, Transport
from handshake.models import Registration, RoomState

DEFAULT_CACHE = os.path.expanduser("~/.cache/epd-encode-worker")
BATCH_ITEMS = (8, 1)
SINKS = ("delivered", "null")


def _images(count: int, size: int) -> list[bytes]:
    from PIL import Image

    out = []
    for seed in range(count):
        pixels = np.random.RandomState(seed).randint(0, 255, (size, size, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def bench_tower(depth: int, hidden: int, width: int) -> str:
    from encode_worker.small_checkpoints import build_vision_only

    directory = os.path.join(DEFAULT_CACHE, f"bench-qwen2_5_vl-d{depth}-h{hidden}-w{width}")
    if not os.path.exists(os.path.join(directory, "model.safetensors")):
        build_vision_only("qwen2_5_vl", directory, out_width=width, depth=depth, width=hidden)
    return directory


class NullSink(Transport):
    """A transport whose writes complete inside ``submit`` without touching a byte, started by the
    sender from where it starts the transport it stands in for: on its loop as a copy
    (``copies_in_submit``: SHM) or as a write in the background (``in_background``: Mooncake to a
    peer already reached). Its writes are over inside ``submit``, so the completion poller that
    awaits a Mooncake write is not part of the null sink's path."""

    name = "loopback"  # the sender picks transports by offer kind; the bench offers LoopbackOffers

    def __init__(self, copies_in_submit: bool, in_background: bool = False):
        self.copies_in_submit = copies_in_submit
        self.in_background = in_background

    def submits_in_background(self, offer) -> bool:
        return self.in_background

    def register(self, region) -> None:
        pass

    def offer(self, pool, lease) -> LoopbackOffer:
        return LoopbackOffer(kind="loopback", region=0, offset=lease.offset, capacity=lease.nbytes)

    def reachable(self, offer) -> bool:
        return True

    def _submit(self, src: torch.Tensor, nbytes: int, offer, deadline: float) -> Transfer:
        return CompletedTransfer(nbytes, deadline)


def _receiver_main(conn, pool_bytes: int, width: int, dtype: str, transport: str) -> None:
    """The prefill side: the project's receiver library, one job per round for all its items."""
    from multimodal.items import Modality, MultimodalDataItem, MultimodalInputs
    from prefill_side import PrefillReceiver, ReceiverConfig

    receiver = PrefillReceiver(
        ReceiverConfig(
            width=width,
            dtype=dtype,
            pool_bytes=pool_bytes,
            transports=(transport,),
            item_timeout_s=300,
        )
    )
    conn.send("ready")
    try:
        while (message := conn.recv()) is not None:
            port, rooms, rows = message
            items = [
                MultimodalDataItem(
                    Modality.IMAGE,
                    offsets=[[0, rows - 1]],
                    encode_handshake={
                        "bootstrap_room": room,
                        "bootstrap_host": "127.0.0.1",
                        "bootstrap_port": port,
                    },
                )
                for room in rooms
            ]
            job = receiver.start("bench", MultimodalInputs(items))
            job.wait(600)
            conn.send((time.monotonic(), [o.state == "DONE" for o in job.outcomes]))
    finally:
        receiver.close()


@dataclass
class Config:
    sink: str  # "delivered" | "null"
    batch_items: int
    items_per_s: list[float] = field(default_factory=list)  # one per timed round
    batches: Counter = field(
        default_factory=Counter
    )  # histogram bucket -> batches, timed rounds only

    @property
    def name(self) -> str:
        return f"{self.sink}_{'batched' if self.batch_items > 1 else 'single'}"


def _batch_buckets(worker) -> Counter:
    """The worker's own ``epd_encoder_batch_items`` histogram, per bucket ("1", "2", "3-4", ...):
    how many tower batches of that many items it ran, ever."""
    (metric,) = worker.metrics.batch_items.collect()
    buckets, below, previous = Counter(), 0, 0.0
    for sample in metric.samples:
        if sample.name.endswith("_bucket"):
            upper = float(sample.labels["le"])
            low = int(previous) + 1
            if upper == float("inf"):
                label = f">{int(previous)}"
            else:
                label = str(low) if low == int(upper) else f"{low}-{int(upper)}"
            buckets[label] = int(sample.value) - below
            below, previous = int(sample.value), upper
    return buckets


class EncodeBench:
    """One worker per configuration, started once, and the receiver process, for every round."""

    def __init__(self, tower, images: list[bytes], transport: str, receiver_conn):
        from encode_worker.config import WorkerConfig
        from encode_worker.inputs import image_from_bytes
        from encode_worker.worker import EncodeWorker

        self.tower = tower
        self.receiver = receiver_conn
        self.dtype = str(tower.dtype).removeprefix("torch.")
        grid = tower.processor(images=[image_from_bytes(images[0])], return_tensors="pt")[
            "image_grid_thw"
        ]
        self.rows = tower.rows_per_item(grid)[0]
        self.nbytes = self.rows * tower.info.wire_width * tower.dtype.itemsize
        self.workers = {}
        for sink in SINKS:  # "delivered" first: the null sinks run where its transport runs
            for batch in BATCH_ITEMS:
                config = WorkerConfig(
                    model=tower.model_id,
                    dtype=self.dtype,
                    bind="127.0.0.1",
                    bootstrap_port=0,
                    intake_port=0,
                    batch_items=batch,
                    queue_items=len(images),
                    cache_bytes=0,
                    ring_bytes=256 << 20,
                )
                transports = None  # the worker builds the real ones
                if sink == "null":
                    measured = self.workers[("delivered", batch)].transports[transport]
                    transports = {
                        "loopback": NullSink(
                            measured.copies_in_submit, in_background=not measured.copies_in_submit
                        )
                    }
                self.workers[(sink, batch)] = EncodeWorker(
                    config, tower=tower, transports=transports
                ).start()

    def close(self) -> None:
        for worker in self.workers.values():
            worker.stop()

    def round(self, sink: str, batch: int, images: list[bytes]) -> tuple[float, int, Counter]:
        """One timed round: (items/s, items not delivered, batches the scheduler formed)."""
        from encode_worker.intake import IntakeClient

        worker = self.workers[(sink, batch)]
        intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
        before = _batch_buckets(worker)
        try:
            started = time.monotonic()
            rooms = worker.table.mint(len(images), 300)
            if sink == "delivered":
                self.receiver.send((worker.bootstrap_port, rooms, self.rows))
            else:
                for room in rooms:
                    worker.table.register(
                        Registration(
                            room=room,
                            generation=1,
                            rows=self.rows,
                            width=self.tower.info.wire_width,
                            dtype=self.dtype,
                            offers=[
                                LoopbackOffer(
                                    kind="loopback", region=0, offset=0, capacity=self.nbytes
                                )
                            ],
                        )
                    )
            for index, (room, image) in enumerate(zip(rooms, images)):
                body = {
                    "request_id": f"b{index}",
                    "source": "bytes",
                    "encode_handshake": {
                        "bootstrap_room": room,
                        "bootstrap_host": "127.0.0.1",
                        "bootstrap_port": worker.bootstrap_port,
                    },
                }
                while not intake.send(body, image).ok:
                    time.sleep(0.005)
            if sink == "delivered":
                finished, done = (
                    self.receiver.recv()
                )  # CLOCK_MONOTONIC: one clock for the processes of a host
                delivered = sum(done)
            else:
                finished, delivered = worker.loop.run(_committed(worker.table, rooms))
        finally:
            intake.close()
        return (
            len(images) / (finished - started),
            len(images) - delivered,
            _batch_buckets(worker) - before,
        )


async def _committed(table, rooms: list[int]) -> tuple[float, int]:
    """On the worker's loop, until every room has ended: (when the last one did, how many ended in
    SUCCESS)."""
    versions = {room: 0 for room in rooms}
    success = 0
    while versions:
        for room, view in zip(list(versions), await table.watch(versions, 1.0)):
            if view.state.terminal:
                success += view.state is RoomState.SUCCESS
                del versions[room]
            else:
                versions[room] = view.version
    return time.monotonic(), success


def run(
    items: int = 48,
    size: int = 448,
    depth: int = 2,
    hidden: int = 64,
    width: int = 3584,
    transport: str = "shm",
    rounds: int = 3,
    dtype: str = "float32",
    progress=print,
) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from encode_worker.tower import VisionTower

    tower = VisionTower.load(bench_tower(depth, hidden, width), dtype=dtype)
    images = _images(items, size)
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    receiver = context.Process(
        target=_receiver_main,
        daemon=True,
        args=(child, 512 << 20, tower.info.wire_width, dtype, transport),
    )
    receiver.start()
    child.close()
    assert conn.recv() == "ready"
    configs = [Config(sink, batch) for batch in BATCH_ITEMS for sink in SINKS]
    failures = 0
    bench = None
    try:
        bench = EncodeBench(tower, images, transport, conn)
        for config in configs:  # warm-up: first connections and mappings, the tower's first calls
            bench.round(config.sink, config.batch_items, images[:8])
        for round_index in range(rounds):
            for config in in_round(configs, round_index):
                rate, failed, batches = bench.round(config.sink, config.batch_items, images)
                config.items_per_s.append(rate)
                config.batches += batches
                failures += failed
            progress(
                f"  round {round_index + 1}/{rounds}: "
                + ", ".join(f"{c.name} {c.items_per_s[-1]:.1f}/s" for c in configs)
            )
    finally:
        if bench is not None:
            bench.close()
        conn.send(None)
        receiver.join(30)
    median = {c.name: statistics.median(c.items_per_s) for c in configs}
    ratios = {
        "delivered/null (batched)": median["delivered_batched"] / median["null_batched"],
        "delivered/null (single)": median["delivered_single"] / median["null_single"],
        "batched/single (delivered)": median["delivered_batched"] / median["delivered_single"],
        "batched/single (null sink)": median["null_batched"] / median["null_single"],
    }
    return {
        "items": items,
        "size": size,
        "dtype": dtype,
        "rounds": rounds,
        "transport": transport,
        "tower": {"depth": depth, "hidden": hidden, "out_width": width},
        "configs": {
            c.name: {
                "sink": c.sink,
                "batch_items_max": c.batch_items,
                "items_per_s": median[c.name],
                "items_per_s_rounds": c.items_per_s,
                "batches": {label: n for label, n in c.batches.items() if n},
                "items_per_batch_mean": _mean_batch(c.batches, items * rounds),
            }
            for c in configs
        },
        "ratios": ratios,
        "failed_items": failures,
    }


def _mean_batch(batches: Counter, items: int) -> float | None:
    count = sum(batches.values())
    return items / count if count else None


def main(args) -> int:
    print(
        f"epd-bench encode: {args.items} images of {args.size}x{args.size}, tower depth "
        f"{args.depth} hidden "
        f"{args.hidden} out width {args.width} ({args.dtype}), transport {args.transport}, "
        f"{args.rounds} rounds"
    )
    report = run(
        args.items,
        args.size,
        args.depth,
        args.hidden,
        args.width,
        args.transport,
        args.rounds,
        args.dtype,
    )
    print(
        f"\n{'configuration':18s} {'items/s':>8s}  {'per round':24s} batches formed (items: "
        "count), mean"
    )
    for name, row in report["configs"].items():
        rounds = " ".join(f"{v:.1f}" for v in row["items_per_s_rounds"])
        batches = " ".join(f"{label}:{n}" for label, n in row["batches"].items())
        mean = row["items_per_batch_mean"]
        print(f"  {name:16s} {row['items_per_s']:8.1f}  {rounds:24s} {batches}, {mean or 0:.2f}")
    print("ratios (medians, same run):")
    for name, value in report["ratios"].items():
        print(f"  {name:28s} {value:5.2f}")
    if report["failed_items"]:
        print(f"FAILED items: {report['failed_items']}")
    write_json(args.json, report)
    return 0 if not report["failed_items"] else 1
