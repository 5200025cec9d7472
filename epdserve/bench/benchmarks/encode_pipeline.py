"""The pipeline part of `epd-bench encode` (``bench.benchmarks.encode``): every configuration
runs the same real ``EncodeWorker`` (ZMQ intake, prepare / tower / stage threads, the scheduler's
batching, send ring, checksum, the sender on the handshake loop, begin write and commit in the
worker's own room table); only the sink differs:

* ``delivered``: a ``PrefillReceiver`` in another process registers every room over HTTP,
  long-polls, and verifies and copies out each item written over ``--transport``;
* ``null``: the bench registers every room in the worker's table in-process, offering a sink
  that completes each write without moving a byte, started as the measured transport is (on the
  handshake loop, as a copy for SHM, in the background for Mooncake).

The clock runs from minting the rooms (registration included) until the last item is published
by the receiver (``delivered``) or committed (``null``). Each configuration (batches as the
device's default budget forms them, and of 1 item) has its own worker, started and warmed up
once; rounds are interleaved (the order reversed every other round) and the median is reported,
with the batch sizes the scheduler really formed (the worker's ``epd_encoder_batch_items``
histogram over the timed rounds), CPU per item by thread of the worker (``cpu_budget.GROUPS``;
the bench's own threads apart) and, on a GPU, the share of the round's wall time the GPU ran the
tower (the sum of the batches' compute-stream time between CUDA events,
``epd_encoder_encode_seconds``), with NVML's utilization sampled every 20 ms beside it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from epdserve.bench.benchmarks import cpu_budget
from epdserve.bench.benchmarks.rounds import in_round
from epdserve.bench.benchmarks.threads_cpu import delta, threads_cpu_s
from epdserve.data_plane.transport import CompletedTransfer, Transfer, Transport
from epdserve.wire.offers import LoopbackOffer
from epdserve.wire.rooms import Registration, RoomState

SINKS = ("delivered", "null")
RECEIVER_SLOT_BYTES = 1 << 20  # the receiver's pool slots
GPU_SAMPLE_S = 0.02


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
    from epdserve.testing.receive_items import loopback_job_inputs
    from prefill_side import PrefillReceiver, ReceiverConfig

    receiver = PrefillReceiver(
        ReceiverConfig(
            width=width,
            dtype=dtype,
            pool_bytes=pool_bytes,
            slot_bytes=RECEIVER_SLOT_BYTES,
            transports=(transport,),
            item_timeout_s=300,
        )
    )
    conn.send("ready")
    try:
        while (message := conn.recv()) is not None:
            port, rooms, rows = message
            job = receiver.start("bench", loopback_job_inputs(rooms, rows, port))
            job.wait(600)
            conn.send((time.monotonic(), [o.state == "DONE" for o in job.outcomes]))
    finally:
        receiver.close()


@dataclass
class Config:
    sink: str  # "delivered" | "null"
    batch_items: int | None  # None: the device's default budget
    items_per_s: list[float] = field(default_factory=list)  # one per timed round
    # ms of CPU per item by thread group of this process (cpu_budget.GROUPS), one per round
    cpu_ms_by_thread: list[dict[str, float]] = field(default_factory=list)
    gpu_busy_percent: list[float] = field(default_factory=list)  # the batches' GPU time / wall
    nvml_busy_percent: list[float] = field(default_factory=list)  # NVML's utilization sampled
    batches: Counter = field(
        default_factory=Counter
    )  # histogram bucket -> batches, timed rounds only

    @property
    def name(self) -> str:
        return f"{self.sink}_{'single' if self.batch_items == 1 else 'batched'}"


def batch_buckets(worker) -> Counter:
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


class GpuBusy:
    """NVML's utilization of the GPU while a block ran, sampled every ``GPU_SAMPLE_S`` on a thread
    (NVML averages each reading over its own 1/6 to 1 s window: edges are blurred); None on the
    CPU, and where NVML does not answer (``unavailable`` says why)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.samples: list[float] = []
        self.unavailable: str | None = None
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> GpuBusy:
        if self.device.type == "cuda":
            try:
                torch.cuda.utilization(self.device)  # NVML (pynvml) answers, or says why not
            except Exception as exc:  # pynvml missing, or its own NVMLError: said, not sampled
                self.unavailable = f"{type(exc).__name__}: {exc}"
                return self
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(GPU_SAMPLE_S):
            self.samples.append(float(torch.cuda.utilization(self.device)))

    @property
    def percent(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


class EncodeBench:
    """One worker per configuration, started once, and the receiver process, for every round."""

    def __init__(
        self,
        tower,
        images: list[bytes],
        transport: str,
        receiver_conn,
        configs,
        worker_settings: dict | None = None,
    ):
        from encode_worker.config import WorkerConfig
        from encode_worker.worker import EncodeWorker

        self.tower = tower
        self.receiver = receiver_conn
        self.dtype = str(tower.dtype).removeprefix("torch.")
        self.rows, self.nbytes = _item_size(tower, images[0])
        self.workers = {}
        for config in sorted(configs, key=lambda c: c.sink):  # "delivered" first: see below
            settings = WorkerConfig(
                model=tower.model_id,
                dtype=self.dtype,
                device=str(tower.device),
                bind="127.0.0.1",
                bootstrap_port=0,
                intake_port=0,
                batch_items=config.batch_items,
                cache_bytes=0,
                ring_bytes=max(256 << 20, 4 * self.nbytes),
                ring_slot_bytes=1 << 20,
                **(worker_settings or {}),
            )
            settings = settings.model_copy(
                update={"queue_items": max(settings.queue_items, len(images))}
            )
            transports = None  # the worker builds the real ones
            if config.sink == "null":  # it runs where the delivered configuration's transport runs
                measured = self.workers[("delivered", config.batch_items)].transports[transport]
                transports = {
                    "loopback": NullSink(
                        measured.copies_in_submit, in_background=not measured.copies_in_submit
                    )
                }
            self.workers[(config.sink, config.batch_items)] = EncodeWorker(
                settings, tower=tower, transports=transports
            ).start()

    def close(self) -> None:
        for worker in self.workers.values():
            worker.stop()

    def round(self, config: Config, images: list[bytes]) -> Round:
        """One timed round, its clock from minting the rooms to the last item's end."""
        from epdserve.wire.intake import IntakeClient

        worker = self.workers[(config.sink, config.batch_items)]
        intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
        before = batch_buckets(worker)
        tower_s = _histogram_sum(worker.metrics.encode_seconds)
        threads = threads_cpu_s(os.getpid())
        try:
            started = time.monotonic()
            rooms = worker.table.mint(len(images), 300)
            if config.sink == "delivered":
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
            if config.sink == "delivered":
                finished, done = (
                    self.receiver.recv()
                )  # CLOCK_MONOTONIC: one clock for the processes of a host
                delivered = sum(done)
            else:
                finished, delivered = worker.loop.run(rooms_committed(worker.table, rooms))
        finally:
            intake.close()
        wall = finished - started
        return Round(
            items_per_s=len(images) / wall,
            failed=len(images) - delivered,
            batches=batch_buckets(worker) - before,
            cpu_ms_by_thread=cpu_budget.by_group(
                delta(threads_cpu_s(os.getpid()), threads), len(images)
            ),
            tower_busy=(_histogram_sum(worker.metrics.encode_seconds) - tower_s) / wall,
        )


@dataclass(frozen=True)
class Round:
    items_per_s: float
    failed: int  # items not delivered
    batches: Counter  # the batches the scheduler formed (histogram bucket -> count)
    cpu_ms_by_thread: dict[str, float]  # this process's CPU per item by thread group
    tower_busy: float  # the batches' tower time (on a GPU: CUDA events) over the round's wall


def _histogram_sum(histogram) -> float:
    """The running sum of a prometheus Histogram (its ``_sum`` sample)."""
    (metric,) = histogram.collect()
    return next(sample.value for sample in metric.samples if sample.name.endswith("_sum"))


async def rooms_committed(table, rooms: list[int]) -> tuple[float, int]:
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


def pipeline(
    tower,
    images: list[bytes],
    transport: str = "shm",
    rounds: int = 3,
    batches: tuple[int | None, ...] = (None, 1),
    pool_bytes: int | None = None,
    worker_settings: dict | None = None,
    progress=print,
) -> dict:
    """The worker delivering ``images`` into a receiver process and into a null sink, at each of
    ``batches`` (None: the device's default budget), interleaved rounds; medians and ratios.
    ``worker_settings``: ``WorkerConfig`` fields over the bench's. The receiver's pool holds a
    whole round (its job reserves every item at once, each in whole slots) unless
    ``pool_bytes`` says otherwise."""
    if pool_bytes is None:
        slots = -(-_item_size(tower, images[0])[1] // RECEIVER_SLOT_BYTES)
        pool_bytes = max(256 << 20, (len(images) + 8) * slots * RECEIVER_SLOT_BYTES)
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    dtype = str(tower.dtype).removeprefix("torch.")
    receiver = context.Process(
        target=_receiver_main,
        daemon=True,
        args=(child, pool_bytes, tower.info.wire_width, dtype, transport),
    )
    receiver.start()
    child.close()
    assert conn.recv() == "ready"
    configs = [Config(sink, batch) for batch in batches for sink in SINKS]
    failures = 0
    bench = None
    try:
        bench = EncodeBench(tower, images, transport, conn, configs, worker_settings)
        for config in configs:  # warm-up: first connections and mappings, the tower's first calls
            bench.round(config, images[:8])
        on_gpu = torch.device(str(tower.device)).type == "cuda"
        for round_index in range(rounds):
            for config in in_round(configs, round_index):
                with GpuBusy(str(tower.device)) as nvml:
                    measured = bench.round(config, images)
                config.cpu_ms_by_thread.append(measured.cpu_ms_by_thread)
                if on_gpu:
                    config.gpu_busy_percent.append(100 * measured.tower_busy)
                if nvml.percent is not None:
                    config.nvml_busy_percent.append(nvml.percent)
                config.items_per_s.append(measured.items_per_s)
                config.batches += measured.batches
                failures += measured.failed
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
    ratios = {}
    for kind in ("batched", "single"):
        if f"null_{kind}" in median:
            ratios[f"delivered/null ({kind})"] = (
                median[f"delivered_{kind}"] / median[f"null_{kind}"]
            )
    if "null_single" in median and "null_batched" in median:
        ratios["batched/single (delivered)"] = (
            median["delivered_batched"] / median["delivered_single"]
        )
        ratios["batched/single (null sink)"] = median["null_batched"] / median["null_single"]
    return {
        "items": len(images),
        "rounds": rounds,
        "transport": transport,
        "configs": {
            c.name: {
                "sink": c.sink,
                "batch_items_max": c.batch_items or "device default",
                "items_per_s": median[c.name],
                "items_per_s_rounds": c.items_per_s,
                "cpu_ms_per_item_by_thread": {
                    name: round(statistics.median(r[name] for r in c.cpu_ms_by_thread), 4)
                    for name in c.cpu_ms_by_thread[0]
                },
                "gpu_busy_percent": _median_or_none(c.gpu_busy_percent),
                "nvml_busy_percent": _median_or_none(c.nvml_busy_percent),
                "batches": {label: n for label, n in c.batches.items() if n},
                "items_per_batch_mean": _mean_batch(c.batches, len(images) * rounds),
            }
            for c in configs
        },
        "ratios": ratios,
        "failed_items": failures,
    }


def _item_size(tower, image: bytes) -> tuple[int, int]:
    """An image's rows and their bytes (a round's images are all of one size)."""
    from epdserve.vision.images import image_from_bytes

    grid = tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
    rows = tower.rows_per_item(grid["image_grid_thw"])[0]
    return rows, rows * tower.info.wire_width * tower.dtype.itemsize


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean_batch(batches: Counter, items: int) -> float | None:
    count = sum(batches.values())
    return items / count if count else None


def print_pipeline(size: str, report: dict) -> None:
    print(
        f"\n{size}: pipeline\n{'configuration':18s} {'items/s':>8s}  {'per round':24s} "
        f"{'worker CPU ms/item':>18s} {'GPU busy':>8s} {'NVML':>5s}  batches formed (items: "
        "count), mean"
    )
    for name, row in report["configs"].items():
        rounds = " ".join(f"{v:.1f}" for v in row["items_per_s_rounds"])
        batches = " ".join(f"{label}:{n}" for label, n in row["batches"].items())
        mean = row["items_per_batch_mean"]
        busy, nvml = (
            f"{row[key]:.0f} %" if row[key] is not None else "-"
            for key in ("gpu_busy_percent", "nvml_busy_percent")
        )
        by_thread = row["cpu_ms_per_item_by_thread"]
        worker_ms = sum(ms for thread, ms in by_thread.items() if thread != cpu_budget.OTHER)
        print(
            f"  {name:16s} {row['items_per_s']:8.1f}  {rounds:24s} "
            f"{worker_ms:18.2f} {busy:>8s} {nvml:>5s}  {batches}, {mean or 0:.2f}"
        )
        threads = ", ".join(f"{thread} {ms:.3f}" for thread, ms in by_thread.items() if ms)
        print(f"    CPU ms/item by thread: {threads}")
    print("ratios (medians, same run):")
    for name, value in report["ratios"].items():
        print(f"  {name:28s} {value:5.2f}")
    if report["failed_items"]:
        print(f"FAILED items: {report['failed_items']}")
