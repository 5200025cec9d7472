"""`epd-bench worker-kill`: how long a request waits when its encode worker dies under load.

One vLLM OpenAI server with the EPD connector, and per round a fresh encode worker (SHM) behind a
fresh gateway. ``--requests`` chat requests, one fresh image each, are sent at once; once the
worker has taken ``--kill-after`` items it is killed (SIGKILL). Every request must still be
answered. For each request answered after the kill: its time from the kill to its answer, and
(what vLLM alone would have spent) the same request sent straight to vLLM afterwards, its image
inline; the excess of the one over the other is what the kill cost it. Medians and maxima per
round, every round reported.
"""

from __future__ import annotations

import base64
import concurrent.futures
import statistics
import tempfile
import time
import urllib.request

from epdserve.bench.benchmarks.results import write_json
from epdserve.testing.cluster import LocalCluster
from epdserve.testing.images import synthetic_image
from epdserve.testing.vllm_servers import Server, _wait_healthy
from epdserve.vision.vlm_checkpoints import cached_vlm

CONNECTOR = {
    "ec_connector": "EPDConnector",
    "ec_connector_module_path": "prefill_side.vllm_connector",
    "ec_role": "ec_consumer",
    "ec_connector_extra_config": {"pool_bytes": 64 << 20, "slot_bytes": 1 << 16},
}


def _ask(client, model: str, image: bytes, max_tokens: int):
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    started = time.monotonic()
    answer = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": uri}},
                    {"type": "text", "text": "Describe the picture."},
                ],
            }
        ],
        temperature=0,
        max_tokens=max_tokens,
    )
    return answer, started, time.monotonic()


def _intake_items(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("epd_encoder_intake_total{")
    )


def _round(cluster, vllm, model, direct, args, index: int) -> dict:
    import openai

    worker = cluster.start_encode_worker(f"worker-{index}", transports="shm")
    gateway = cluster.start_gateway(
        vllm, [worker.worker], name=f"gateway-{index}", extra=("--placement", "workers")
    )
    cluster.wait_ready()
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(gateway.url + "/readyz", timeout=5):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not get ready") from None
            time.sleep(0.2)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0, timeout=300)
    images = [
        synthetic_image(args.size, args.size + 2 * i, seed=1000 * index + i)
        for i in range(args.requests)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        futures = [pool.submit(_ask, client, model, image, args.max_tokens) for image in images]
        while _intake_items(worker.url) < args.kill_after:
            time.sleep(0.005)
        cluster.kill(worker)
        killed = time.monotonic()
        answers = [future.result() for future in futures]
    client.close()
    cluster.kill(gateway)
    after = []
    for image, (answer, _, ended) in zip(images, answers):
        if ended <= killed:
            continue
        (report,) = answer.model_extra["epd"]["images"]
        _, started, alone_ended = _ask(direct, model, image, args.max_tokens)
        after.append(
            {
                "encoder": report["encoder"],
                "reason": report.get("error"),
                "after_kill_s": ended - killed,
                "vllm_alone_s": alone_ended - started,
            }
        )
    excess = [r["after_kill_s"] - r["vllm_alone_s"] for r in after]
    return {
        "answered_before_kill": len(answers) - len(after),
        "answered_after_kill": after,
        "after_kill_s": {
            "median": statistics.median(r["after_kill_s"] for r in after) if after else None,
            "max": max((r["after_kill_s"] for r in after), default=None),
        },
        "excess_over_vllm_alone_s": {
            "median": statistics.median(excess) if excess else None,
            "max": max(excess, default=None),
        },
    }


def main(args) -> int:
    import openai

    model = cached_vlm("qwen2_vl")
    log_dir = tempfile.mkdtemp(prefix="epd-worker-kill-")
    cluster = LocalCluster(model, log_dir=log_dir)
    vllm = Server("vllm", model, log_dir, CONNECTOR, "float32", 1024, images_per_prompt=1)
    direct = openai.OpenAI(base_url=vllm.url + "/v1", api_key="-", max_retries=0, timeout=300)
    report = {"requests": args.requests, "kill_after": args.kill_after, "size": args.size}
    try:
        failed = _wait_healthy([vllm], 600)
        if failed:
            raise RuntimeError(f"vLLM did not start: {failed}")
        report["rounds"] = [
            _round(cluster, vllm, model, direct, args, index) for index in range(args.rounds)
        ]
    finally:
        direct.close()
        vllm.stop()
        cluster.stop()
    for index, result in enumerate(report["rounds"]):
        print(
            f"round {index}: {result['answered_before_kill']} answered before the kill, "
            f"{len(result['answered_after_kill'])} after: from the kill "
            f"median {result['after_kill_s']['median']:.2f} s, max "
            f"{result['after_kill_s']['max']:.2f} s; over vLLM alone median "
            f"{result['excess_over_vllm_alone_s']['median']:.2f} s, max "
            f"{result['excess_over_vllm_alone_s']['max']:.2f} s"
        )
    write_json(args.json, report)
    return 0
