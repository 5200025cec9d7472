"""`epd-bench receive`: what the receive path costs per item beyond the bytes themselves.

The encode side runs in its own process, as deployed: the encode worker's own send path (its
``Sender``, its handshake server on loopback, on one event loop, reaching its room table
in-process), with each item's rows already staged in the send ring and waiting for a receiver
(the receiver comes last, so the receive path is the whole critical path). This process runs the
real receiver library. Per job: overhead per item = (job time - the writes' own time, as the
sender's commit reports it) / items, for 1-image and 8-image requests: reserve, register, the
sender noticing and committing, observing the commit, copying out (or, with ``zero_copy``,
publishing a view of the slot), verifying the checksum, release.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from epdserve.bench.benchmarks.results import write_json

ROWS, WIDTH = 256, 3584  # a 448x448 image for Qwen2.5-VL-7B, bf16: 1.8 MB


def _encode_side(conn) -> None:
    import torch

    from encode_worker.sender import Sender
    from encode_worker.writes import StagedItem, stage
    from epdserve.data_plane.commit import EmbeddingLayout, checksum
    from epdserve.data_plane.pool import MemoryRegion, SlotPool
    from epdserve.data_plane.shm_transport import ShmTransport
    from epdserve.loop_threads import LoopThread
    from epdserve.wire.addresses import EncodeHandshake
    from handshake.access import LocalRooms
    from handshake.app import create_app
    from handshake.rooms import RoomTable
    from handshake.server import ThreadedServer

    table = RoomTable()
    loop = LoopThread("handshake")
    server = ThreadedServer(create_app(table), loop=loop).start()
    shm = ShmTransport()
    rows = torch.randn(ROWS, WIDTH).to(torch.bfloat16)
    layout = EmbeddingLayout.of(rows)
    ring = SlotPool(MemoryRegion.anonymous(64 << 20), 1 << 20, quarantine_s=60)
    sender = Sender(ring, {"shm": shm}, lambda handshake: LocalRooms(table), loop)
    conn.send(server.port)
    try:
        while (count := conn.recv()) is not None:
            rooms = table.mint(count, 60)
            for room in rooms:
                lease = stage(ring, rows)
                handshake = EncodeHandshake(
                    bootstrap_room=room, bootstrap_host="127.0.0.1", bootstrap_port=server.port
                )
                sender.submit(
                    StagedItem("bench", handshake, lease, layout, checksum(ring.view(lease)), {})
                )
            conn.send(rooms)
    finally:
        sender.close()
        server.stop()
        loop.stop()
        shm.close()
        ring.region.close()


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1e3


def run(jobs: int = 60, progress=print) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from epdserve.loop_threads import LoopThread
    from epdserve.testing.receive_items import loopback_job_inputs
    from epdserve.wire.room_client import HandshakeClient
    from prefill_side import JobState, PrefillReceiver, ReceiverConfig

    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    encode_side = context.Process(target=_encode_side, args=(child,), daemon=True)
    encode_side.start()
    child.close()
    port = conn.recv()
    receivers = {
        mode: PrefillReceiver(
            ReceiverConfig(
                width=WIDTH,
                dtype="bfloat16",
                pool_bytes=64 << 20,
                transports=("shm",),
                zero_copy=mode == "zero_copy",
            )
        )
        for mode in ("copy", "zero_copy")
    }
    # the machine's floor, in the same run: an empty HTTP round trip to the same server, from this
    # thread through a client loop thread (the hand-offs a job pays too)
    probe_loop = LoopThread("bench-probe")
    probe = HandshakeClient(f"http://127.0.0.1:{port}")
    round_trips: list[float] = []
    report = {}
    try:
        for images in (1, 8):
            published = {mode: [] for mode in receivers}
            returned = {mode: [] for mode in receivers}
            for index in range(jobs + 5):
                started = time.perf_counter()
                probe_loop.run(probe.healthy())
                if index >= 5:
                    round_trips.append(time.perf_counter() - started)
                for (
                    mode,
                    receiver,
                ) in receivers.items():  # interleaved: both modes see the same machine
                    conn.send(images)
                    inputs = loopback_job_inputs(conn.recv(), ROWS, port)
                    started = time.perf_counter()
                    job = receiver.start(f"{mode}{index}", inputs)
                    state = job.wait(30)
                    elapsed = time.perf_counter() - started
                    # zero-copy: the engine is done with the views (a no-op for copies)
                    job.release()
                    if state is not JobState.DONE:
                        raise RuntimeError(f"job failed: {job.reasons}")
                    # the writes run one after another on the sender's loop: their sum is their span
                    transfer_s = sum(outcome.encoder.transfer_s for outcome in job.outcomes)
                    if index >= 5:  # warm-up: connections, first mappings
                        last = max(
                            outcome.seconds for outcome in job.outcomes
                        )  # job start -> last item published
                        published[mode].append((last - transfer_s) / images)
                        returned[mode].append((elapsed - transfer_s) / images)
            for mode in receivers:
                key = f"{images}_image" + ("_zero_copy" if mode == "zero_copy" else "")
                report[key] = {
                    "p50_ms": _p(published[mode], 0.5),
                    "p99_ms": _p(published[mode], 0.99),
                    "p50_until_wait_returned_ms": _p(returned[mode], 0.5),
                    "jobs": jobs,
                }
                progress(
                    f"  {mode:9s} {images}-image requests: overhead per item p50 "
                    f"{report[key]['p50_ms']:.2f} ms, "
                    f"p99 {report[key]['p99_ms']:.2f} ms (until wait() returned: p50 "
                    f"{report[key]['p50_until_wait_returned_ms']:.2f} ms)"
                )
        report["empty_round_trip_ms"] = {"p50": _p(round_trips, 0.5), "p99": _p(round_trips, 0.99)}
        progress(
            f"  an empty HTTP round trip to the same server, from this thread: p50 "
            f"{report['empty_round_trip_ms']['p50']:.2f} ms, p99 "
            f"{report['empty_round_trip_ms']['p99']:.2f} ms"
        )
    finally:
        conn.send(None)
        encode_side.join(10)
        probe_loop.run(probe.close())
        probe_loop.stop()
        for receiver in receivers.values():
            receiver.close()
    return report


def main(args) -> int:
    print(
        f"epd-bench receive: {ROWS}x{WIDTH} bf16 items over SHM from the encode worker's sender "
        "(another "
        f"process), {args.jobs} jobs each; overhead = (job start -> last item published - the "
        "writes) / items"
    )
    report = run(args.jobs)
    write_json(args.json, report)
    return 0
