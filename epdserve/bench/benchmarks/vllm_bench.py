"""The request driving and timing of `epd-bench vllm`: `Bench` starts the servers and encode
workers of the paths asked for, sends each path's requests the way that path's producer and
consumer expect them (the gateway step and rooms for this project's connector, the producer call
then the consumer call for vLLM's connectors, a plain chat request for colocated), times them in
closed-loop batches with the servers' CPU time, and reads the delivery times from the servers'
traces; `run` drives the interleaved rounds and assembles the report.
"""

from __future__ import annotations

import asyncio
import base64
import json
import statistics
import sys
import tempfile
import time

from epdserve.bench.benchmarks.rounds import in_round
from epdserve.bench.benchmarks.vllm_report import _goal, _summary
from epdserve.testing.vllm_servers import (
    OURS,
    PATHS,
    SERVERS_OF,
    STAGED,
    TENSOR_PARALLEL,
    Server,
    _ec,
    _wait_healthy,
    consumer_of,
    producer_of,
)


def _content(part: dict) -> list:
    return [part, {"type": "text", "text": "Describe the picture."}]


async def _chat(
    session,
    server: Server,
    content: list,
    ec_transfer_params: dict | None = None,
    max_tokens: int = 1,
) -> dict:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    if ec_transfer_params is not None:
        body["ec_transfer_params"] = ec_transfer_params
    async with session.post(server.url + "/v1/chat/completions", json=body) as response:
        text = await response.text()
        if response.status != 200:
            raise RuntimeError(f"{server.name} answered {response.status}: {text[:300]}")
        return json.loads(text)


class Bench:
    def __init__(self, args, log_dir: str):
        from transformers import AutoImageProcessor

        from epdserve.testing.cluster import LocalCluster
        from epdserve.vision.vlm_checkpoints import cached_vlm
        from epdserve.wire.ec_params import identifier

        self.args, self.log_dir, self.identifier = args, log_dir, identifier
        self.model = cached_vlm("qwen2_5_vl", hidden=args.hidden, layers=args.layers)
        self.processor = AutoImageProcessor.from_pretrained(self.model)
        self.cluster = LocalCluster(
            self.model, dtype=args.dtype, log_dir=log_dir
        )  # the encode workers
        self.workers = {}  # path -> its encode worker
        self.servers: dict[str, Server] = {}
        self.unavailable: dict[str, str] = {}
        self.seed = 1000
        self.acks: dict[str, float] = {}  # EPD identifier -> wall time of the worker's intake ack
        self.staged = None  # a dispatcher.staged.StagedWatch, on the requests' loop

    def image(self, size: int) -> bytes:
        from epdserve.testing.images import synthetic_image

        self.seed += 1
        return synthetic_image(size, size, seed=self.seed)

    def start(self, paths: list[str]) -> None:
        args, model = self.args, self.model
        spawn = {}
        for server in {consumer_of(path) for path in paths if path in OURS or "colocated" in path}:
            spawn[server] = _ec(
                "TimedEPDConnector",
                "ec_consumer",
                ec_connector_extra_config={"pool_bytes": 512 << 20},
            )
        if "example" in paths:
            shared = tempfile.mkdtemp(prefix="ec-example-", dir=self.log_dir)
            extra = {"shared_storage_path": shared}
            spawn["example-producer"] = _ec(
                "TimedExampleConnector", "ec_producer", ec_connector_extra_config=extra
            )
            spawn["example-consumer"] = _ec(
                "TimedExampleConnector", "ec_consumer", ec_connector_extra_config=extra
            )
        if "mooncake-ec" in paths:
            from epdserve.testing.cluster import free_port

            self.mooncake_ports = {role: free_port() for role in ("producer", "consumer")}
            for role in ("producer", "consumer"):
                spawn[f"mooncake-{role}"] = _ec(
                    "TimedMooncakeConnector",
                    f"ec_{role}",
                    ec_buffer_device="cpu",
                    ec_ip="127.0.0.1",
                    ec_port=self.mooncake_ports[role],
                    ec_connector_extra_config={
                        "mooncake_protocol": "tcp",
                        "push_wait_timeout_s": 20,
                    },
                )
        if "cpu-ec" in paths:
            spawn["cpu-producer"] = _ec("ECCPUConnector", "ec_producer", module=None)
            spawn["cpu-consumer"] = _ec("ECCPUConnector", "ec_consumer", module=None)
        shm_paths = [path for path in ("epd-shm", STAGED, "epd-shm-tp2") if path in paths]
        if shm_paths:  # one worker for them all
            worker = self.cluster.start_encode_worker("worker-shm", transports="shm")
            self.workers.update({path: worker for path in shm_paths})
        if "epd-mooncake" in paths:
            self.workers["epd-mooncake"] = self.cluster.start_encode_worker(
                "worker-mooncake", transports="mooncake"
            )
        max_len = max(1024, 2 * max(args.sizes) ** 2 // (28 * 28) + 256)
        for name, config in spawn.items():
            # ECCPUConnector refuses the V1 model runner, which vLLM's CPU build picks by default
            env = {"VLLM_USE_V2_MODEL_RUNNER": "1"} if name.startswith("cpu-") else {}
            extra = ()
            ranks = TENSOR_PARALLEL.get(name, 1)
            if ranks > 1:  # vLLM's CPU ranks each bind their OpenMP threads to cores of their own
                env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(ranks)))
                extra = ("--tensor-parallel-size", str(ranks))
            self.servers[name] = Server(
                name, model, self.log_dir, config, args.dtype, max_len, env, extra
            )
        self.cluster.wait_ready()
        failed = _wait_healthy(list(self.servers.values()), timeout_s=600)
        for path in paths:
            why = [f"{name}: {failed[name]}" for name in SERVERS_OF[path] if name in failed]
            if why:
                self.unavailable[path] = "; ".join(why)

    def stop(self) -> dict:
        for server in self.servers.values():
            server.stop()
        return self.cluster.stop()

    async def request(self, path: str, session, dispatcher, size: int) -> tuple[float, str | None]:
        """One request; returns (seconds to the answer, the image's identifier where delivered)."""
        from epdserve.multimodal.hashing import hash_feature
        from epdserve.vision.sizing import image_grid

        image = self.image(size)
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        key = self.identifier(hash_feature(image))
        started, wall = time.monotonic(), time.time()
        if path in OURS:
            (item,) = await dispatcher[path].dispatch(f"{path}-{self.seed}", [image])
            if item.error:
                raise RuntimeError(f"dispatch failed: {item.error}")
            self.acks[key] = wall + item.dispatch_s
            if path == STAGED:
                ended = await self.staged.until_staged([item], 60)
                if ended:
                    raise RuntimeError(f"the worker failed the image: {ended}")
            part = {
                "type": "image_embeds",
                "image_embeds": {"image_grid_thw": list(item.grid_thw)},
                "uuid": key,
            }
            await _chat(
                session,
                self.servers[consumer_of(path)],
                _content(part),
                {"rooms": {key: item.encode_handshake.model_dump()}},
            )
        elif path.startswith("colocated"):
            await _chat(
                session,
                self.servers[consumer_of(path)],
                _content({"type": "image_url", "image_url": {"url": url}}),
            )
            key = None
        elif path == "example":
            answer = await _chat(
                session,
                self.servers["example-producer"],
                _content({"type": "image_url", "image_url": {"url": url}, "uuid": key}),
            )
            grid = answer["ec_transfer_params"][key]["metadata"]["image_grid_thw"]
            part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid}, "uuid": key}
            await _chat(session, self.servers["example-consumer"], _content(part))
        elif path == "mooncake-ec":
            grid = list(
                image_grid(self.processor, size, size)
            )  # as its proxy would: from the image's size
            items = [{"transfer_id": f"t-{self.seed}", "mm_hash": key}]
            part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid}, "uuid": key}
            consumer = asyncio.ensure_future(
                _chat(
                    session, self.servers["mooncake-consumer"], _content(part), {"ec_items": items}
                )
            )
            await _chat(
                session,
                self.servers["mooncake-producer"],
                _content({"type": "image_url", "image_url": {"url": url}, "uuid": key}),
                {
                    "consumer_zmq": f"tcp://127.0.0.1:{self.mooncake_ports['consumer']}",
                    "ec_items": items,
                },
            )
            await consumer
        else:
            raise ValueError(f"no request flow for {path}")
        return time.monotonic() - started, key

    async def batch(self, path: str, size: int, session, dispatcher, progress) -> dict:
        consumer, producer = consumer_of(path), producer_of(path)
        cpu_before = self.servers[consumer].cpu_seconds()
        producer_before = self.servers[producer].cpu_seconds() if producer else {}
        latencies, keys, todo = [], [], list(range(self.args.requests))

        async def client():
            while todo:
                todo.pop()
                seconds, key = await self.request(path, session, dispatcher, size)
                latencies.append(seconds)
                keys.append(key)
                progress.update(1)

        started = time.monotonic()
        await asyncio.gather(*(client() for _ in range(self.args.concurrency)))
        elapsed = time.monotonic() - started
        count = len(latencies)

        def per_image(server: Server, before: dict[str, float]) -> dict[str, float]:
            after = server.cpu_seconds()
            return {
                name: (seconds - before.get(name, 0.0)) / count * 1e3
                for name, seconds in after.items()
            }

        cpu = per_image(self.servers[consumer], cpu_before)
        producer_cpu = per_image(self.servers[producer], producer_before) if producer else None
        return {
            "path": path,
            "size": size,
            "requests": count,
            "ttft_ms": statistics.median(latencies) * 1e3,
            "throughput_rps": count / elapsed,
            "cpu_ms_per_image": sum(cpu.values()),
            "cpu_by_process": cpu,
            "producer_cpu_ms_per_image": sum(producer_cpu.values()) if producer_cpu else None,
            "keys": [key for key in keys if key],
        }

    def deliveries(self) -> dict[str, float]:
        """Seconds from 'embedding exists at its producer' to 'in vLLM's encoder cache', per
        identifier, from the servers' traces."""
        encoded, in_cache = {}, {}
        for server in self.servers.values():
            for event in server.events():
                if event["event"] == "in_cache":
                    in_cache.setdefault(event["id"], event["t"])
                elif event["event"] == "encoded":
                    encoded.setdefault(event["id"], event["t"])
                elif event["event"] == "received" and event["id"] in self.acks:
                    encoded.setdefault(
                        event["id"], self.acks[event["id"]] + event["queue_s"] + event["encode_s"]
                    )
        return {key: in_cache[key] - encoded[key] for key in in_cache if key in encoded}


def run(args) -> dict:
    from tqdm import tqdm

    from epdserve.dispatcher import Dispatcher, WorkerSet
    from epdserve.dispatcher.staged import StagedWatch

    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise SystemExit(
            f"epd-bench vllm: unknown paths {sorted(unknown)}; choose from {', '.join(PATHS)}"
        )
    log_dir = tempfile.mkdtemp(prefix="epd-bench-vllm-")
    bench = Bench(args, log_dir)
    raw: list[dict] = []
    try:
        print(f"epd-bench vllm: starting {', '.join(paths)} (logs in {log_dir})", flush=True)
        bench.start(paths)

        async def all_batches():
            import aiohttp

            dispatchers, worker_sets = {}, []
            bench.staged = StagedWatch(token=None)
            for path, worker in bench.workers.items():
                worker_set = WorkerSet([worker.worker])
                await worker_set.refresh()
                worker_sets.append(worker_set)
                dispatchers[path] = Dispatcher(worker_set, bench.processor)
            timeout = aiohttp.ClientTimeout(total=120)
            try:
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    for (
                        path
                    ) in paths:  # one untimed request each: a path that cannot serve is reported
                        if path in bench.unavailable:
                            continue
                        try:
                            await bench.request(path, session, dispatchers, min(args.sizes))
                        except Exception as exc:  # any failure: this path is out, with why
                            logs = "; ".join(
                                f"{name}: {bench.servers[name].log_tail(3)}"
                                for name in SERVERS_OF[path]
                            )
                            bench.unavailable[path] = (
                                f"first request failed: {type(exc).__name__}: {exc} ({logs})"
                            )
                    running = [p for p in paths if p not in bench.unavailable]
                    total = args.rounds * len(args.sizes) * len(running) * args.requests
                    with tqdm(
                        total=total, unit="req", desc="epd-bench vllm", file=sys.stderr
                    ) as progress:
                        for round_index in range(args.rounds):
                            order = in_round(running, round_index)
                            for size in args.sizes:
                                for path in order:
                                    row = await bench.batch(
                                        path, size, session, dispatchers, progress
                                    )
                                    row["round"] = round_index
                                    raw.append(row)
            finally:
                for dispatcher in dispatchers.values():
                    await dispatcher.close()
                for worker_set in worker_sets:
                    await worker_set.close()
                await bench.staged.close()

        asyncio.run(all_batches())
        deliveries = bench.deliveries()
    finally:
        codes = bench.stop()
    for row in raw:
        row["delivery_ms"] = [deliveries[k] * 1e3 for k in row["keys"] if k in deliveries] or None
    report = {
        "config": {
            "model": bench.model,
            "hidden": args.hidden,
            "layers": args.layers,
            "dtype": args.dtype,
            "sizes": args.sizes,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "paths": paths,
        },
        "unavailable": bench.unavailable,
        "summary": _summary(raw, args.sizes),
        "raw": raw,
        "exit_codes": codes,
    }
    report["goal"] = _goal(report["summary"], args.sizes)
    return report
