"""`make demo`: a chat request with images, answered by vLLM whose image embeddings came from an
encode worker, every role its own process on this machine.

Starts two encode workers (one writes over same-node SHM, one over Mooncake TCP as if on another
node), vLLM's OpenAI server on CPU with the EPD connector (a tiny checkpoint of the ``--family``
architecture, Qwen2-VL by default, built on first run and cached), and one `epd-gateway` per
worker; then sends chat requests with images through the official `openai` client and prints,
per request, the text, the token ids, whether they equal vLLM's own colocated answer to the same
images, and where the time went. Then stops every process and checks that no SHM segment is left.

    python -m epdserve.bench.demo [--family qwen2_vl | --model DIR] [--dtype float32]
"""

from __future__ import annotations

import argparse
import base64
import glob
import os
import sys
import tempfile
import time

from epdserve.testing.cluster import LocalCluster
from epdserve.testing.images import synthetic_image

MAX_TOKENS = 12
# (request, gateway, images as (width, height, seed, format)); seed 1 twice in a request: one encode
REQUESTS = [
    (
        "two images, one repeated",
        "shm",
        [(448, 448, 1, "PNG"), (640, 480, 2, "JPEG"), (448, 448, 1, "PNG")],
    ),
    ("one image", "shm", [(336, 336, 3, "PNG")]),
    ("two images", "mooncake", [(800, 600, 4, "JPEG"), (224, 224, 5, "PNG")]),
]
INTRO = """\
EPD (encode / prefill / decode): the vision tower runs in an encode worker, not in vLLM. Per
image, the gateway hashes the bytes, mints a room on the worker chosen by the hash and sends the
image to it; once the worker has run the tower and holds the rows, vLLM gets the request, with
each image's patch grid and room instead of its pixels (for a model vLLM takes no request of
grids alone for, Gemma 3: the image and its room; vLLM only preprocesses it to place its rows).
vLLM's scheduler (the EPD connector) reserves memory for the rows and registers it in the room;
the worker writes the rows straight into that memory (SHM on one node, Mooncake between nodes);
vLLM's model runner copies them into its encoder cache and prefills. Where each image is encoded
is the gateway's choice (--placement cost, the default: the route whose first token it predicts
sooner; the encode workers until vLLM's own tower is measured, which the second request of a size
class does, so an image may show "colocated" with its reason).
"""


def default_model(family: str) -> str:
    from epdserve.vision.vlm_checkpoints import cached_vlm

    return cached_vlm(family)


def _data_uri(image: bytes, fmt: str) -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(image).decode()


def _ask(client, model: str, urls: list[str], **extra):
    content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    content.append({"type": "text", "text": "What is in these pictures?"})
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True},
        **extra,
    )


def _requests(model: str, gateways: dict, vllm_url: str) -> bool:
    import openai

    direct = openai.OpenAI(base_url=vllm_url + "/v1", api_key="-", max_retries=0, timeout=300)
    clients = {
        name: openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=300)
        for name, url in gateways.items()
    }
    all_equal = True
    try:
        for title, path, specs in REQUESTS:
            urls = [_data_uri(synthetic_image(w, h, seed, fmt), fmt) for w, h, seed, fmt in specs]
            started = time.monotonic()
            answer = _ask(clients[path], model, urls)
            elapsed = time.monotonic() - started
            colocated = _ask(direct, model, urls)
            tokens = answer.choices[0].model_extra.get("token_ids")
            equal = (
                tokens == colocated.choices[0].model_extra.get("token_ids") and tokens is not None
            )
            all_equal &= equal
            report, metrics = answer.model_extra["epd"], answer.model_extra.get("metrics") or {}
            print(
                f"\n{title} ({len(urls)} image parts) -> gateway-{path}: answered in "
                f"{elapsed * 1e3:.0f} ms"
            )
            print(f"  text:   {answer.choices[0].message.content!r}")
            print(f"  tokens: {tokens}")
            print(
                "  equal to vLLM's colocated run (its own tower on the same images): "
                f"{'yes' if equal else 'NO'}"
            )
            print(
                f"  dispatch {report['dispatch_ms']:.1f} ms (load, hash, rooms, intake: every "
                f"image placed), staged {report['staged_ms']:.1f} ms (the worker holds the "
                "rows); "
                f"vLLM: waited {metrics.get('queue_time_ms') or 0:.1f} ms for rows, "
                f"prefill to first token {metrics.get('time_to_first_token_ms') or 0:.1f} ms"
            )
            print(
                f"  {'image':>12s} {'rows':>5s} {'encoder':>13s} {'reason':>8s} {'transport':>9s} "
                f"{'queue':>6s} "
                f"{'encode':>6s} "
                f"{'wait':>6s} {'xfer':>6s} {'received':>8s} (ms)"
            )
            distinct = list(dict.fromkeys(specs))  # the report has one entry per distinct image
            for (w, h, _, fmt), image in zip(distinct, report["images"], strict=True):
                print("  " + _row(f"{w}x{h} {fmt.lower()}", image))
        started = time.monotonic()
        first, parts = None, []
        for chunk in _ask(
            clients["shm"],
            model,
            [_data_uri(synthetic_image(512, 384, 6, "JPEG"), "JPEG")],
            stream=True,
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic() - started
                parts.append(chunk.choices[0].delta.content)
        print(
            f"\nstreamed (gateway-shm): first token after {first * 1e3:.0f} ms: {''.join(parts)!r}"
        )
    finally:
        direct.close()
        for client in clients.values():
            client.close()
    return all_equal


def _row(label: str, image: dict) -> str:
    delivery = image.get("delivery") or {}
    timings = delivery.get("encoder") or {}
    queue, encode, wait, transfer = (
        timings.get(k, 0.0) * 1e3 for k in ("queue_s", "encode_s", "wait_s", "transfer_s")
    )
    encode_text = "cache" if timings.get("cache_hit") else f"{encode:.1f}"
    return (
        f"{label:>12s} {image['rows']:>5d} {image['encoder']:>13s} {image['reason'] or '-':>8s} "
        f"{delivery.get('transport') or '-':>9s} {queue:6.1f} {encode_text:>6s} {wait:6.1f} "
        f"{transfer:6.1f} "
        f"{delivery.get('receive_s', 0.0) * 1e3:8.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    from epdserve.bench.benchmarks.vllm import Server, _wait_healthy

    parser = argparse.ArgumentParser(
        prog="python -m epdserve.bench.demo", description=__doc__.split("\n\n")[0]
    )
    from epdserve.vision.families import FAMILIES
    from epdserve.wire.ec_params import MODEL_TYPES

    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint directory of a model the connector takes (docs/models.md; default: a "
        "tiny model of --family with a tokenizer, built on first run and cached)",
    )
    parser.add_argument(
        "--family",
        default="qwen2_vl",
        choices=list(MODEL_TYPES),
        help="the tiny default model's architecture (docs/models.md)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="vLLM's and the encode workers' dtype (default: the one vLLM's CPU build runs the "
        "family in: float32, bfloat16 for "
        + ", ".join(name for name in MODEL_TYPES if FAMILIES[name].cpu_dtype == "bfloat16")
        + ")",
    )
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = FAMILIES[args.family].cpu_dtype
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    print(INTRO)
    if args.model is None:
        print(
            "The default model is tiny, with random weights: its text is noise. What counts is "
            "that its tokens "
            "equal\nvLLM's own colocated answer to the same images. --model DIR serves a real "
            "checkpoint.\n"
        )
    model = args.model or default_model(args.family)
    before = set(glob.glob("/dev/shm/epd-*"))
    log_dir = tempfile.mkdtemp(prefix="epd-demo-")
    cluster = LocalCluster(model, args.dtype, log_dir=log_dir)
    connector = {
        "ec_connector": "EPDConnector",
        "ec_connector_module_path": "prefill_side.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"pool_bytes": 256 << 20},
    }
    vllm = None
    equal = False
    try:
        print(
            f"Starting every role as its own process on 127.0.0.1 (model {model}, {args.dtype}; "
            f"logs in {log_dir}):"
        )
        workers = {
            "shm": cluster.start_encode_worker("worker-shm", transports="shm"),
            "mooncake": cluster.start_encode_worker("worker-mooncake", transports="mooncake"),
        }
        vllm = Server(
            "vllm",
            model,
            log_dir,
            connector,
            args.dtype,
            4096,
            images_per_prompt=4,
            extra=("--distributed-executor-backend", "mp", "--enable-per-request-metrics"),
        )
        gateways = {
            path: cluster.start_gateway(vllm, [worker.worker], name=f"gateway-{path}")
            for path, worker in workers.items()
        }
        cluster.wait_ready()
        failed = _wait_healthy([vllm], timeout_s=600)
        if failed:
            raise RuntimeError(f"vLLM did not start: {failed['vllm']}")
        for name, role, what in (
            (
                "worker-shm",
                workers["shm"],
                "epd-encode-worker: writes into vLLM's pool over /dev/shm",
            ),
            ("worker-mooncake", workers["mooncake"], "epd-encode-worker: writes over Mooncake TCP"),
            ("vllm", vllm, "vLLM's OpenAI server + EngineCore + model runner, EPD connector"),
            ("gateway-shm", gateways["shm"], "epd-gateway -> worker-shm, vLLM"),
            ("gateway-mooncake", gateways["mooncake"], "epd-gateway -> worker-mooncake, vLLM"),
        ):
            print(f"  {name:16s} pid {role.process.pid:<7d} {role.url:24s} {what}")
        equal = _requests(model, {path: role.url for path, role in gateways.items()}, vllm.url)
        print(
            "\nms: dispatch = the gateway's work before vLLM gets the request; queue = worker "
            "intake until the "
            "tower took\nthe image's batch; encode = the tower's time for that batch (cache = "
            "served from the "
            "worker's cache);\nwait = rows ready until vLLM's receiver registered; xfer = the "
            "write into vLLM's "
            "memory; received =\nvLLM's scheduler first saw the request until the rows were in "
            "its pool."
        )
    finally:
        print("\nStopping every process (SIGTERM)...")
        if vllm is not None:
            vllm.stop()
        codes = cluster.stop()
        if vllm is not None:
            codes["vllm"] = vllm.process.returncode
    time.sleep(0.5)
    left = set(glob.glob("/dev/shm/epd-*")) - before
    print("  exit codes: " + ", ".join(f"{name} {code}" for name, code in codes.items()))
    print(f"  SHM segments left behind: {len(left)}")
    ok = equal and not left and all(code == 0 for code in codes.values())
    print("\nDEMO OK" if ok else "\nDEMO FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
