"""`make demo`: the whole EPD path on this machine, every role its own process.

Starts a handshake endpoint, an encode worker and two reference prefill processes (one that
receives over Mooncake TCP only, as if on another node; one that shares /dev/shm with the worker),
sends a few multi-image requests through the dispatcher, and prints, per item: rows x width,
the transport, where the time went, and whether the rows equal the prefill process's own tower
run on the same image. Then stops every process and checks that no SHM segment is left.

    python -m bench.demo [--model DIR] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import sys
import time
import urllib.request

from bench.cluster import LocalCluster
from bench.images import synthetic_image

# (request id, prefill process, images as (width, height, seed, format)); seed 1 repeats: a cache hit
REQUESTS = [
    ("req-1", "prefill-mooncake", [(448, 448, 1, "PNG"), (640, 480, 2, "JPEG"), (336, 336, 3, "PNG")]),
    ("req-2", "prefill-shm", [(448, 448, 1, "PNG"), (512, 384, 4, "JPEG")]),
    ("req-3", "prefill-shm", [(800, 600, 5, "JPEG"), (224, 224, 6, "PNG"), (1024, 768, 7, "JPEG"),
                              (448, 448, 8, "PNG")]),
]
INTRO = """\
EPD (encode / prefill / decode): the vision tower runs in an encode worker, not on the prefill
engine. Per image, the dispatcher mints a room and sends the pixels to a worker chosen by the
image's content hash; the prefill process reserves memory for the image's rows and registers it
in the room; the worker runs the tower and writes the rows straight into that memory (Mooncake
between nodes, shared memory on the same node), then commits; the prefill process checks the
commit (generation, shape, checksum) and publishes the rows as item.encoded.
"""


def default_model() -> str:
    from bench.encode import bench_tower

    return bench_tower(depth=2, hidden=64, width=3584)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        total = 0.0
        for line in response.read().decode().splitlines():
            if line.startswith(name):
                total += float(line.rsplit(" ", 1)[1])
        return total


async def _requests(cluster: LocalCluster, roles: dict, processor) -> bool:
    import aiohttp

    from dispatcher import Dispatcher, WorkerSet
    from dispatcher.cli import prefill_body

    workers = WorkerSet([roles["encode-worker"].worker])
    await workers.refresh()
    dispatcher = Dispatcher(workers, processor, rooms_url=roles["handshake"].url)
    all_exact = True
    try:
        async with aiohttp.ClientSession() as session:
            for request_id, prefill, specs in REQUESTS:
                images = [synthetic_image(w, h, seed, fmt) for w, h, seed, fmt in specs]
                started = time.monotonic()
                items = await dispatcher.dispatch(request_id, images)
                posted = time.monotonic()
                body = prefill_body(request_id, items, verify=True)
                async with session.post(roles[prefill].url + "/v1/prefill", json=body) as response:
                    report = await response.json()
                elapsed = time.monotonic() - started
                print(f"\n{request_id}: {len(images)} images -> {prefill} "
                      f"({'Mooncake TCP' if 'mooncake' in prefill else 'same-node SHM'}): {report['state']} "
                      f"in {elapsed * 1e3:.0f} ms")
                print(f"  {'item':4s} {'image':>13s} {'hash':>8s} {'rows x width':>12s} {'transport':>9s} "
                      f"{'queue':>6s} {'encode':>6s} {'xfer':>6s} {'hshake':>6s} {'total':>6s}  bit-exact")
                for (w, h, _, fmt), item, row in zip(specs, items, report["items"]):
                    all_exact &= row["verified"] is True
                    print("  " + _row(item, row, f"{w}x{h} {'jpg' if fmt == 'JPEG' else 'png'}", posted - started))
    finally:
        await dispatcher.close()
        await workers.close()
    return all_exact


def _row(item, row: dict, label: str, before_prefill_s: float) -> str:
    if row["state"] != "DONE":
        return f"{item.index:<4d} {label:>13s} FAILED: {row['reason']}"
    timings = row["encoder"] or {}
    total = (before_prefill_s + row["seconds"]) * 1e3
    queue, encode, transfer = (timings.get(k, 0.0) * 1e3 for k in ("queue_s", "encode_s", "transfer_s"))
    handshake = max(0.0, total - queue - encode - transfer)
    encode_text = "cache" if timings.get("cache_hit") else f"{encode:.1f}"
    exact = {True: "yes", False: "NO", None: "-"}[row["verified"]]
    return (f"{item.index:<4d} {label:>13s} {item.content_hash & 0xFFFFFFFF:08x} "
            f"{row['rows']:>5d} x {row['width']:<4d} {row['transport']:>9s} {queue:6.1f} {encode_text:>6s} "
            f"{transfer:6.1f} {handshake:6.1f} {total:6.1f}  {exact}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: a small Qwen2.5-VL-"
                        "architecture tower with Qwen2.5-VL-7B's output width, built on first run and cached)")
    parser.add_argument("--dtype", default="float32", help="tower dtype (float32: this CPU runs small bf16 "
                        "towers ~5x slower)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from transformers import AutoImageProcessor

    print(INTRO)
    model = args.model or default_model()
    before = set(glob.glob("/dev/shm/epd-*"))
    cluster = LocalCluster(model, args.dtype)
    exact = False
    try:
        print(f"Starting the roles as separate processes on 127.0.0.1 (model {model}, {args.dtype}; "
              f"logs in {cluster.log_dir}):")
        roles = {"handshake": cluster.start_handshake(),
                 "encode-worker": cluster.start_encode_worker(),
                 "prefill-mooncake": cluster.start_prefill("prefill-mooncake", transports="mooncake"),
                 "prefill-shm": cluster.start_prefill("prefill-shm", transports="shm")}
        cluster.wait_ready()
        for name, role, what in (
                ("handshake", roles["handshake"], "epd-handshake: the rooms (one per image)"),
                ("encode-worker", roles["encode-worker"], "epd-encode-worker: intake, tower, send ring"),
                ("prefill-mooncake", roles["prefill-mooncake"], "epd-prefill: receives over Mooncake TCP only"),
                ("prefill-shm", roles["prefill-shm"], "epd-prefill: shares /dev/shm with the worker")):
            print(f"  {name:17s} pid {role.process.pid:<7d} {role.url:24s} {what}")
        exact = asyncio.run(_requests(cluster, roles, AutoImageProcessor.from_pretrained(model)))
        worker_url = roles["encode-worker"].url
        print("\nms: queue = intake until the tower took the item's batch; encode = the tower's time for that "
              "batch\n(cache = a repeated image, served from the worker's embedding cache); xfer = the write "
              "into the\nprefill process's memory; hshake = the rest: dispatch, rooms, commit checks; total = "
              "dispatch start\nuntil the rows were published in the prefill process. bit-exact = the rows equal "
              "the prefill\nprocess's own tower run on the same image bytes.")
        print(f"\nencode worker metrics: {_metric(worker_url, 'epd_encoder_cache_hits'):.0f} cache hits, "
              f"{_metric(worker_url, 'epd_encoder_bytes_total') / 1e6:.1f} MB delivered")
    finally:
        print("\nStopping every process (SIGTERM)...")
        codes = cluster.stop()
    time.sleep(0.2)
    left = set(glob.glob("/dev/shm/epd-*")) - before
    print("  exit codes: " + ", ".join(f"{name} {code}" for name, code in codes.items()))
    print(f"  SHM segments left behind: {len(left)}")
    ok = exact and not left and all(code == 0 for code in codes.values())
    print("\nDEMO OK" if ok else "\nDEMO FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
