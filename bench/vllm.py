"""`epd-bench vllm`: the same vLLM model, images and request mix through every way of getting an
image's embedding into vLLM's encoder cache, side by side, in interleaved rounds.

Paths (each a real vLLM OpenAI server on this machine, built from `vision.vlm_checkpoints`):

* ``epd-shm`` / ``epd-mooncake``: this project's connector (`EPDConnector`); an encode worker
  process offering only SHM, or only Mooncake (TCP), writes each image's rows into the engine's
  receive pool. The gateway step (hash, room, intake) runs here, then the chat request goes with
  the image's grid alone.
* ``example``: vLLM's `ECExampleConnector`: an encoder-only vLLM producer writes each embedding
  to a shared directory (safetensors), the consumer reads it.
* ``mooncake-ec``: vLLM's `ECMooncakeConnector` (producer pushes into the consumer over Mooncake
  TCP, ``ec_buffer_device: cpu``), the producer and consumer requests sent as its proxy does.
* ``cpu-ec``: vLLM's `ECCPUConnector`.
* ``colocated``: vLLM's own tower on the image (the EPD engine, requests without rooms).

A path whose servers cannot start or whose first request fails is reported as unavailable with
the reason (the server's last log lines), and the rest run on.

Per request: one image of the configured size, a fresh one each time (distinct content, so no
cache anywhere serves a repeat), ``max_tokens`` 1. TTFT: from the request's start at the gateway
(before hashing / the producer call) to the response. Throughput: requests per second at
``--concurrency`` clients. Delivery per item: from the moment the embedding exists at its
producer to the moment the consumer's model runner has it in vLLM's encoder cache (wall clock,
one machine): for vLLM's connectors from the producer's ``save_caches`` call to the consumer's
``start_load_caches`` having written the entry; for the EPD connector from the end of the encode
worker's tower batch (the dispatcher's intake acknowledgement + the worker's reported queue and
encode time) to the same point. CPU per image: CPU seconds of the consumer server's processes
(API server, engine core) per request, EPD against colocated on the very same server; producers'
CPU separately. Rounds are interleaved (path order reversed every other round); figures are
medians over rounds. Writes JSON (every batch) and a PNG plot.
"""

from __future__ import annotations

import asyncio
import base64
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench.results import write_json
from bench.rounds import in_round

TRACE_ENV = "EPD_BENCH_VLLM_TRACE"  # a server's connector appends its events here (JSON lines)
PATHS = ("epd-shm", "epd-mooncake", "example", "mooncake-ec", "cpu-ec", "colocated")
OURS = ("epd-shm", "epd-mooncake")
SERVERS_OF = {
    "epd-shm": ["epd"],
    "epd-mooncake": ["epd"],
    "colocated": ["epd"],
    "example": ["example-producer", "example-consumer"],
    "mooncake-ec": ["mooncake-producer", "mooncake-consumer"],
    "cpu-ec": ["cpu-producer", "cpu-consumer"],
}


def _trace(event: str, identifier: str, **fields) -> None:
    """One event of this process's connector, appended as a JSON line (one write: atomic)."""
    path = os.environ.get(TRACE_ENV)
    if path:
        line = json.dumps(
            {"event": event, "id": identifier, "t": time.time(), "pid": os.getpid(), **fields}
        )
        with open(path, "a") as f:
            f.write(line + "\n")


def _traced_loads(load):
    """``start_load_caches`` that traces each identifier it put into the encoder cache."""

    def start_load_caches(self, encoder_cache, **kwargs):
        before = set(encoder_cache)
        load(self, encoder_cache, **kwargs)
        for identifier in set(encoder_cache) - before:
            _trace("in_cache", identifier)

    return start_load_caches


def _traced_saves(save):
    """``save_caches`` that traces the moment a producer has the embedding (before it stores it)."""

    def save_caches(self, encoder_cache, mm_hash, **kwargs):
        _trace("encoded", mm_hash)
        save(self, encoder_cache, mm_hash, **kwargs)

    return save_caches


# ---- the timed connectors the servers load (ec_connector_module_path = "bench.vllm") --------
# Defined lazily: importing vLLM is seconds, and `epd-bench` imports this module for its parser.


def __getattr__(name: str):
    if name == "TimedEPDConnector":
        from prefill_side.vllm_connector import EPDConnector

        class TimedEPDConnector(EPDConnector):
            """Also traces, per item received, the encode worker's split from its commit."""

            start_load_caches = _traced_loads(EPDConnector.start_load_caches)

            def __init__(self, vllm_config, role):
                super().__init__(vllm_config, role)
                self.traced: set[str] = set()  # request ids whose items were traced

            def ensure_cache_available(self, request, num_computed_tokens):
                ready = super().ensure_cache_available(request, num_computed_tokens)
                received = self._scheduler.requests.get(request.request_id)
                if ready and received is not None and request.request_id not in self.traced:
                    self.traced.add(request.request_id)
                    for identifier, index in received.slots.items():
                        outcome = received.job.outcomes[index]
                        if outcome.encoder is not None:
                            _trace("received", identifier, **outcome.encoder.model_dump())
                return ready

        return TimedEPDConnector
    if name == "TimedExampleConnector":
        from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

        return type(
            "TimedExampleConnector",
            (ECExampleConnector,),
            {
                "start_load_caches": _traced_loads(ECExampleConnector.start_load_caches),
                "save_caches": _traced_saves(ECExampleConnector.save_caches),
            },
        )
    if name == "TimedMooncakeConnector":
        from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector import (
            ECMooncakeConnector,
        )

        return type(
            "TimedMooncakeConnector",
            (ECMooncakeConnector,),
            {
                "start_load_caches": _traced_loads(ECMooncakeConnector.start_load_caches),
                "save_caches": _traced_saves(ECMooncakeConnector.save_caches),
            },
        )
    raise AttributeError(name)


# ---- servers ----------------------------------------------------------------------------------


class Server:
    """One vLLM OpenAI server process (and its engine processes), logging to a file."""

    def __init__(
        self,
        name: str,
        model: str,
        log_dir: str,
        ec_config: dict | None,
        dtype: str,
        max_model_len: int,
        env: dict | None = None,
        extra: tuple[str, ...] = (),
        images_per_prompt: int = 1,
    ):
        from bench.cluster import free_port

        self.name, self.model, self.port = name, model, free_port()
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.trace_path = os.path.join(log_dir, f"{name}.trace")
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            dtype,
            "--enforce-eager",
            "--max-model-len",
            str(max_model_len),
            "--limit-mm-per-prompt",
            json.dumps({"image": images_per_prompt, "video": 1}),
            *extra,
        ]
        if ec_config is not None:
            command += ["--ec-transfer-config", json.dumps(ec_config)]
        env = {
            **os.environ,
            TRACE_ENV: self.trace_path,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
            "MC_LOG_LEVEL": "ERROR",
            **(env or {}),
        }
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode}: {self.log_tail()}"
            )
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 6) -> str:
        with open(self.log_path, errors="replace") as f:
            kept = [
                line.strip()
                for line in f
                if any(word in line for word in ("Error", "error", "raise", "fail"))
                and "ulimit" not in line
            ]  # vLLM's start-up warning about the fd limit says "failed"
        return " | ".join(kept[-lines:]) or "(no error in its log)"

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) so far of each process of the server, by process name (the
        API server's, vLLM's ``VLLM::EngineCore``, ...)."""
        return cpu_seconds({self.process.pid, *descendants(self.process.pid)})

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def events(self) -> list[dict]:
        if not os.path.exists(self.trace_path):
            return []
        with open(self.trace_path) as f:
            return [json.loads(line) for line in f]


def cpu_seconds(pids) -> dict[str, float]:
    """CPU time (user + system) so far of these processes, summed by process name (from /proc)."""
    by_name: dict[str, float] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                name, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
        except OSError:  # ended meanwhile
            continue
        fields = rest.split()
        by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf(
            "SC_CLK_TCK"
        )
    return by_name


def descendants(root: int) -> set[int]:
    """The processes under ``root``, now (from /proc)."""
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                parents[int(stat.split("/")[2])] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:  # the process ended while we listed
            continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _wait_healthy(servers: list[Server], timeout_s: float) -> dict[str, str]:
    """Until every server answers /health; the ones that exit or time out, with why."""
    failed, waiting = {}, list(servers)
    end = time.monotonic() + timeout_s
    while waiting:
        for server in list(waiting):
            try:
                if server.healthy():
                    waiting.remove(server)
            except RuntimeError as exc:
                failed[server.name] = str(exc)
                waiting.remove(server)
        if waiting and time.monotonic() > end:
            for server in waiting:
                failed[server.name] = f"not healthy within {timeout_s:.0f} s: {server.log_tail()}"
            break
        time.sleep(0.5)
    return failed


def _ec(connector: str, role: str, module: str | None = "bench.vllm", **fields) -> dict:
    config = {"ec_connector": connector, "ec_role": role, **fields}
    if module:
        config["ec_connector_module_path"] = module
    return config


# ---- requests -----------------------------------------------------------------------------------


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

        from bench.cluster import LocalCluster
        from vision.vlm_checkpoints import cached_vlm
        from wire.ec_params import identifier

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

    def image(self, size: int) -> bytes:
        from bench.images import synthetic_image

        self.seed += 1
        return synthetic_image(size, size, seed=self.seed)

    def start(self, paths: list[str]) -> None:
        args, model = self.args, self.model
        spawn = {}
        if set(paths) & {"epd-shm", "epd-mooncake", "colocated"}:
            spawn["epd"] = _ec(
                "TimedEPDConnector",
                "ec_consumer",
                ec_connector_extra_config={
                    "pool_bytes": 512 << 20,
                    "transports": ["shm", "mooncake"],
                },
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
            from bench.cluster import free_port

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
        if "epd-shm" in paths:
            self.workers["epd-shm"] = self.cluster.start_encode_worker(
                "worker-shm", transports="shm"
            )
        if "epd-mooncake" in paths:
            self.workers["epd-mooncake"] = self.cluster.start_encode_worker(
                "worker-mooncake", transports="mooncake"
            )
        max_len = max(1024, 2 * max(args.sizes) ** 2 // (28 * 28) + 256)
        for name, config in spawn.items():
            # ECCPUConnector refuses the V1 model runner, which vLLM's CPU build picks by default
            env = {"VLLM_USE_V2_MODEL_RUNNER": "1"} if name.startswith("cpu-") else None
            self.servers[name] = Server(name, model, self.log_dir, config, args.dtype, max_len, env)
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
        from multimodal.hashing import hash_feature
        from vision.sizing import image_grid

        image = self.image(size)
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        key = self.identifier(hash_feature(image))
        started, wall = time.monotonic(), time.time()
        if path in OURS:
            (item,) = await dispatcher[path].dispatch(f"{path}-{self.seed}", [image])
            if item.error:
                raise RuntimeError(f"dispatch failed: {item.error}")
            self.acks[key] = wall + item.dispatch_s
            part = {
                "type": "image_embeds",
                "image_embeds": {"image_grid_thw": list(item.grid_thw)},
                "uuid": key,
            }
            await _chat(
                session,
                self.servers["epd"],
                _content(part),
                {"rooms": {key: item.encode_handshake.model_dump()}},
            )
        elif path == "colocated":
            await _chat(
                session,
                self.servers["epd"],
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
        consumer = {"example": "example-consumer", "mooncake-ec": "mooncake-consumer"}.get(
            path, "epd"
        )
        producer = {"example": "example-producer", "mooncake-ec": "mooncake-producer"}.get(path)
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

    from dispatcher import Dispatcher, WorkerSet

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


def _summary(raw: list[dict], sizes: list[int]) -> list[dict]:
    out = []
    for path in dict.fromkeys(row["path"] for row in raw):
        for size in sizes:
            rows = [row for row in raw if row["path"] == path and row["size"] == size]

            def med(key):
                values = [row[key] for row in rows if row[key] is not None]
                return statistics.median(values) if values else None

            deliveries = [
                statistics.median(row["delivery_ms"]) for row in rows if row["delivery_ms"]
            ]
            out.append(
                {
                    "path": path,
                    "size": size,
                    "ttft_ms": med("ttft_ms"),
                    "throughput_rps": med("throughput_rps"),
                    "delivery_ms": statistics.median(deliveries) if deliveries else None,
                    "cpu_ms_per_image": med("cpu_ms_per_image"),
                    "producer_cpu_ms_per_image": med("producer_cpu_ms_per_image"),
                }
            )
    return out


def _goal(summary: list[dict], sizes: list[int]) -> dict:
    """Per size: whether this project's connector had the lowest delivery time of all paths run."""
    goal = {}
    for size in sizes:
        rows = [row for row in summary if row["size"] == size and row["delivery_ms"] is not None]
        ours = [row["delivery_ms"] for row in rows if row["path"] in OURS]
        theirs = {row["path"]: row["delivery_ms"] for row in rows if row["path"] not in OURS}
        goal[str(size)] = {
            "ours_ms": min(ours) if ours else None,
            "peers_ms": theirs,
            "lowest": bool(ours) and all(min(ours) < value for value in theirs.values()),
        }
    return goal


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = report["config"]["sizes"]
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, key, title in zip(
        axes,
        ("delivery_ms", "ttft_ms", "cpu_ms_per_image"),
        (
            "delivery: encoded -> vLLM's encoder cache (ms)",
            "TTFT (ms)",
            "consumer CPU per image (ms)",
        ),
    ):
        for name in dict.fromkeys(row["path"] for row in report["summary"]):
            points = [
                (row["size"], row[key])
                for row in report["summary"]
                if row["path"] == name and row[key] is not None
            ]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("image side (px)")
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=8)  # every path has a TTFT (colocated has no delivery)
    figure.suptitle(
        f"epd-bench vllm: width {report['config']['hidden']} {report['config']['dtype']}, "
        f"median of {report['config']['rounds']} rounds",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _print(report: dict) -> None:
    print(
        f"\n{'path':>13s} {'size':>5s} {'delivery ms':>12s} {'TTFT ms':>8s} {'req/s':>6s} "
        f"{'CPU ms/img':>11s}"
    )
    for row in report["summary"]:
        delivery = f"{row['delivery_ms']:.2f}" if row["delivery_ms"] is not None else "-"
        print(
            f"{row['path']:>13s} {row['size']:>5d} {delivery:>12s} {row['ttft_ms']:>8.1f} "
            f"{row['throughput_rps']:>6.2f} {row['cpu_ms_per_image']:>11.1f}"
        )
    for path, why in report["unavailable"].items():
        print(f"{path}: unavailable: {why}")
    for size, goal in report["goal"].items():
        print(
            f"size {size}: EPD connector lowest delivery time: {'yes' if goal['lowest'] else 'NO'} "
            f"(ours {goal['ours_ms']}, peers {goal['peers_ms']})"
        )


def main(args) -> int:
    args.sizes = [int(s) for s in args.sizes.split(",")]
    report = run(args)
    _print(report)
    write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    return 0 if all(goal["lowest"] for goal in report["goal"].values()) else 1
