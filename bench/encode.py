"""`epd-bench encode`: items/s of the encode worker, side by side in one run.

A small Qwen2.5-VL-architecture tower whose output width is a real one (3584, as Qwen2.5-VL-7B),
so the bytes moved per item are real (448x448 -> 256 rows x 3584: 3.7 MB in float32, the default
here because this CPU runs small bf16 towers ~5x slower than fp32; 1.8 MB in bf16). Configurations:

* ``tower_only_batched`` / ``tower_only_single``: preprocess + tower + row split, no delivery;
* ``delivered_batched`` / ``delivered_single``: the whole worker (ZMQ intake, batching, send
  ring, checksum, commit) delivering every item into a receiver in another process;
* ``delivered_batched_no_checksum``: the same without the checksum, to show its cost.

Ratios: delivered / tower-only (how much of the transfer hides behind compute) and batched /
single (cross-request batching).
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

from handshake.models import RoomState

DEFAULT_CACHE = os.path.expanduser("~/.cache/epd-encode-worker")


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


def _receiver_main(conn, pool_bytes: int) -> None:
    """The prefill side: the project's receiver library, one job per round for all its items."""
    from multimodal.items import Modality, MultimodalDataItem, MultimodalInputs
    from prefill_side import PrefillReceiver, ReceiverConfig

    receiver = None
    conn.send("ready")
    try:
        while (message := conn.recv()) is not None:
            port, rooms, rows, width, dtype, transport = message
            if receiver is None:
                receiver = PrefillReceiver(ReceiverConfig(width=width, dtype=dtype, pool_bytes=pool_bytes,
                                                          transports=(transport,), item_timeout_s=300))
            items = [MultimodalDataItem(Modality.IMAGE, offsets=[[0, rows - 1]],
                                        encode_handshake={"bootstrap_room": room, "bootstrap_host": "127.0.0.1",
                                                          "bootstrap_port": port}) for room in rooms]
            job = receiver.start("bench", MultimodalInputs(items))
            job.wait(600)
            conn.send((time.monotonic(), [o.state for o in job.outcomes]))
    finally:
        if receiver is not None:
            receiver.close()


def _decode(image: bytes):
    from encode_worker.inputs import image_from_bytes

    return image_from_bytes(image)


def _tower_only(tower, images, batch_items: int) -> float:
    import torch

    from encode_worker.inputs import image_from_bytes
    from multimodal.rows import split_rows

    started = time.monotonic()
    for start in range(0, len(images), batch_items):
        inputs = [tower.processor(images=[image_from_bytes(b)], return_tensors="pt")
                  for b in images[start:start + batch_items]]
        pixel_values = torch.cat([i["pixel_values"] for i in inputs])
        grid = torch.cat([i["image_grid_thw"] for i in inputs])
        split_rows(tower.encode(pixel_values, grid), tower.rows_per_item(grid))
    return len(images) / (time.monotonic() - started)


def _delivered(tower, images, batch_items: int, checksum: bool, transport: str, conn) -> tuple[float, int]:
    from encode_worker.intake import IntakeClient
    from encode_worker.worker import EncodeWorker, WorkerConfig

    config = WorkerConfig(model=tower.model_id, dtype=str(tower.dtype).removeprefix("torch."), transports=("shm", "mooncake"), bind="127.0.0.1",
                          bootstrap_port=0, intake_port=0, batch_items=batch_items, queue_items=len(images),
                          cache_bytes=0, checksum=checksum, ring_bytes=256 << 20)
    worker = EncodeWorker(config, tower=tower).start()
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        rooms = worker.table.mint(len(images), 300)
        rows = tower.rows_per_item(tower.processor(images=[_decode(images[0])], return_tensors="pt")["image_grid_thw"])[0]
        conn.send((worker.bootstrap_port, rooms, rows, tower.info.wire_width, str(tower.dtype).removeprefix("torch."),
                   transport))
        while not all(worker.table.view(room).state is RoomState.REGISTERED for room in rooms):
            time.sleep(0.01)  # every receiver is in place before the clock starts
        started = time.monotonic()
        for index, (room, image) in enumerate(zip(rooms, images)):
            body = {"request_id": f"b{index}", "source": "bytes", "content_hash": index + 1,
                    "encode_handshake": {"bootstrap_room": room, "bootstrap_host": "127.0.0.1",
                                         "bootstrap_port": worker.bootstrap_port}}
            while not intake.send(body, image)["ok"]:
                time.sleep(0.005)
        finished, states = conn.recv()  # CLOCK_MONOTONIC: comparable across processes on one host
        delivered = states.count("DONE")
        return delivered / (finished - started), len(images) - delivered
    finally:
        intake.close()
        worker.stop()


def run(items: int = 48, size: int = 448, depth: int = 2, hidden: int = 64, width: int = 3584,
        transport: str = "shm", rounds: int = 3, dtype: str = "float32", progress=print) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from encode_worker.tower import VisionTower

    tower = VisionTower.load(bench_tower(depth, hidden, width), dtype=dtype)
    images = _images(items, size)
    _tower_only(tower, images[:8], 8)  # warm-up
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    receiver = context.Process(target=_receiver_main, args=(child, 512 << 20), daemon=True)
    receiver.start()
    child.close()
    assert conn.recv() == "ready"
    results: dict[str, list[float]] = {}
    failures = 0
    try:
        for round_index in range(rounds):  # interleaved rounds; median per configuration
            for name, batch in (("tower_only_batched", 8), ("tower_only_single", 1)):
                results.setdefault(name, []).append(_tower_only(tower, images, batch))
            for name, batch, checksum in (("delivered_batched", 8, True), ("delivered_single", 1, True),
                                          ("delivered_batched_no_checksum", 8, False)):
                rate, failed = _delivered(tower, images, batch, checksum, transport, conn)
                failures += failed
                results.setdefault(name, []).append(rate)
            progress(f"  round {round_index + 1}/{rounds}: "
                     + ", ".join(f"{k} {v[-1]:.1f}/s" for k, v in results.items()))
    finally:
        conn.send(None)
        receiver.join(30)
    medians = {name: statistics.median(values) for name, values in results.items()}
    ratios = {
        "delivered/tower_only (batched)": medians["delivered_batched"] / medians["tower_only_batched"],
        "batched/single (delivered)": medians["delivered_batched"] / medians["delivered_single"],
        "batched/single (tower only)": medians["tower_only_batched"] / medians["tower_only_single"],
        "checksum on/off (delivered, batched)": medians["delivered_batched"] / medians["delivered_batched_no_checksum"],
    }
    return {"items": items, "size": size, "dtype": dtype,
            "tower": {"depth": depth, "hidden": hidden, "out_width": width},
            "transport": transport,
            "items_per_s": medians, "ratios": ratios, "failed_items": failures, "rounds": rounds}


def main(args) -> int:
    print(f"epd-bench encode: {args.items} images of {args.size}x{args.size}, tower depth {args.depth} hidden "
          f"{args.hidden} out width {args.width} ({args.dtype}), transport {args.transport}, {args.rounds} rounds")
    report = run(args.items, args.size, args.depth, args.hidden, args.width, args.transport, args.rounds, args.dtype)
    print("\nitems/s (median):")
    for name, value in report["items_per_s"].items():
        print(f"  {name:32s} {value:7.1f}")
    print("ratios:")
    for name, value in report["ratios"].items():
        print(f"  {name:40s} {value:5.2f}")
    if report["failed_items"]:
        print(f"FAILED items: {report['failed_items']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if not report["failed_items"] else 1
