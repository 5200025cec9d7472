"""`epd-bench e2e`: multi-image requests through real processes, EPD against a colocated baseline.

Processes: one encode worker and one reference prefill process (`epd-prefill`, with the tower
loaded too); the dispatcher and the load generator run here. Configurations, each for
``seconds`` per round at a fixed number of concurrent clients (closed loop):

* ``epd``: the dispatcher places every image on the encode worker, which batches across
  requests and writes the rows into the prefill process (SHM or Mooncake TCP);
* ``colocated``: the prefill process runs its own tower on each request's images (one batch per
  request), as an engine without EPD does.

Equal inputs and tower concurrency on both sides: every request reaches the prefill process the
same way, its images in the body (as a gateway forwards them to the engine in both deployments;
only EPD's items carry a room), and the prefill process runs one tower call at a time
(``--tower-calls 1``), as the encode worker does (one encode thread). Rounds are interleaved (the
order reversed every other round) and each figure is the median over the rounds.

A request's latency runs from its start until every item's rows are published in the prefill
process (the point prefill could start). Per item, EPD's time splits into queue, encode, transfer
and the rest (dispatch, rooms, commit checks). Writes JSON (every round) and a PNG plot.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.rounds import in_round
from epdserve.testing.images import synthetic_image

SIDES = ("queue", "encode", "transfer", "handshake")
MODES = ("epd", "colocated")
WORKER_TOWER_CALLS = 1  # an encode worker runs its tower on one encode thread


async def _client(
    mode: str,
    dispatcher,
    session,
    prefill_url: str,
    images_per_request: int,
    pool: list[bytes],
    end: float,
    results: list,
    progress,
    next_index,
) -> None:
    from epdserve.dispatcher.cli import prefill_body

    while time.monotonic() < end:
        index = next_index()
        images = [
            pool[(index * images_per_request + i) % len(pool)] for i in range(images_per_request)
        ]
        request_id = f"{mode}-{images_per_request}-{index}"
        started = time.monotonic()
        # the same body either way: the images travel with the request; EPD's items also carry rooms
        items = (
            await dispatcher.dispatch(request_id, images)
            if mode == "epd"
            else dispatcher.describe(images)
        )
        body = prefill_body(request_id, items, verify=True)
        body["verify"] = False
        posted = time.monotonic()
        async with session.post(prefill_url + "/v1/prefill", json=body) as response:
            report = await response.json()
        latency = time.monotonic() - started
        split = {side: 0.0 for side in SIDES}
        for row in report["items"]:
            timings = row.get("encoder") or {}
            total = posted - started + row["seconds"]
            encode = timings.get("encode_s", 0.0) if mode == "epd" else row["seconds"]
            queue, transfer = timings.get("queue_s", 0.0), timings.get("transfer_s", 0.0)
            split["queue"] += queue
            split["encode"] += encode
            split["transfer"] += transfer
            split["handshake"] += max(0.0, total - queue - encode - transfer)
        results.append(
            {
                "latency_s": latency,
                "ok": report["state"] == "DONE",
                "split_s": {side: value / len(report["items"]) for side, value in split.items()},
            }
        )
        progress(1)


async def _run_config(
    mode: str,
    images_per_request: int,
    concurrency: int,
    seconds: float,
    roles: dict,
    dispatcher,
    pool: list[bytes],
    progress,
) -> dict:
    import aiohttp

    results: list[dict] = []
    counter = iter(range(1 << 62))
    end = time.monotonic() + seconds
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(
            *(
                _client(
                    mode,
                    dispatcher,
                    session,
                    roles["prefill"].url,
                    images_per_request,
                    pool,
                    end,
                    results,
                    progress,
                    lambda: next(counter),
                )
                for _ in range(concurrency)
            )
        )
    elapsed = time.monotonic() - started
    latencies = sorted(r["latency_s"] for r in results)
    done = sum(r["ok"] for r in results)
    return {
        "mode": mode,
        "images_per_request": images_per_request,
        "concurrency": concurrency,
        "requests": len(results),
        "failed": len(results) - done,
        "requests_per_s": done / elapsed,
        "images_per_s": done * images_per_request / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
        "split_ms": {
            side: statistics.mean(r["split_s"][side] for r in results) * 1e3 for side in SIDES
        },
    }


def run(
    images_per_request=(1, 8),
    size: int = 448,
    concurrency: int = 4,
    seconds: float = 5.0,
    rounds: int = 3,
    transport: str = "shm",
    cache: bool = False,
    model: str | None = None,
    dtype: str = "float32",
) -> dict:
    from tqdm import tqdm
    from transformers import AutoImageProcessor

    from epdserve.bench.benchmarks.towers import bench_tower
    from epdserve.dispatcher import Dispatcher, WorkerSet
    from epdserve.testing.cluster import LocalCluster

    model = model or bench_tower(depth=2, hidden=64, width=3584)  # Qwen2.5-VL-7B's row width
    distinct = 16 if cache else 4096  # with the cache on, images repeat: hits skip the tower
    pool = [synthetic_image(size, size, seed) for seed in range(min(distinct, 512))]
    if not cache:
        pool += [
            synthetic_image(size, size, seed) for seed in range(512, 640)
        ]  # unique within a run
    configs = [(mode, n) for n in images_per_request for mode in MODES]
    raw = []  # every configuration of every round
    with LocalCluster(model, dtype) as cluster:
        roles = {
            "worker": cluster.start_encode_worker(
                transports=transport, cache_bytes=(1 << 30) if cache else 0
            ),
            "prefill": cluster.start_prefill(
                transports=transport, extra=("--tower-calls", str(WORKER_TOWER_CALLS))
            ),
        }
        cluster.wait_ready()

        async def all_configs():
            workers = WorkerSet([roles["worker"].worker])
            await workers.refresh()
            dispatcher = Dispatcher(workers, AutoImageProcessor.from_pretrained(model))
            try:
                for mode in MODES:  # warm-up
                    await _run_config(mode, 1, 1, 2.0, roles, dispatcher, pool, lambda n: None)
                with tqdm(
                    total=rounds * len(configs) * seconds,
                    unit="s",
                    desc="epd-bench e2e",
                    bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}]",
                ) as bar:
                    for round_index in range(rounds):
                        for mode, n in in_round(configs, round_index):
                            bar.set_postfix_str(
                                f"round {round_index + 1}, {mode}, {n} image{'s' if n > 1 else ''}"
                                "/request"
                            )
                            started = time.monotonic()
                            row = await _run_config(
                                mode,
                                n,
                                concurrency,
                                seconds,
                                roles,
                                dispatcher,
                                pool,
                                lambda _: None,
                            )
                            raw.append({"round": round_index, **row})
                            bar.update(min(seconds, time.monotonic() - started))
            finally:
                await dispatcher.close()
                await workers.close()

        asyncio.run(all_configs())
    summary = [
        _median(mode, n, [r for r in raw if r["mode"] == mode and r["images_per_request"] == n])
        for mode, n in configs
    ]
    return {
        "size": size,
        "concurrency": concurrency,
        "seconds_per_round": seconds,
        "rounds": rounds,
        "transport": transport,
        "cache": cache,
        "model": model,
        "dtype": dtype,
        "tower_calls": {"encode_worker": WORKER_TOWER_CALLS, "colocated": WORKER_TOWER_CALLS},
        "configs": summary,
        "ratios": _ratios(raw, summary),
        "raw_rounds": raw,
    }


def _median(mode: str, n: int, rows: list[dict]) -> dict:
    """One configuration over its rounds: the median of each figure, failures summed."""

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "mode": mode,
        "images_per_request": n,
        "rounds": len(rows),
        "requests": sum(r["requests"] for r in rows),
        "failed": sum(r["failed"] for r in rows),
        "requests_per_s": med("requests_per_s"),
        "images_per_s": med("images_per_s"),
        "images_per_s_rounds": [r["images_per_s"] for r in rows],
        "p50_ms": med("p50_ms"),
        "p99_ms": med("p99_ms"),
        "split_ms": {side: statistics.median(r["split_ms"][side] for r in rows) for side in SIDES},
    }


def _ratios(raw: list[dict], summary: list[dict]) -> dict:
    """EPD over colocated per images-per-request: of the medians, and round by round."""
    ratios = {}
    for n in sorted({r["images_per_request"] for r in summary}):
        epd, colocated = (
            next(r for r in summary if r["mode"] == mode and r["images_per_request"] == n)
            for mode in MODES
        )
        rounds = sorted({r["round"] for r in raw})
        by_round = {(r["round"], r["mode"]): r for r in raw if r["images_per_request"] == n}
        ratios[f"{n}_image"] = {
            "throughput_epd_over_colocated": epd["images_per_s"] / colocated["images_per_s"],
            "p50_latency_epd_over_colocated": epd["p50_ms"] / colocated["p50_ms"],
            "throughput_epd_over_colocated_rounds": [
                by_round[(i, "epd")]["images_per_s"] / by_round[(i, "colocated")]["images_per_s"]
                for i in rounds
            ],
        }
    return ratios


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["configs"]
    labels = [f"{r['mode']}\n{r['images_per_request']} img/req" for r in runs]
    colors = ["#2b6cb0" if r["mode"] == "epd" else "#999999" for r in runs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    left.bar(labels, [r["images_per_s"] for r in runs], color=colors)
    for label, r in zip(labels, runs):
        left.scatter(
            [label] * len(r["images_per_s_rounds"]),
            r["images_per_s_rounds"],
            color="black",
            s=12,
            zorder=3,
        )
    left.set_ylabel("images / s (higher is better)")
    left.set_title(f"Throughput: median of {report['rounds']} rounds (dots: each round)")
    bottom = [0.0] * len(runs)
    palette = {
        "queue": "#f6ad55",
        "encode": "#2b6cb0",
        "transfer": "#38a169",
        "handshake": "#a0aec0",
    }
    for side in SIDES:
        values = [r["split_ms"][side] for r in runs]
        right.bar(labels, values, bottom=bottom, color=palette[side], label=side)
        bottom = [b + v for b, v in zip(bottom, values)]
    right.scatter(
        labels,
        [r["p50_ms"] for r in runs],
        color="black",
        marker="_",
        s=400,
        label="request p50",
        zorder=3,
    )
    right.set_ylabel("ms per item (mean), request p50 as a tick")
    right.set_title("Where an item's time goes")
    right.legend(fontsize=8)
    figure.suptitle(
        f"epd-bench e2e: {report['size']}x{report['size']} images, {report['concurrency']} "
        "clients, "
        f"{report['transport']}, cache {'on' if report['cache'] else 'off'} (2-core CPU host)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(args) -> int:
    counts = tuple(int(n) for n in args.images_per_request.split(","))
    print(
        f"epd-bench e2e: {counts} images per request, {args.size}x{args.size}, {args.concurrency} "
        "clients, "
        f"{args.rounds} rounds of {args.seconds:g} s per configuration, transport "
        f"{args.transport}, "
        f"cache {'on' if args.cache else 'off'}"
    )
    report = run(
        counts,
        args.size,
        args.concurrency,
        args.seconds,
        args.rounds,
        args.transport,
        args.cache,
        args.model,
        args.dtype,
    )
    print(
        f"\n{'mode':10s} {'img/req':>7s} {'req/s':>7s} {'img/s':>7s} {'p50 ms':>8s} "
        f"{'p99 ms':>8s}   "
        + " ".join(f"{side:>9s}" for side in SIDES)
        + "  (ms per item; medians of the rounds)  img/s per round"
    )
    for r in report["configs"]:
        print(
            f"{r['mode']:10s} {r['images_per_request']:7d} {r['requests_per_s']:7.1f} "
            f"{r['images_per_s']:7.1f} "
            f"{r['p50_ms']:8.1f} {r['p99_ms']:8.1f}   "
            + " ".join(f"{r['split_ms'][s]:9.1f}" for s in SIDES)
            + "  "
            + " ".join(f"{v:.1f}" for v in r["images_per_s_rounds"])
            + (f"  FAILED {r['failed']}" if r["failed"] else "")
        )
    for name, ratio in report["ratios"].items():
        rounds = " ".join(f"{v:.2f}" for v in ratio["throughput_epd_over_colocated_rounds"])
        print(
            f"{name}: EPD / colocated throughput {ratio['throughput_epd_over_colocated']:.2f} "
            f"(per round: {rounds}), "
            f"p50 latency {ratio['p50_latency_epd_over_colocated']:.2f}"
        )
    write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
        beside = os.path.splitext(args.plot)[0] + ".json"
        if beside != args.json:
            write_json(beside, report)
    return 0 if not any(r["failed"] for r in report["configs"]) else 1
