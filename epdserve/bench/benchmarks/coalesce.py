"""`epd-bench coalesce`: Zipf-distributed images through the dispatcher into two encode workers;
how many images their towers encode against how many distinct images were sent.

Processes: two encode workers (embedding cache on) and one reference prefill process (the
receiver); the dispatcher and ``concurrency`` closed-loop clients run here. Each request carries
one image drawn from a catalogue of ``catalogue`` synthetic images by a Zipf law of exponent
``alpha`` (rank r drawn with probability proportional to r^-alpha; seeded), dispatched (the hash
ring sends one image to one worker) and received by the prefill process. Identical images
arrive while the first is still queued or in the tower: without coalescing each would be
encoded; with it, and the cache behind it, each distinct image is encoded once.

The figure: items through the towers (the workers' ``epd_encoder_batch_items`` sums) / distinct
images sent; goal <= 1.01. Also reported: the workers' cache hits and coalesced items, requests
that failed, and throughput. Exit status 1 when the goal is missed or any request failed.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from epdserve.bench.benchmarks.results import write_json
from epdserve.testing.images import synthetic_image

GOAL = 1.01


def zipf_draws(items: int, catalogue: int, alpha: float, seed: int) -> list[int]:
    """``items`` catalogue indices, rank r (from 1) drawn with probability ~ r^-alpha."""
    weights = np.arange(1, catalogue + 1, dtype=np.float64) ** -alpha
    rng = np.random.default_rng(seed)
    return rng.choice(catalogue, size=items, p=weights / weights.sum()).tolist()


async def _worker_counts(session, url: str) -> dict[str, float]:
    """A worker's tower items, cache hits and coalesced items, from its /metrics."""
    from epdserve.testing.cluster import metric_total

    wanted = {
        "epd_encoder_batch_items_sum": "tower_items",
        "epd_encoder_cache_hits_total": "cache_hits",
        "epd_encoder_coalesced_items_total": "coalesced",
    }
    counts = {}
    for name, key in wanted.items():
        value = await metric_total(session, url, name)
        if value is not None:
            counts[key] = value
    return counts


def run(
    items: int = 10_000,
    catalogue: int = 2_000,
    alpha: float = 1.0,
    concurrency: int = 64,
    size: int = 112,
    seed: int = 0,
    progress=print,
) -> dict:
    import aiohttp
    from transformers import AutoImageProcessor

    from epdserve.bench.benchmarks.towers import bench_tower
    from epdserve.dispatcher import Dispatcher, WorkerSet
    from epdserve.dispatcher.cli import prefill_body
    from epdserve.testing.cluster import LocalCluster

    model = bench_tower(depth=2, hidden=64, width=3584)
    draws = zipf_draws(items, catalogue, alpha, seed)
    pool = {index: synthetic_image(size, size, index) for index in set(draws)}
    with LocalCluster(model, "float32") as cluster:
        workers = [
            cluster.start_encode_worker(f"encode-worker-{i}", transports="shm") for i in (0, 1)
        ]
        prefill = cluster.start_prefill(transports="shm")
        cluster.wait_ready()

        async def load() -> dict:
            worker_set = WorkerSet([role.worker for role in workers])
            await worker_set.refresh()
            dispatcher = Dispatcher(worker_set, AutoImageProcessor.from_pretrained(model))
            failed, next_draw = [], iter(enumerate(draws))

            async def client(session) -> None:
                for request_index, image_index in next_draw:
                    request_id = f"zipf-{request_index}"
                    placed = await dispatcher.dispatch(request_id, [pool[image_index]])
                    body = prefill_body(request_id, placed, verify=False)
                    async with session.post(prefill.url + "/v1/prefill", json=body) as response:
                        report = await response.json()
                    if report.get("state") != "DONE":
                        failed.append({"request": request_id, "report": report.get("items")})
                    if request_index % 1000 == 999:
                        progress(f"  {request_index + 1} requests")

            try:
                async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=concurrency)
                ) as session:
                    started = time.monotonic()
                    await asyncio.gather(*(client(session) for _ in range(concurrency)))
                    seconds = time.monotonic() - started
                    per_worker = [await _worker_counts(session, role.url) for role in workers]
            finally:
                await dispatcher.close()
                await worker_set.close()
            return {"seconds": seconds, "failed": failed, "per_worker": per_worker}

        measured = asyncio.run(load())
    distinct = len(set(draws))
    tower_items = sum(w.get("tower_items", 0) for w in measured["per_worker"])
    return {
        "items": items,
        "catalogue": catalogue,
        "alpha": alpha,
        "concurrency": concurrency,
        "size": size,
        "seed": seed,
        "distinct_images": distinct,
        "tower_items": tower_items,
        "tower_items_per_distinct_image": tower_items / distinct,
        "cache_hits": sum(w.get("cache_hits", 0) for w in measured["per_worker"]),
        "coalesced": sum(w.get("coalesced", 0) for w in measured["per_worker"]),
        "per_worker": measured["per_worker"],
        "failed_requests": len(measured["failed"]),
        "failures": measured["failed"][:20],
        "seconds": measured["seconds"],
        "requests_per_s": items / measured["seconds"],
        "goal": f"tower items <= {GOAL} x distinct images",
    }


def main(args) -> int:
    print(
        f"epd-bench coalesce: {args.items} one-image requests, Zipf alpha {args.alpha} over "
        f"{args.catalogue} images ({args.size}x{args.size}), {args.concurrency} concurrent, "
        "two encode workers"
    )
    report = run(args.items, args.catalogue, args.alpha, args.concurrency, args.size, args.seed)
    ratio = report["tower_items_per_distinct_image"]
    print(
        f"distinct images {report['distinct_images']}, tower items {report['tower_items']:.0f} "
        f"({ratio:.3f}x), cache hits {report['cache_hits']:.0f}, coalesced "
        f"{report['coalesced']:.0f}, failed requests {report['failed_requests']}, "
        f"{report['requests_per_s']:.0f} requests/s"
    )
    met = ratio <= GOAL and not report["failed_requests"]
    print(f"{report['goal']}: {'met' if met else 'NOT met'}")
    write_json(args.json, report)
    return 0 if met else 1
