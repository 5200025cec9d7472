"""`epd-bench gateway --scenario burst|steady|mixed`: the gateway under load, comparing two or more
gateways that differ in one flag: ``--compare inline-cap`` (both ``--placement workers``:
``refuse``, ``--max-inline-patches 0``: a request with an image the busy workers refused is
refused, 503; against ``overflow``, the default cap: such images go to vLLM inline) or
``--compare placement`` (``--placement`` values, ``--policies``: ``workers`` against ``cost``,
and ``min-items=N`` where named).

One vLLM OpenAI server (with the EPD connector), one encode worker whose queue holds
``--queue-items`` items (more are refused busy), and the compared gateways in front of it. The
workloads, each a list of streaming requests of fresh images (no cache hits) at given offsets
from a round's start, drawn from a seeded generator so that every policy of a round gets the same
one:

* ``burst``: ``--burst-requests`` requests of ``--images`` ``--size`` images, all at once
  (``--burst-requests 1``: the idle system, one request at a time);
* ``steady``: requests of ``--images`` ``--size`` images arriving at ``--rate`` per second
  (Poisson) for ``--seconds``;
* ``mixed``: as ``steady``, each request of 1 to ``--images`` images, each image's side drawn from
  ``--mixed-sizes``.

Per round, each policy's gateway gets the round's workload (policies in alternating order; before
each, the worker's queue empty and no request in vLLM, then ``--pause-s``). Per policy: requests
refused (503), other errors with their first bytes, TTFT p50 / p99 of the requests served
(client-side, to the first streamed event; also by the route their images took, and each
round's), the time between a request's tokens p50 / p99 (vLLM's steps, which inline encodes
delay for every request in the engine), images per route and reason
(``epd_gateway_placements_total``), and the most patches vLLM encoded inline at once
(``epd_gateway_inline_patches_peak``).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from epdserve.bench.benchmarks.gateway import GatewayStack, chat_body, read_stream
from epdserve.bench.benchmarks.results import percentile, write_json
from epdserve.bench.benchmarks.rounds import in_round

SCENARIOS = ("burst", "steady", "mixed")
# the gateways' flags, per policy, per comparison (``placement``: per ``--policies`` value)
INLINE_CAP = {
    "refuse": ("--placement", "workers", "--max-inline-patches", "0"),
    "overflow": ("--placement", "workers", "--max-inline-patches", "16384"),
}
ERROR_BYTES = 300  # of an answer that is neither 200 nor 503, kept in the report


@dataclass(frozen=True)
class Request:
    """One request of a workload: when it is sent (seconds from its round's start) and the sides
    of its square images."""

    at_s: float
    sides: tuple[int, ...]


def workload(args, round_index: int) -> list[Request]:
    """Round ``round_index``'s requests of ``args.scenario`` (the same for every policy)."""
    rng = random.Random(args.seed * 1_000 + round_index)
    if args.scenario == "burst":
        return [Request(0.0, (args.size,) * args.images)] * args.burst_requests
    sides = (args.size,) if args.scenario == "steady" else tuple(args.mixed_sizes)
    requests, at = [], rng.expovariate(args.rate)
    while at < args.seconds:
        count = args.images if args.scenario == "steady" else rng.randint(1, args.images)
        requests.append(Request(at, tuple(rng.choice(sides) for _ in range(count))))
        at += rng.expovariate(args.rate)
    return requests


def policies(args) -> dict[str, tuple[str, ...]]:
    """The compared gateways' flags, by policy name."""
    if args.compare == "inline-cap":
        return INLINE_CAP
    return {policy: ("--placement", policy) for policy in args.policies}


async def _request(session, url: str, model: str, images: list[bytes], max_tokens: int) -> dict:
    """One streaming request: its status, TTFT, time between tokens and its images' route; a
    connection that failed is an answer of status None (counted among the other errors)."""
    body = chat_body(model, images, "Describe the pictures.", max_tokens)
    started = time.monotonic()
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                text = (await response.read())[:ERROR_BYTES].decode(errors="replace")
                return {"status": response.status, "ttft_s": None, "error": text}
            streamed = await read_stream(response, started)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"status": None, "ttft_s": None, "error": f"{type(exc).__name__}: {exc}"}
    routes = {image["encoder"] for image in (streamed.epd or {}).get("images", [])}
    # the route of its images: encode_worker, colocated (vLLM's tower), or both
    route = routes.pop() if len(routes) == 1 else "both" if routes else "none"
    return {
        "status": 200,
        "ttft_s": streamed.first_s,
        "per_token_s": streamed.per_token_s,
        "route": route,
    }


async def _at(offset_s: float, started: float, call):
    await asyncio.sleep(max(0.0, started + offset_s - time.monotonic()))
    return await call


def _placements(text: str) -> dict[str, float]:
    """``epd_gateway_placements_total`` by "route/reason", and the inline peak (the gateway's
    over its life, the untimed first request included), from a gateway's ``/metrics``."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "epd_gateway_placements_total":
                out[f"{sample.labels['route']}/{sample.labels['reason']}"] = sample.value
            elif sample.name == "epd_gateway_inline_patches_peak":
                out["inline_patches_peak"] = sample.value
    return out


async def _until_idle(session, worker_url: str, vllm_url: str, timeout_s: float = 120) -> None:
    """Until the encode worker's queue is empty and vLLM runs and waits on no request (its
    ``/metrics``); ``TimeoutError`` past ``timeout_s``."""
    from epdserve.gateway.engine_load import engine_requests
    from epdserve.testing.cluster import metric_total

    deadline = time.monotonic() + timeout_s
    while True:
        queued = await metric_total(session, worker_url, "epd_encoder_queue_depth") or 0.0
        async with session.get(vllm_url + "/metrics") as response:
            in_vllm = engine_requests(await response.text())
        if queued == 0 and in_vllm == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not idle after {timeout_s} s: {queued} queued, {in_vllm} in vLLM")
        await asyncio.sleep(0.2)


def run(args) -> dict:
    from epdserve.testing.images import synthetic_image

    stack = GatewayStack(f"gateway-{args.scenario}")
    model = stack.model
    flags = policies(args)
    rows, peaks = [], {}
    seed = [9000]

    def fresh(sides) -> list[bytes]:
        seed[0] += len(sides)
        return [synthetic_image(side, side, seed[0] + i) for i, side in enumerate(sides)]

    try:
        print(f"epd-bench gateway --scenario {args.scenario}: starting (logs in {stack.log_dir})")
        worker = stack.start(
            worker_extra=("--queue-items", str(args.queue_items), "--batch-items", "8"),
            images_per_prompt=args.images,
        )
        gateways = {
            policy: stack.start_gateway(
                f"gateway-{policy}", [worker.worker], extra=(*each, "--intake-timeout-s", "1")
            )
            for policy, each in flags.items()
        }
        stack.wait_ready()

        async def rounds():
            async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=600),
                connector=aiohttp.TCPConnector(limit=0),
            ) as session:
                for role in gateways.values():  # one untimed request each (first-use costs)
                    await _request(session, role.url, model, fresh((args.size,)), args.max_tokens)
                for round_index in range(args.rounds):
                    requests = workload(args, round_index)
                    for policy in in_round(list(flags), round_index):
                        url = gateways[policy].url
                        images = [fresh(request.sides) for request in requests]  # made before
                        async with session.get(url + "/metrics") as response:
                            before = _placements(await response.text())
                        started = time.monotonic()
                        answers = await asyncio.gather(
                            *(
                                _at(
                                    request.at_s,
                                    started,
                                    _request(session, url, model, mine, args.max_tokens),
                                )
                                for request, mine in zip(requests, images, strict=True)
                            )
                        )
                        async with session.get(url + "/metrics") as response:
                            after = _placements(await response.text())
                        peaks[policy] = after.get("inline_patches_peak", 0.0)
                        rows.append(_row(round_index, policy, requests, answers, before, after))
                        print(
                            f"  round {round_index} {policy}: {len(requests)} requests, refused "
                            f"{rows[-1]['refused']}, placements {rows[-1]['placements']}",
                            flush=True,
                        )
                        await _until_idle(session, worker.url, stack.server.url)
                        await asyncio.sleep(args.pause_s)

        asyncio.run(rounds())
    finally:
        codes = stack.stop()
    return {
        "config": {
            "scenario": args.scenario,
            "compare": args.compare,
            "model": model,
            "burst_requests": args.burst_requests,
            "rate": args.rate,
            "seconds": args.seconds,
            "images": args.images,
            "size": args.size,
            "mixed_sizes": list(args.mixed_sizes),
            "queue_items": args.queue_items,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
        },
        "summary": {
            policy: _summary(policy, each, rows, peaks.get(policy))
            for policy, each in flags.items()
        },
        "raw": rows,
        "exit_codes": codes,
    }


def _row(round_index, policy, requests, answers, before, after) -> dict:
    return {
        "round": round_index,
        "policy": policy,
        "requests": len(requests),
        "images": sum(len(request.sides) for request in requests),
        "refused": sum(a["status"] == 503 for a in answers),
        "other_errors": [
            {"status": a["status"], "error": a["error"]}
            for a in answers
            if a["status"] not in (200, 503)
        ],
        "ttft_s": [a["ttft_s"] for a in answers if a["ttft_s"] is not None],
        "routes": [a["route"] for a in answers if a["ttft_s"] is not None],
        "per_token_s": [a["per_token_s"] for a in answers if a.get("per_token_s") is not None],
        "placements": {
            key: after[key] - before.get(key, 0.0) for key in after if key != "inline_patches_peak"
        },
    }


def _summary(policy: str, flags: tuple[str, ...], rows: list[dict], peak: float | None) -> dict:
    mine = [row for row in rows if row["policy"] == policy]
    ttft = [t for row in mine for t in row["ttft_s"]]
    per_token = [t for row in mine for t in row["per_token_s"]]
    routes: dict[str, float] = {}
    for row in mine:
        for key, count in row["placements"].items():
            routes[key] = routes.get(key, 0.0) + count
    by_route: dict[str, list[float]] = {}
    for row in mine:
        for ttft_s, route in zip(row["ttft_s"], row["routes"], strict=True):
            by_route.setdefault(route, []).append(ttft_s)
    return {
        "flags": " ".join(flags),
        "requests": sum(row["requests"] for row in mine),
        "images": sum(row["images"] for row in mine),
        "refused": sum(row["refused"] for row in mine),
        "other_errors": sum(len(row["other_errors"]) for row in mine),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        # between a request's tokens (vLLM's steps, which its inline encodes for others delay)
        "per_token_p50_s": percentile(per_token, 0.5),
        "per_token_p99_s": percentile(per_token, 0.99),
        # the spread between rounds: each round's p50 and p99
        "round_ttft_p50_s": [percentile(row["ttft_s"], 0.5) for row in mine],
        "round_ttft_p99_s": [percentile(row["ttft_s"], 0.99) for row in mine],
        # the requests by the route their images took (encode_worker, colocated, both)
        "ttft_by_route": {
            route: {
                "requests": len(each),
                "p50_s": percentile(each, 0.5),
                "p99_s": percentile(each, 0.99),
            }
            for route, each in sorted(by_route.items())
        },
        "placements": routes,
        "inline_patches_peak": peak,
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def main(args) -> int:
    report = run(args)
    first = next(iter(report["summary"].values()))
    for policy, row in report["summary"].items():
        p50, p99 = row["ttft_p50_s"], row["ttft_p99_s"]
        ratio = (
            f" (p50 x{p50 / first['ttft_p50_s']:.3f}, p99 x{p99 / first['ttft_p99_s']:.3f})"
            if row is not first and None not in (p50, p99, first["ttft_p50_s"], first["ttft_p99_s"])
            else ""
        )
        print(
            f"{policy:>11s} ({row['flags']}): refused {row['refused']} of {row['requests']}, "
            f"other errors {row['other_errors']}; TTFT p50 / p99 "
            f"{p50 if p50 is None else round(p50, 3)} / {p99 if p99 is None else round(p99, 3)} s"
            f"{ratio}; per token p50 / p99 {_ms(row['per_token_p50_s'])} / "
            f"{_ms(row['per_token_p99_s'])} ms; images {row['placements']}; inline patches peak "
            f"{row['inline_patches_peak']}"
        )
    write_json(args.json, report)
    return 0 if all(code == 0 for code in report["exit_codes"].values()) else 1
