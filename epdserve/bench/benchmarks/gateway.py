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
"""

from __future__ import annotations

import asyncio
import base64
import json
import statistics
import sys
import tempfile
import time

from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.rounds import in_round

PATHS = ("direct", "gateway-colocated", "gateway-epd")


async def _first_token(session, url: str, model: str, image: bytes, max_tokens: int) -> float:
    body = {
        "model": model,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {
                            "url": "data:image/png;base64," + base64.b64encode(image).decode()
                        },
                    },
                    {"type": "text", "text": "Describe the picture."},
                ],
            }
        ],
    }
    started = time.monotonic()
    first = None
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {(await response.text())[:300]}")
        async for line in response.content:  # vLLM's first event comes with the first token
            if (
                first is None
                and line.startswith(b"data: {")
                and json.loads(line[6:]).get("choices")
            ):
                first = time.monotonic() - started
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no choice")
    return first


def run(args) -> dict:
    from tqdm import tqdm

    from epdserve.bench.benchmarks.vllm import Server, _wait_healthy, cpu_seconds
    from epdserve.dispatcher.workers import WorkerAddress
    from epdserve.testing.cluster import HOST, LocalCluster, free_port
    from epdserve.testing.images import synthetic_image
    from epdserve.vision.vlm_checkpoints import cached_vlm

    model = cached_vlm("qwen2_vl")
    log_dir = tempfile.mkdtemp(prefix="epd-bench-gateway-")
    cluster = LocalCluster(model, log_dir=log_dir)
    connector = {
        "ec_connector": "EPDConnector",
        "ec_connector_module_path": "prefill_side.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"pool_bytes": 256 << 20, "transports": ["shm"]},
    }
    server = None
    raw = []
    try:
        print(
            "epd-bench gateway: starting vLLM, an encode worker and two gateways (logs in "
            f"{log_dir})",
            flush=True,
        )
        worker = cluster.start_encode_worker("worker", transports="shm")
        server = Server(
            "vllm",
            model,
            log_dir,
            connector,
            "float32",
            4096,
            extra=("--distributed-executor-backend", "mp"),
        )
        gateways = {
            "gateway-epd": cluster.start_gateway(server, [worker.worker], name="gateway-epd"),
            "gateway-colocated": cluster.start_gateway(
                server,
                [WorkerAddress(HOST, free_port(), free_port())],
                name="gateway-colocated",
            ),
        }
        cluster.wait_ready()
        failed = _wait_healthy([server], timeout_s=600)
        if failed:
            raise RuntimeError(f"vLLM did not start: {failed['vllm']}")
        urls = {"direct": server.url, **{name: role.url for name, role in gateways.items()}}
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
        if server is not None:
            server.stop()
        codes = cluster.stop()
        if server is not None:
            codes["vllm"] = server.process.returncode
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
