"""`epd-bench overload`: more items in flight than the towers can take, and nothing lost.

Processes: one encode worker (then two: ``workers`` phases, each a fresh cluster) and two
reference prefill processes (``epd-prefill``: receivers), started by ``bench.cluster``; the
dispatcher, the clients and the probes run here. All ``requests`` requests of
``images_per_request`` distinct images each start at once (so ``requests x images_per_request``
items are in flight, arriving faster than a worker's tower encodes them); each is dispatched (the
real ``Dispatcher``: a worker queues what its deadline allows and refuses the rest busy, saying
when to retry; the dispatcher retries within its intake timeout, then fails the item and comes
back without a room), then posted to a prefill process (alternating) with ``deadline_s``. The
prefill processes' pools hold the burst (slots of one item's rows).

Per item, the outcome: DONE, or FAILED with the reason the prefill process reports, or, for an
item the dispatcher could not place (no room: the prefill side skips it), with the dispatcher's
reason (the gateway would send it to the engine inline). An item is
**lost** when its request got no report (the prefill call did not answer within the deadline
plus a margin: it hung) or its report has no reason for a failure. Also measured: intake
refusals (the workers' ``epd_encoder_intake_total{result="refused"}``), the time from a
request's start to its report, the handshake's latency under the load (a probe in a process of
its own mints and cancels one room at a worker's room API every ``probe_interval_s``; p50 / p99
of the mint), and each process's resident memory (sampled from
/proc with each probe; start, peak, end).
Goals: 0 lost, every request's report within its deadline, handshake p99 <= 20 ms.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections import Counter

from epdserve.bench.benchmarks.results import write_json
from epdserve.testing.images import synthetic_image

HANDSHAKE_P99_GOAL_S = 0.020
MARGIN_S = 15.0  # past its deadline, a prefill call that has not answered counts as hung
PREFILL_SLOT_BYTES = 256 << 10  # one 224x224 item's rows (64 x 1024 float32)


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def probe_handshake(url: str, interval_s: float, stop, results) -> None:
    """In a process of its own: mint and cancel one room at the room API at ``url`` every
    ``interval_s`` until ``stop`` is set; puts ``"probing"`` on ``results`` once started, then the
    mints' latencies (seconds)."""
    from epdserve.wire.room_client import HandshakeClient

    async def probing() -> list[float]:
        probe = HandshakeClient(url, None, timeout_s=5.0, retries=0)
        samples: list[float] = []
        try:
            results.put("probing")
            while not stop.is_set():
                started = time.monotonic()
                (room,) = await probe.mint(1, 30)
                samples.append(time.monotonic() - started)
                await probe.cancel([room], "probe")
                await asyncio.sleep(interval_s)
        finally:
            await probe.close()
        return samples

    results.put(asyncio.run(probing()))


def phase(
    model: str,
    workers: int,
    images: list[bytes],
    requests: int,
    images_per_request: int,
    deadline_s: float,
    probe_interval_s: float,
    worker_extra: tuple[str, ...] = (),
    progress=print,
) -> dict:
    import aiohttp
    from transformers import AutoImageProcessor

    from epdserve.dispatcher import Dispatcher, WorkerSet
    from epdserve.dispatcher.cli import prefill_body
    from epdserve.testing.cluster import LocalCluster, metric_total

    with LocalCluster(model, "float32") as cluster:
        encode = [
            cluster.start_encode_worker(
                f"encode-worker-{i}", transports="shm", cache_bytes=0, extra=worker_extra
            )
            for i in range(workers)
        ]
        # Each request holds its items' slots until all its items are in, so a pool must hold
        # the burst's half: slots of one item's rows (224x224: 256 KiB), not the 1 MiB default,
        # else the receivers refuse ("cannot reserve") what the encode tier would serve.
        prefills = [
            cluster.start_prefill(
                f"prefill-{i}", transports="shm", extra=("--slot-bytes", str(PREFILL_SLOT_BYTES))
            )
            for i in (0, 1)
        ]
        cluster.wait_ready()
        roles = encode + prefills

        async def load() -> dict:
            worker_set = WorkerSet([role.worker for role in encode])
            await worker_set.refresh()
            dispatcher = Dispatcher(worker_set, AutoImageProcessor.from_pretrained(model))
            rss = {role.name: [_rss_bytes(role.process.pid)] for role in roles}
            stop = threading.Event()

            def sample_memory() -> None:
                while not stop.wait(probe_interval_s):
                    for role in roles:
                        rss[role.name].append(_rss_bytes(role.process.pid))

            sampler = threading.Thread(target=sample_memory, daemon=True)
            # the probe in a process of its own: in this one it would wait for the interpreter
            # lock behind the clients and the dispatcher, and time that instead of the handshake
            spawn = multiprocessing.get_context("spawn")
            probe_stop, probe_results = spawn.Event(), spawn.Queue()
            prober = spawn.Process(
                target=probe_handshake,
                args=(encode[0].url, probe_interval_s, probe_stop, probe_results),
                daemon=True,
            )

            async def request(session, index: int) -> dict:
                started = time.monotonic()
                batch = images[index * images_per_request : (index + 1) * images_per_request]
                placed = await dispatcher.dispatch(f"overload-{index}", batch)
                body = prefill_body(f"overload-{index}", placed, verify=False)
                body["timeout_s"] = deadline_s
                url = prefills[index % 2].url + "/v1/prefill"
                try:
                    async with session.post(
                        url, json=body, timeout=aiohttp.ClientTimeout(total=deadline_s + MARGIN_S)
                    ) as response:
                        report = await response.json()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    report = {"hung": f"{type(exc).__name__}: {exc}"}
                return {
                    "seconds": time.monotonic() - started,
                    "report": report,
                    # an item no worker took comes back without a room: the dispatcher's reason
                    "dispatch_errors": [
                        item.error if item.worker is None else None for item in placed
                    ],
                }

            prober.start()
            if probe_results.get(timeout=120) != "probing":  # it imports first: wait for it
                raise RuntimeError("the handshake probe did not start")
            sampler.start()
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                started = time.monotonic()
                try:
                    results = await asyncio.gather(
                        *(request(session, index) for index in range(requests))
                    )
                finally:
                    seconds = time.monotonic() - started
                    stop.set()
                    probe_stop.set()
                    probe_s = probe_results.get(timeout=30)
                    prober.join(30)
                    sampler.join(30)
                    refused = [
                        await metric_total(
                            session, role.url, "epd_encoder_intake_total", result="refused"
                        )
                        or 0.0
                        for role in encode
                    ]
                    await dispatcher.close()
                    await worker_set.close()
            for role in roles:
                rss[role.name].append(_rss_bytes(role.process.pid))
            return {
                "results": results,
                "seconds": seconds,
                "probe_s": probe_s,
                "rss": rss,
                "refused": refused,
            }

        measured = asyncio.run(load())
    return _summary(measured, workers, requests, images_per_request, deadline_s)


def _summary(measured: dict, workers: int, requests: int, per_request: int, deadline: float):
    outcomes, reasons, lost, late = Counter(), Counter(), 0, 0
    examples: dict[str, str] = {}  # one reason as reported, per class
    for result in measured["results"]:
        report = result["report"]
        items = report.get("items") if isinstance(report, dict) else None
        if not items or len(items) != per_request:
            lost += per_request
            continue
        late += result["seconds"] > deadline + MARGIN_S
        for item, dispatch_error in zip(items, result["dispatch_errors"]):
            state, reason = item.get("state"), item.get("reason")
            if dispatch_error is not None:  # not placed: the prefill side skipped it (no room)
                state, reason = "FAILED", dispatch_error
            outcomes[state] += 1
            if state != "DONE":
                if not reason:
                    lost += 1
                kind = _reason_class(reason or "")
                reasons[kind] += 1
                examples.setdefault(kind, reason or "")
    request_s = [r["seconds"] for r in measured["results"]]
    probe = measured["probe_s"]
    return {
        "workers": workers,
        "requests": requests,
        "images_per_request": per_request,
        "items": requests * per_request,
        "deadline_s": deadline,
        "seconds": measured["seconds"],
        "outcomes": dict(outcomes),
        "failure_reasons": dict(reasons),
        "failure_examples": examples,
        "lost": lost,
        "reports_past_deadline": late,
        "intake_refusals": sum(measured["refused"]),
        "request_s": {
            "p50": _percentile(request_s, 0.5),
            "p99": _percentile(request_s, 0.99),
            "max": max(request_s) if request_s else None,
        },
        "handshake_probe_ms": {
            "count": len(probe),
            "p50": (_percentile(probe, 0.5) or 0) * 1e3,
            "p99": (_percentile(probe, 0.99) or 0) * 1e3,
            "max": max(probe) * 1e3 if probe else None,
        },
        "rss_mib": {
            name: {
                "start": samples[0] / 2**20,
                "peak": max(s for s in samples if s) / 2**20,
                "end": samples[-1] / 2**20,
            }
            for name, samples in measured["rss"].items()
            if samples and samples[0] and samples[-1]
        },
        "delivered_items_per_s": outcomes.get("DONE", 0) / measured["seconds"],
    }


def _reason_class(reason: str) -> str:
    """A failure reason without its item-specific parts (rooms, addresses, numbers)."""
    lowered = reason.lower()
    for known in (
        "queue full",
        "busy",
        "no healthy encode worker",
        "cancelled",
        "expired",
        "timed out",
        "pool",
    ):
        if known in lowered:
            return known
    return reason[:80]


def run(
    requests: int = 200,
    images_per_request: int = 10,
    workers: tuple[int, ...] = (1, 2),
    size: int = 224,
    deadline_s: float = 60.0,
    probe_interval_s: float = 0.02,
    worker_extra: tuple[str, ...] = (),
    progress=print,
) -> dict:
    from epdserve.bench.benchmarks.towers import bench_tower

    model = bench_tower(depth=2, hidden=64, width=1024)
    images = [synthetic_image(size, size, seed) for seed in range(requests * images_per_request)]
    phases = []
    for count in workers:
        progress(f"  {count} encode worker(s): {requests * images_per_request} items in flight")
        result = phase(
            model,
            count,
            images,
            requests,
            images_per_request,
            deadline_s,
            probe_interval_s,
            worker_extra,
            progress,
        )
        progress(
            f"    {result['outcomes']}, lost {result['lost']}, refusals "
            f"{result['intake_refusals']:.0f}, handshake p99 "
            f"{result['handshake_probe_ms']['p99']:.1f} ms"
        )
        phases.append(result)
    return {
        "size": size,
        "tower": {"depth": 2, "hidden": 64, "out_width": 1024, "dtype": "float32"},
        "phases": phases,
        "goals": {
            "lost": "0 items lost",
            "deadline": "every report within its deadline",
            "handshake_p99_ms": HANDSHAKE_P99_GOAL_S * 1e3,
        },
        "met": all(
            p["lost"] == 0
            and p["reports_past_deadline"] == 0
            and p["handshake_probe_ms"]["p99"] <= HANDSHAKE_P99_GOAL_S * 1e3
            for p in phases
        ),
    }


def main(args) -> int:
    workers = tuple(int(n) for n in args.workers.split(","))
    print(
        f"epd-bench overload: {args.requests} requests x {args.images_per_request} images "
        f"({args.size}x{args.size}) at once, encode workers {workers}, two prefill processes"
    )
    extra = ()
    if args.max_queue_wait_s is not None:
        extra = ("--max-queue-wait-s", str(args.max_queue_wait_s))
    report = run(
        args.requests,
        args.images_per_request,
        workers,
        args.size,
        args.deadline_s,
        worker_extra=extra,
    )
    for p in report["phases"]:
        request_s = "/".join(f"{p['request_s'][q]:.2f}" for q in ("p50", "p99", "max"))
        print(
            f"\n{p['workers']} worker(s): {p['items']} items in {p['seconds']:.1f} s; outcomes "
            f"{p['outcomes']}; failure reasons {p['failure_reasons']}; lost {p['lost']}; "
            f"intake refusals {p['intake_refusals']:.0f}; request p50/p99/max "
            f"{request_s} s;"
            f" handshake probe p50/p99 {p['handshake_probe_ms']['p50']:.2f}/"
            f"{p['handshake_probe_ms']['p99']:.2f} ms ({p['handshake_probe_ms']['count']} probes);"
            f" delivered {p['delivered_items_per_s']:.0f} items/s"
        )
        for name, rss in p["rss_mib"].items():
            print(
                f"  {name}: RSS {rss['start']:.0f} -> peak {rss['peak']:.0f} -> end "
                f"{rss['end']:.0f} MiB"
            )
    print(f"goals ({report['goals']}): {'met' if report['met'] else 'NOT met'}")
    write_json(args.json, report)
    return 0 if report["met"] else 1
