"""`epd-bench gateway`: what `epd-gateway` adds to a request, against calling vLLM directly.

One vLLM OpenAI server (with the EPD connector), one encode worker (SHM), and two gateways: one
in front of the worker, one whose only worker does not exist (so it sends every image to vLLM
inline). Paths, each the same streaming chat request with one fresh image (no cache anywhere):

* ``direct``: the client calls vLLM with the image inline (colocated: vLLM's tower);
* ``gateway-colocated``: the same, through the gateway (it loads, hashes and sizes the image,
  finds no worker, and forwards the image inline): the gateway's own overhead is its TTFT minus
  ``direct``'s;
* ``gateway-epd``: through the gateway with the encode worker (dispatch, rows over SHM).

TTFT: from the client's request to the first streamed event (vLLM sends it with the first token);
medians over rounds of each batch's median. Gateway CPU per image: the gateway process's CPU seconds
(user + system, /proc) over every batch of a path and size, divided by their images. Rounds are
interleaved (path order reversed every other round).

The processes (``GatewayStack``) and the request (``chat_body``, ``read_stream``) are also
``gateway_load``'s.
"""

from __future__ import annotations

import asyncio
import base64
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.rounds import in_round

if TYPE_CHECKING:
    from epdserve.dispatcher.workers import WorkerAddress
    from epdserve.testing.cluster import Role

PATHS = ("direct", "gateway-colocated", "gateway-epd")
# vLLM's EPD connector in the gateway scenarios: rows from the encode worker over SHM
CONNECTOR = {
    "ec_connector": "EPDConnector",
    "ec_connector_module_path": "prefill_side.vllm_connector",
    "ec_role": "ec_consumer",
    "ec_connector_extra_config": {"pool_bytes": 256 << 20, "transports": ["shm"]},
}


class GatewayStack:
    """What the gateway scenarios (this one and ``gateway_load``) run, on a ``LocalCluster`` of
    the small Qwen2-VL: one encode worker (SHM), one vLLM OpenAI server with the EPD connector
    (float32, 4096 tokens) and the gateways a scenario puts in front of them. ``start``, the
    scenario's ``start_gateway`` calls, ``wait_ready``; ``stop`` always (it ends them all)."""

    def __init__(self, scenario: str) -> None:
        """``scenario``: names the log folder (``epd-bench-<scenario>-...``)."""
        from epdserve.testing.cluster import LocalCluster
        from epdserve.vision.vlm_checkpoints import cached_vlm

        self.model = cached_vlm("qwen2_vl")
        self.log_dir = tempfile.mkdtemp(prefix=f"epd-bench-{scenario}-")
        self.cluster = LocalCluster(self.model, log_dir=self.log_dir)
        self.server = None  # vLLM's, once started

    def start(self, worker_extra: tuple[str, ...] = (), images_per_prompt: int = 1) -> Role:
        """The encode worker (``worker_extra``: its flags beyond SHM) and vLLM (at most
        ``images_per_prompt`` images a prompt); returns the worker's role."""
        from epdserve.bench.benchmarks.vllm import Server

        worker = self.cluster.start_encode_worker("worker", transports="shm", extra=worker_extra)
        self.server = Server(
            "vllm",
            self.model,
            self.log_dir,
            CONNECTOR,
            "float32",
            4096,
            extra=("--distributed-executor-backend", "mp"),
            images_per_prompt=images_per_prompt,
        )
        return worker

    def start_gateway(
        self, name: str, workers: list[WorkerAddress], extra: tuple[str, ...] = ()
    ) -> Role:
        """A gateway in front of vLLM and ``workers``, with ``extra`` flags."""
        return self.cluster.start_gateway(self.server, workers, name=name, extra=extra)

    def wait_ready(self) -> None:
        """Until every role is ready and vLLM healthy (10 minutes at most); ``RuntimeError`` where
        vLLM did not start."""
        from epdserve.bench.benchmarks.vllm import _wait_healthy

        self.cluster.wait_ready()
        failed = _wait_healthy([self.server], timeout_s=600)
        if failed:
            raise RuntimeError(f"vLLM did not start: {failed['vllm']}")

    def stop(self) -> dict[str, int]:
        """Ends vLLM and every role; each one's exit code."""
        if self.server is not None:
            self.server.stop()
        codes = self.cluster.stop()
        if self.server is not None:
            codes["vllm"] = self.server.process.returncode
        return codes


def chat_body(model: str, images: list[bytes], prompt: str, max_tokens: int) -> dict:
    """A streaming greedy chat request: ``images`` (PNG data URIs), then ``prompt``."""
    content = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()},
        }
        for image in images
    ]
    content.append({"type": "text", "text": prompt})
    return {
        "model": model,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": content}],
    }


@dataclass(frozen=True)
class Streamed:
    """A streamed answer as the client saw it: seconds to its first event with a choice (vLLM
    sends it with the first token; None where none came), to its first and last with text, how
    many had text, and the gateway's ``epd`` report (None where it sent none: vLLM directly)."""

    first_s: float | None
    first_text_s: float | None
    last_text_s: float | None
    texts: int
    epd: dict | None

    @property
    def per_token_s(self) -> float | None:
        """Seconds between an event with text and the next (vLLM streams a token an event),
        None for fewer than two."""
        if self.texts < 2:
            return None
        return (self.last_text_s - self.first_text_s) / (self.texts - 1)


async def read_stream(response, started: float) -> Streamed:
    """Reads ``response``'s stream to its end (``started``: when sent, ``time.monotonic``)."""
    first, first_text, last_text, texts, epd = None, None, None, 0, None
    async for line in response.content:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        choices = event.get("choices")
        if choices:
            now = time.monotonic() - started
            first = now if first is None else first
            if choices[0].get("delta", {}).get("content"):
                first_text = now if first_text is None else first_text
                last_text, texts = now, texts + 1
        epd = event.get("epd", epd)
    return Streamed(first, first_text, last_text, texts, epd)


async def _first_token(session, url: str, model: str, image: bytes, max_tokens: int) -> float:
    body = chat_body(model, [image], "Describe the picture.", max_tokens)
    started = time.monotonic()
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {(await response.text())[:300]}")
        first = (await read_stream(response, started)).first_s
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no choice")
    return first


def run(args) -> dict:
    from tqdm import tqdm

    from epdserve.bench.benchmarks.vllm import cpu_seconds
    from epdserve.dispatcher.workers import WorkerAddress
    from epdserve.testing.cluster import HOST, free_port
    from epdserve.testing.images import synthetic_image

    stack = GatewayStack("gateway")
    model = stack.model
    raw = []
    try:
        print(
            "epd-bench gateway: starting vLLM, an encode worker and two gateways (logs in "
            f"{stack.log_dir})",
            flush=True,
        )
        worker = stack.start()
        gateways = {
            # the workers' path, whatever the default placement
            "gateway-epd": stack.start_gateway(
                "gateway-epd", [worker.worker], extra=("--placement", "workers")
            ),
            "gateway-colocated": stack.start_gateway(
                "gateway-colocated", [WorkerAddress(HOST, free_port(), free_port())]
            ),
        }
        stack.wait_ready()
        urls = {"direct": stack.server.url, **{name: role.url for name, role in gateways.items()}}
        seed = [5000]

        async def batches():
            import aiohttp

            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
                for path in PATHS:  # one untimed request each (first-use costs)
                    seed[0] += 1
                    await _first_token(
                        session,
                        urls[path],
                        model,
                        synthetic_image(224, 224, seed[0]),
                        args.max_tokens,
                    )
                total = args.rounds * len(args.sizes) * len(PATHS) * args.requests
                with tqdm(
                    total=total, unit="req", desc="epd-bench gateway", file=sys.stderr
                ) as progress:
                    for round_index in range(args.rounds):
                        order = in_round(PATHS, round_index)
                        for size in args.sizes:
                            for path in order:
                                role = gateways.get(path)
                                cpu_before = (
                                    sum(cpu_seconds([role.process.pid]).values()) if role else 0.0
                                )
                                ttfts = []
                                for _ in range(args.requests):
                                    seed[0] += 1
                                    image = synthetic_image(size, size, seed[0])
                                    ttfts.append(
                                        await _first_token(
                                            session, urls[path], model, image, args.max_tokens
                                        )
                                    )
                                    progress.update(1)
                                cpu = (
                                    sum(cpu_seconds([role.process.pid]).values()) - cpu_before
                                    if role
                                    else None
                                )
                                raw.append(
                                    {
                                        "round": round_index,
                                        "size": size,
                                        "path": path,
                                        "ttft_ms": statistics.median(ttfts) * 1e3,
                                        "images": args.requests,
                                        "gateway_cpu_s": cpu,
                                    }
                                )

        asyncio.run(batches())
    finally:
        codes = stack.stop()
    return {
        "config": {
            "model": model,
            "sizes": args.sizes,
            "requests": args.requests,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
        },
        "summary": _summary(raw, args.sizes),
        "raw": raw,
        "exit_codes": codes,
    }


def _summary(raw: list[dict], sizes: list[int]) -> list[dict]:
    out = []
    for size in sizes:

        def med(path, key):
            values = [
                row[key]
                for row in raw
                if row["size"] == size and row["path"] == path and row[key] is not None
            ]
            return statistics.median(values) if values else None

        def cpu_per_image(path):  # summed over rounds: one batch is a few of /proc's 10 ms ticks
            rows = [row for row in raw if row["size"] == size and row["path"] == path]
            return (
                sum(row["gateway_cpu_s"] for row in rows) / sum(row["images"] for row in rows) * 1e3
            )

        direct = med("direct", "ttft_ms")
        row = {"size": size, "direct_ttft_ms": direct}
        for path in ("gateway-colocated", "gateway-epd"):
            row[f"{path}_ttft_ms"] = med(path, "ttft_ms")
            row[f"{path}_added_ms"] = med(path, "ttft_ms") - direct
            row[f"{path}_cpu_ms_per_image"] = cpu_per_image(path)
        out.append(row)
    return out


def main(args) -> int:
    args.sizes = [int(s) for s in args.sizes.split(",")]
    report = run(args)
    print(
        f"\n{'size':>5s} {'direct TTFT':>12s} {'via gateway (colocated)':>24s} {'added':>7s} "
        f"{'via gateway (EPD)':>18s} {'gateway CPU ms/img colocated / EPD':>36s}"
    )
    for row in report["summary"]:
        print(
            f"{row['size']:>5d} {row['direct_ttft_ms']:>10.1f}ms "
            f"{row['gateway-colocated_ttft_ms']:>22.1f}ms "
            f"{row['gateway-colocated_added_ms']:>+5.1f}ms {row['gateway-epd_ttft_ms']:>16.1f}ms "
            f"{row['gateway-colocated_cpu_ms_per_image']:>20.2f} / "
            f"{row['gateway-epd_cpu_ms_per_image']:.2f}"
        )
    write_json(args.json, report)
    return 0 if all(code == 0 for code in report["exit_codes"].values()) else 1
