"""`epd-bench cost`: CPU seconds per item in each process and thread, outside the tower.

Processes: one encode worker (one intra-op thread, so the tower's compute is all on the thread
that calls it: ``epd_encoder_encode_cpu_seconds``; its decode and preprocessing CPU is counted too:
``epd_encoder_preprocess_cpu_seconds``) and one reference prefill process (``epd-prefill``: the
receiver), started by ``bench.cluster``; the dispatcher (on a uvloop thread of its own, as in the
gateway) and ``concurrency`` closed-loop clients run here. For each configuration (images per
request x transport), a warm-up, then a steady run of ``seconds``: every process's and every
thread's CPU clock (``/proc/<pid>/task/<tid>/stat`` user + system, threads known by the names
``loop_threads.name_os_thread`` gives them) is read before and after, and divided by the items
delivered.

The control plane, which the goals count (``GOALS_MS``, per process, for 1-image and for
multi-image requests): the dispatcher's thread and ZMQ I/O thread, the encode worker without its
tower and without decoding and preprocessing, and the receiver's loop thread. Reported apart:
the decode + preprocessing and the tower (the media work itself), and the load's own work (the
clients' HTTP calls and the reference prefill server's HTTP API, which an engine replaces with
its own). The byte copies stay in (at these sizes they are small: a 112x112 image is 16 rows).
Images are distinct (no cache hits), ``size`` x ``size`` PNGs (or JPEGs or WebPs: ``image_format``).

``ceiling``: the worker runs ``bench.stand_in_worker`` (a tower that costs nothing, items that
need no decoding or preprocessing): items/s is then what the control plane sustains, against
``CEILING_GOAL`` items/s.
"""

from __future__ import annotations

import asyncio
import os
import time

from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.threads_cpu import delta, threads_cpu_s
from epdserve.testing.images import synthetic_image

# ms of CPU per item, by images per request (1, or several) and process
GOALS_MS = {
    "1": {"dispatcher": 0.2, "encode_worker": 0.4, "receiver": 0.25, "sum": 0.8},
    "many": {"dispatcher": 0.1, "encode_worker": 0.2, "receiver": 0.1, "sum": 0.4},
}
CEILING_GOAL = 3000  # items/s one worker sustains with the stand-in (ceiling)
DISPATCHER_THREAD = "dispatcher"
RECEIVER_THREAD = "prefill-receive"  # the receiver's loop thread ("prefill-receiver"), as the OS
# cuts it (15 bytes)
CONFIGS = ((1, "shm"), (8, "shm"), (1, "mooncake"), (8, "mooncake"))
POOL = 4096  # distinct images, cycled (the worker's cache is off)


async def _worker_cpu_s(session, url: str) -> dict[str, float]:
    """The worker's own counts: its tower's CPU and its decode + preprocessing CPU."""
    from epdserve.testing.cluster import metric_total

    counted = {}
    for key, name in (
        ("tower", "epd_encoder_encode_cpu_seconds_total"),
        ("preprocess", "epd_encoder_preprocess_cpu_seconds_total"),
    ):
        value = await metric_total(session, url, name)
        if value is None:
            raise RuntimeError(f"{url}/metrics has no {name}")
        counted[key] = value
    return counted


def measure(
    model: str,
    per_request: int,
    transport: str,
    pool: list[bytes],
    seconds: float,
    concurrency: int,
    ceiling: bool = False,
) -> dict:
    import aiohttp
    from transformers import AutoImageProcessor

    from epdserve.dispatcher import Dispatcher, WorkerSet
    from epdserve.dispatcher.cli import prefill_body
    from epdserve.loop_threads import LoopThread
    from epdserve.testing.cluster import LocalCluster

    one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    extra = ("--mooncake-force-tcp",) if transport == "mooncake" else ()
    with LocalCluster(model, "float32") as cluster:
        worker = cluster.start_encode_worker(
            "encode-worker",
            transports=transport,
            cache_bytes=0,
            extra=extra,
            env=one_thread,
            module="epdserve.bench.benchmarks.stand_in_worker" if ceiling else "encode_worker.cli",
        )
        prefill = cluster.start_prefill(transports=transport, extra=extra)
        cluster.wait_ready()
        # The dispatcher on a loop thread of its own (as in the gateway, a uvloop), so that its
        # CPU is measured apart from the clients' calls to the prefill process.
        dispatch_loop = LoopThread(DISPATCHER_THREAD)

        async def start_dispatcher():
            worker_set = WorkerSet([worker.worker])
            await worker_set.refresh()
            return worker_set, Dispatcher(worker_set, AutoImageProcessor.from_pretrained(model))

        worker_set, dispatcher = dispatch_loop.run(start_dispatcher())
        pids = {"dispatcher": os.getpid(), "encode_worker": worker.process.pid}
        pids["prefill"] = prefill.process.pid

        async def load() -> dict:
            counter = iter(range(1 << 30))
            delivered = failed = 0
            stop_at = 0.0

            async def client(session) -> None:
                nonlocal delivered, failed
                while time.monotonic() < stop_at:
                    index = next(counter)
                    first = index * per_request % len(pool)
                    images = [pool[(first + i) % len(pool)] for i in range(per_request)]
                    placed = await asyncio.wrap_future(
                        dispatch_loop.submit(dispatcher.dispatch(f"cost-{index}", images))
                    )
                    body = prefill_body(f"cost-{index}", placed, verify=False)
                    async with session.post(prefill.url + "/v1/prefill", json=body) as response:
                        report = await response.json()
                    done = sum(item["state"] == "DONE" for item in report["items"])
                    delivered += done
                    failed += per_request - done

            async with aiohttp.ClientSession() as session:
                stop_at = time.monotonic() + 2.0  # warm-up
                await asyncio.gather(*(client(session) for _ in range(concurrency)))
                delivered = failed = 0
                before = {role: threads_cpu_s(pid) for role, pid in pids.items()}
                counted_before = await _worker_cpu_s(session, worker.url)
                started = time.monotonic()
                stop_at = started + seconds
                await asyncio.gather(*(client(session) for _ in range(concurrency)))
                wall = time.monotonic() - started
                after = {role: threads_cpu_s(pid) for role, pid in pids.items()}
                counted = delta(await _worker_cpu_s(session, worker.url), counted_before)
            return {
                "cpu_s": {role: delta(after[role], before[role]) for role in pids},
                "worker_counted_cpu_s": counted,
                "delivered": delivered,
                "failed": failed,
                "wall_s": wall,
            }

        try:
            measured = asyncio.run(load())
        finally:
            dispatch_loop.run(dispatcher.close())
            dispatch_loop.run(worker_set.close())
            dispatch_loop.stop()
    return _per_item(measured, per_request, transport)


def _per_item(measured: dict, per_request: int, transport: str) -> dict:
    """ms of CPU per delivered item: each process's total, its threads, and the control plane
    (what the issue counts: the dispatcher's thread and ZMQ I/O, the encode worker without its
    tower and its decode + preprocessing, the receiver's loop thread)."""
    items = max(measured["delivered"], 1)
    cpu, counted = measured["cpu_s"], measured["worker_counted_cpu_s"]

    def ms(seconds: float) -> float:
        return seconds * 1e3 / items

    dispatcher = cpu["dispatcher"].get(DISPATCHER_THREAD, 0.0) + sum(
        seconds for name, seconds in cpu["dispatcher"].items() if name.startswith("ZMQbg")
    )
    worker_control = cpu["encode_worker"]["*"] - counted["tower"] - counted["preprocess"]
    receiver = cpu["prefill"].get(RECEIVER_THREAD, 0.0)
    control = {
        "dispatcher": ms(dispatcher),
        "encode_worker": ms(worker_control),
        "receiver": ms(receiver),
    }
    return {
        "images_per_request": per_request,
        "transport": transport,
        "items": measured["delivered"],
        "failed": measured["failed"],
        "items_per_s": measured["delivered"] / measured["wall_s"],
        "control_plane_ms_per_item": {**control, "sum": sum(control.values())},
        "tower_ms_per_item": ms(counted["tower"]),
        "preprocess_ms_per_item": ms(counted["preprocess"]),
        # the load's own work: the clients' HTTP calls here, the reference prefill server's API
        "harness_ms_per_item": {
            "clients": ms(cpu["dispatcher"]["*"] - dispatcher),
            "prefill_server": ms(cpu["prefill"]["*"] - receiver),
        },
        "process_ms_per_item": {role: ms(threads["*"]) for role, threads in cpu.items()},
        "thread_ms_per_item": {
            role: {name: ms(s) for name, s in sorted(threads.items()) if name != "*" and s > 0}
            for role, threads in cpu.items()
        },
    }


def run(
    size: int = 112,
    seconds: float = 10.0,
    concurrency: int = 4,
    configs=CONFIGS,
    progress=print,
    ceiling: bool = False,
    image_format: str = "PNG",
) -> dict:
    from epdserve.bench.benchmarks.towers import bench_tower

    model = bench_tower(depth=2, hidden=64, width=1024)
    # made before the clocks
    pool = [synthetic_image(size, size, seed, image_format) for seed in range(POOL)]
    rows = []
    for per_request, transport in configs:
        row = measure(model, per_request, transport, pool, seconds, concurrency, ceiling)
        row["goals_ms"] = goals_for(per_request)
        progress(
            f"  {per_request}-image requests over {transport}: "
            f"{row['control_plane_ms_per_item']['sum']:.2f} ms CPU per item in the control plane "
            f"({row['items']} items)"
        )
        rows.append(row)
    return {
        "size": size,
        "image_format": image_format,
        "seconds": seconds,
        "concurrency": concurrency,
        "tower": {"depth": 2, "hidden": 64, "out_width": 1024, "dtype": "float32"},
        "ceiling": ceiling,
        "configs": rows,
        "ceiling_goal_items_per_s": CEILING_GOAL if ceiling else None,
    }


def goals_for(per_request: int) -> dict[str, float]:
    return GOALS_MS["1" if per_request == 1 else "many"]


def unmet(row: dict) -> list[str]:
    """The processes (and the sum) over their goal in one configuration."""
    control = row["control_plane_ms_per_item"]
    return [
        name for name, goal in goals_for(row["images_per_request"]).items() if control[name] > goal
    ]


def main(args) -> int:
    configs = [
        (int(n), transport)
        for transport in args.transports.split(",")
        for n in args.images_per_request.split(",")
    ]
    print(
        f"epd-bench cost: {args.size}x{args.size} {args.image_format} images, "
        f"{args.concurrency} closed-loop clients,"
        f" {args.seconds:g} s per configuration"
        + (", the stand-in worker (no tower, no preprocessing cost)" if args.ceiling else "")
    )
    report = run(
        args.size,
        args.seconds,
        args.concurrency,
        configs,
        ceiling=args.ceiling,
        image_format=args.image_format,
    )
    print(
        "\nms of CPU per item. Control plane: dispatcher (its thread + ZMQ I/O), encode worker "
        "(without tower and preprocessing), receiver (its loop thread); then the rest"
    )
    print(
        f"{'images, transport':18s} {'items/s':>7s} {'dispatch':>8s} {'worker':>7s} "
        f"{'receiver':>8s} {'SUM':>6s} | {'preproc':>7s} {'tower':>6s} {'clients':>7s} "
        f"{'prefill API':>11s}"
    )
    for row in report["configs"]:
        control, harness = row["control_plane_ms_per_item"], row["harness_ms_per_item"]
        print(
            f"  {row['images_per_request']}, {row['transport']:13s} {row['items_per_s']:7.0f} "
            f"{control['dispatcher']:8.2f} {control['encode_worker']:7.2f} "
            f"{control['receiver']:8.2f} {control['sum']:6.2f} | "
            f"{row['preprocess_ms_per_item']:7.2f} {row['tower_ms_per_item']:6.2f} "
            f"{harness['clients']:7.2f} {harness['prefill_server']:11.2f}"
        )
    met = True
    for row in report["configs"]:
        over = unmet(row)
        met = met and not over
        goals = ", ".join(f"{name} <= {goal:g}" for name, goal in row["goals_ms"].items())
        print(
            f"  {row['images_per_request']}, {row['transport']}: goals {goals} ms: "
            + (f"NOT met ({', '.join(over)})" if over else "met")
        )
    if args.ceiling:
        slowest = min(row["items_per_s"] for row in report["configs"])
        met = met and slowest >= CEILING_GOAL
        print(
            f"  ceiling: {slowest:.0f} items/s at the slowest configuration (goal >= "
            f"{CEILING_GOAL}): {'met' if slowest >= CEILING_GOAL else 'NOT met'}"
        )
    write_json(args.json, report)
    return 0 if met else 1
