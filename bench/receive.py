"""`epd-bench receive`: what the receive path costs per item beyond the bytes themselves.

The encode side runs in its own process, as deployed: a real handshake server (uvicorn on
loopback) and a writer that, for each room, waits for the registration, copies the rows into the
receiver's slot over SHM (the raw transfer, timed on its own) and commits with a checksum. This
process runs the real receiver library. Per job: overhead per item = (job time - raw copy time)
/ items, for 1-image and 8-image requests: reserve, register, observe the commit, verify the
checksum, copy out (or, with ``zero_copy``, publish a view of the slot), release.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import threading
import time

ROWS, WIDTH = 256, 3584  # a 448x448 image for Qwen2.5-VL-7B, bf16: 1.8 MB


def _encode_side(conn) -> None:
    import torch

    from data_plane.commit import checksum
    from data_plane.offers import ShmOffer
    from data_plane.shm_transport import ShmTransport
    from handshake.app import create_app
    from handshake.models import CommitBody, RoomState
    from handshake.rooms import RoomTable
    from handshake.server import ThreadedServer

    table = RoomTable()
    server = ThreadedServer(create_app(table)).start()
    shm = ShmTransport()
    rows = torch.randn(ROWS, WIDTH).to(torch.bfloat16)
    digest = checksum(rows)
    conn.send(server.port)

    def write(rooms: list[int]) -> None:
        pending = {room: 0 for room in rooms}
        copy_s = 0.0
        while pending:
            for view in table.watch_sync(pending, 5.0):
                if view.room not in pending:
                    continue
                pending[view.room] = view.version
                if view.state is RoomState.REGISTERED:
                    del pending[view.room]
                    registration = view.registration
                    offer = next(o for o in registration.offers if isinstance(o, ShmOffer))
                    started = time.perf_counter()
                    shm.submit(rows, offer, time.monotonic() + 5).wait()
                    copy_s += time.perf_counter() - started
                    table.commit(CommitBody(room=view.room, generation=registration.generation, transport="shm",
                                            rows=ROWS, width=WIDTH, dtype="bfloat16", checksum=digest))
        conn.send(copy_s)

    try:
        while (count := conn.recv()) is not None:
            rooms = table.mint(count, 60)
            threading.Thread(target=write, args=(rooms,), daemon=True).start()
            conn.send(rooms)
    finally:
        shm.close()
        server.stop()


def run(jobs: int = 60, progress=print) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from multimodal.items import Modality, MultimodalDataItem, MultimodalInputs
    from prefill_side import JobState, PrefillReceiver, ReceiverConfig

    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    encode_side = context.Process(target=_encode_side, args=(child,), daemon=True)
    encode_side.start()
    child.close()
    port = conn.recv()
    receivers = {mode: PrefillReceiver(ReceiverConfig(width=WIDTH, dtype="bfloat16", pool_bytes=64 << 20,
                                                      transports=("shm",), zero_copy=mode == "zero_copy"))
                 for mode in ("copy", "zero_copy")}
    report = {}
    try:
        for images in (1, 8):
            per_item = {mode: [] for mode in receivers}
            for index in range(jobs + 5):
                for mode, receiver in receivers.items():  # interleaved: both modes see the same machine
                    conn.send(images)
                    rooms = conn.recv()
                    items = [MultimodalDataItem(Modality.IMAGE, offsets=[[0, ROWS - 1]],
                                                encode_handshake={"bootstrap_room": room,
                                                                  "bootstrap_host": "127.0.0.1",
                                                                  "bootstrap_port": port}) for room in rooms]
                    started = time.perf_counter()
                    job = receiver.start(f"{mode}{index}", MultimodalInputs(items))
                    state = job.wait(30)
                    elapsed = time.perf_counter() - started
                    job.release()  # zero-copy: the engine is done with the views (a no-op for copies)
                    copy_s = conn.recv()
                    if state is not JobState.DONE:
                        raise RuntimeError(f"job failed: {job.reasons}")
                    if index >= 5:  # warm-up: connections, first mappings
                        per_item[mode].append((elapsed - copy_s) / images)
            for mode, samples in per_item.items():
                samples.sort()
                key = f"{images}_image" + ("_zero_copy" if mode == "zero_copy" else "")
                report[key] = {"p50_ms": statistics.median(samples) * 1e3,
                               "p99_ms": samples[max(0, int(len(samples) * 0.99) - 1)] * 1e3, "jobs": jobs}
                progress(f"  {mode:9s} {images}-image requests: overhead per item p50 {report[key]['p50_ms']:.2f} ms, "
                         f"p99 {report[key]['p99_ms']:.2f} ms")
    finally:
        conn.send(None)
        encode_side.join(10)
        for receiver in receivers.values():
            receiver.close()
    return report


def main(args) -> int:
    print(f"epd-bench receive: {ROWS}x{WIDTH} bf16 items over SHM, handshake server in the encode-side process, "
          f"{args.jobs} jobs each")
    report = run(args.jobs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0
