"""`epd-bench overload`: more items in flight than the towers can take, and nothing lost.

Processes: one encode worker (then two: ``workers`` phases, each a fresh cluster) and two
reference prefill processes (``epd-prefill``: receivers), started by ``bench.cluster``; the
dispatcher, the clients and the probes run here. All ``requests`` requests of
``images_per_request`` distinct images each start at once (so ``requests x images_per_request``
items are in flight, arriving faster than a worker's tower encodes them), in ``waves`` (the next
once the last has ended: the first meets a worker that has not measured its pace, the second one
that has); each is dispatched (the
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
Also per item, intake's predicted queue wait against the wait it had (items either way past
0.1 s).
Goals: 0 lost, every request's report within its deadline, handshake p99 <= 20 ms; at the
workers' own deadline (the burst fits it), 0 items refused busy and the predicted queue wait
within 1.5x of the actual at p50, 2x at p01 / p99.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections import Counter

from encode_worker.metrics import PREDICTION_FLOOR_S
from epdserve.bench.benchmarks.results import percentile, write_json
from epdserve.testing.images import synthetic_image

HANDSHAKE_P99_GOAL_S = 0.020
PREDICTION_P50_FACTOR, PREDICTION_P99_FACTOR = 1.5, 2.0  # intake's queue-wait estimate, either way
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
    waves: int = 1,
) -> dict:
    """``waves``: the burst sent again once the last has ended (the next wave meets a worker
    that measured its pace)."""
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

            async def request(session, wave: int, index: int) -> dict:
                started = time.monotonic()
                batch = images[index * images_per_request : (index + 1) * images_per_request]
                name = f"overload-{wave}-{index}"
                placed = await dispatcher.dispatch(name, batch)
                body = prefill_body(name, placed, verify=False)
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
                started, results, wave_s = time.monotonic(), [], []
                try:
                    for wave in range(waves):  # the next once the last has ended
                        wave_started = time.monotonic()
                        results += await asyncio.gather(
                            *(request(session, wave, index) for index in range(requests))
                        )
                        wave_s.append(time.monotonic() - wave_started)
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
                "wave_s": wave_s,
                "probe_s": probe_s,
                "rss": rss,
                "refused": refused,
            }

        measured = asyncio.run(load())
    return _summary(measured, workers, requests * waves, images_per_request, deadline_s)


def _summary(measured: dict, workers: int, requests: int, per_request: int, deadline: float):
    outcomes, reasons, lost, late = Counter(), Counter(), 0, 0
    ratios = []  # intake's predicted queue wait over the item's actual one
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
            ratio = _prediction_ratio(item.get("encoder"))
            if ratio is not None:
                ratios.append(ratio)
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
        "wave_s": measured["wave_s"],
        "outcomes": dict(outcomes),
        "failure_reasons": dict(reasons),
        "failure_examples": examples,
        "lost": lost,
        "reports_past_deadline": late,
        "intake_refusals": sum(measured["refused"]),
        "request_s": {
            "p50": percentile(request_s, 0.5),
            "p99": percentile(request_s, 0.99),
            "max": max(request_s) if request_s else None,
        },
        "handshake_probe_ms": {
            "count": len(probe),
            "p50": (percentile(probe, 0.5) or 0) * 1e3,
            "p99": (percentile(probe, 0.99) or 0) * 1e3,
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
        "queue_wait_prediction_ratio": {
            "items": len(ratios),
            "p01": percentile(ratios, 0.01),
            "p50": percentile(ratios, 0.5),
            "p99": percentile(ratios, 0.99),
        },
    }


def _prediction_ratio(encoder: dict | None) -> float | None:
    """Intake's predicted queue wait over the item's actual one, for an item where either is past
    the noise floor (the worker's ``epd_encoder_queue_wait_prediction_ratio`` alike)."""
    if not encoder or encoder.get("predicted_queue_s") is None:
        return None
    predicted, actual = encoder["predicted_queue_s"], encoder["queue_s"]
    if max(predicted, actual) < PREDICTION_FLOOR_S:
        return None
    return predicted / max(actual, 1e-3)


def _prediction_met(ratio: dict) -> bool:
    """Within the goal's factors either way: p50 within 1.5x, p01 and p99 within 2x."""
    if not ratio["items"]:
        return True
    p50_low, p50_high = 1 / PREDICTION_P50_FACTOR, PREDICTION_P50_FACTOR
    return (
        p50_low <= ratio["p50"] <= p50_high
        and ratio["p01"] >= 1 / PREDICTION_P99_FACTOR
        and ratio["p99"] <= PREDICTION_P99_FACTOR
    )


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
    waves: int = 2,
) -> dict:
    from epdserve.bench.benchmarks.towers import bench_tower

    # a deadline below the burst's: refusing busy is what is measured
    busy_expected = "--max-queue-wait-s" in worker_extra
    model = bench_tower(depth=2, hidden=64, width=1024)
    images = [synthetic_image(size, size, seed) for seed in range(requests * images_per_request)]
    phases = []
    for count in workers:
        progress(
            f"  {count} encode worker(s): {requests * images_per_request} items in flight, "
            f"{waves} wave(s)"
        )
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
            waves,
        )
        progress(
            f"    {result['outcomes']}, lost {result['lost']}, refusals "
            f"{result['intake_refusals']:.0f}, handshake p99 "
            f"{result['handshake_probe_ms']['p99']:.1f} ms"
        )
        phases.append(result)
    return {
        "size": size,
        "waves": waves,
        "tower": {"depth": 2, "hidden": 64, "out_width": 1024, "dtype": "float32"},
        "phases": phases,
        "goals": {
            "lost": "0 items lost",
            "deadline": "every report within its deadline",
            "handshake_p99_ms": HANDSHAKE_P99_GOAL_S * 1e3,
            "refused_busy": "0 items failed busy (the burst fits its deadline)",
            "queue_wait_prediction_ratio": f"p50 within {PREDICTION_P50_FACTOR}x, p01 / p99 "
            f"within {PREDICTION_P99_FACTOR}x",
        },
        "met": all(
            p["lost"] == 0
            and p["reports_past_deadline"] == 0
            and p["handshake_probe_ms"]["p99"] <= HANDSHAKE_P99_GOAL_S * 1e3
            and (
                busy_expected
                or (
                    p["failure_reasons"].get("busy", 0) == 0
                    and _prediction_met(p["queue_wait_prediction_ratio"])
                )
            )
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
        waves=args.waves,
    )
    for p in report["phases"]:
        request_s = "/".join(f"{p['request_s'][q]:.2f}" for q in ("p50", "p99", "max"))
        print(
            f"\n{p['workers']} worker(s): {p['items']} items in {p['seconds']:.1f} s (waves "
            f"{', '.join(f'{w:.1f}' for w in p['wave_s'])} s); outcomes "
            f"{p['outcomes']}; failure reasons {p['failure_reasons']}; lost {p['lost']}; "
            f"intake refusals {p['intake_refusals']:.0f}; request p50/p99/max "
            f"{request_s} s;"
            f" handshake probe p50/p99 {p['handshake_probe_ms']['p50']:.2f}/"
            f"{p['handshake_probe_ms']['p99']:.2f} ms ({p['handshake_probe_ms']['count']} probes);"
            f" delivered {p['delivered_items_per_s']:.0f} items/s"
        )
        ratio = p["queue_wait_prediction_ratio"]
        if ratio["items"]:
            print(
                f"  queue wait predicted / actual ({ratio['items']} items): p01 "
                f"{ratio['p01']:.2f}, p50 {ratio['p50']:.2f}, p99 {ratio['p99']:.2f}"
            )
        for name, rss in p["rss_mib"].items():
            print(
                f"  {name}: RSS {rss['start']:.0f} -> peak {rss['peak']:.0f} -> end "
                f"{rss['end']:.0f} MiB"
            )
    print(f"goals ({report['goals']}): {'met' if report['met'] else 'NOT met'}")
    write_json(args.json, report)
    return 0 if report["met"] else 1
