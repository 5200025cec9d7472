"""`epd-bench gateway --scenario burst`: a burst the encode tier cannot take in time, refused (503)
against overflowed to vLLM's own tower within `--max-inline-patches` (``--compare inline-cap``),
or placed by ``--placement workers`` against ``cost`` (``--compare placement``).

One vLLM OpenAI server (with the EPD connector), one encode worker whose queue holds
``queue_items`` items (more are refused busy: queue full), and two gateways in front of it that
differ only in the compared flag. ``inline-cap``: ``refuse`` (``--max-inline-patches 0``: a
request with an image the busy workers refused is refused, 503) and ``overflow`` (the default
cap: such images go to vLLM inline); ``placement``: ``workers`` and ``cost``, both with the
default cap (``--burst-requests 1``: the idle system, one request at a time). Per round, each
gateway gets the same burst (``requests`` streaming requests of ``images`` fresh ``size``
images each, all at once; gateways in alternating order, the worker idle before each);
per policy: requests refused, TTFT p50 / p99 of the requests served, images per route and reason
(``epd_gateway_placements_total``), and the most patches vLLM encoded inline at once against
the cap (``epd_gateway_inline_patches_peak``).
"""

from __future__ import annotations

import asyncio
import time

from epdserve.bench.benchmarks.gateway import GatewayStack, chat_body, first_event_s
from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.rounds import in_round

# the gateways' flags, per policy, per comparison
COMPARISONS = {
    "inline-cap": {
        "refuse": ("--max-inline-patches", "0"),
        "overflow": ("--max-inline-patches", "16384"),
    },
    "placement": {"workers": ("--placement", "workers"), "cost": ("--placement", "cost")},
}


async def _request(session, url: str, model: str, images: list[bytes], max_tokens: int) -> dict:
    body = chat_body(model, images, "Describe the pictures.", max_tokens)
    started = time.monotonic()
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            await response.read()
            return {"status": response.status, "ttft_s": None}
        return {"status": 200, "ttft_s": await first_event_s(response, started)}


def _placements(text: str) -> dict[str, float]:
    """``epd_gateway_placements_total`` by "route/reason", and the inline peak."""
    out = {}
    for line in text.splitlines():
        if line.startswith("epd_gateway_placements_total{"):
            labels = dict(
                part.split("=", 1)
                for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            key = f"{labels['route'].strip(chr(34))}/{labels['reason'].strip(chr(34))}"
            out[key] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("epd_gateway_inline_patches_peak{"):
            out["inline_patches_peak"] = float(line.rsplit(" ", 1)[1])
    return out


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args) -> dict:
    import aiohttp

    from epdserve.testing.images import synthetic_image

    stack = GatewayStack("gateway-burst")
    model = stack.model
    policies = COMPARISONS[args.compare]
    rows, peaks = [], {}
    try:
        print(f"epd-bench gateway --scenario burst: starting (logs in {stack.log_dir})", flush=True)
        worker = stack.start(
            worker_extra=("--queue-items", str(args.queue_items), "--batch-items", "8"),
            images_per_prompt=args.images,
        )
        gateways = {
            policy: stack.start_gateway(
                f"gateway-{policy}", [worker.worker], extra=(*flags, "--intake-timeout-s", "1")
            )
            for policy, flags in policies.items()
        }
        stack.wait_ready()
        seed = [9000]

        def fresh() -> list[bytes]:
            seed[0] += args.images
            return [synthetic_image(args.size, args.size, seed[0] + i) for i in range(args.images)]

        async def bursts():
            async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=600),
                connector=aiohttp.TCPConnector(limit=0),
            ) as session:
                for role in gateways.values():  # one untimed request each (first-use costs)
                    await _request(session, role.url, model, fresh(), args.max_tokens)
                for round_index in range(args.rounds):
                    for policy in in_round(list(policies), round_index):
                        url = gateways[policy].url
                        async with session.get(url + "/metrics") as response:
                            before = _placements(await response.text())
                        answers = await asyncio.gather(
                            *(
                                _request(session, url, model, fresh(), args.max_tokens)
                                for _ in range(args.requests)
                            )
                        )
                        async with session.get(url + "/metrics") as response:
                            after = _placements(await response.text())
                        peaks[policy] = after.get("inline_patches_peak", 0.0)
                        rows.append(
                            {
                                "round": round_index,
                                "policy": policy,
                                "refused": sum(a["status"] == 503 for a in answers),
                                "other_errors": sum(a["status"] not in (200, 503) for a in answers),
                                "other_statuses": [
                                    a["status"] for a in answers if a["status"] not in (200, 503)
                                ],
                                "ttft_s": [a["ttft_s"] for a in answers if a["ttft_s"] is not None],
                                "placements": {
                                    key: after[key] - before.get(key, 0.0)
                                    for key in after
                                    if key != "inline_patches_peak"
                                },
                            }
                        )
                        print(
                            f"  round {round_index} {policy}: refused {rows[-1]['refused']}, "
                            f"placements {rows[-1]['placements']}",
                            flush=True,
                        )
                        await asyncio.sleep(args.pause_s)  # the worker's queue drains

        asyncio.run(bursts())
    finally:
        codes = stack.stop()
    summary = {}
    for policy in policies:
        mine = [row for row in rows if row["policy"] == policy]
        ttft = [t for row in mine for t in row["ttft_s"]]
        routes: dict[str, float] = {}
        for row in mine:
            for key, count in row["placements"].items():
                routes[key] = routes.get(key, 0.0) + count
        summary[policy] = {
            "flags": " ".join(policies[policy]),
            "requests": len(mine) * args.requests,
            "refused": sum(row["refused"] for row in mine),
            "other_errors": sum(row["other_errors"] for row in mine),
            "ttft_p50_s": _percentile(ttft, 0.5),
            "ttft_p99_s": _percentile(ttft, 0.99),
            "placements": routes,
            "inline_patches_peak": peaks.get(policy),
        }
    return {
        "config": {
            "compare": args.compare,
            "model": model,
            "requests": args.requests,
            "images": args.images,
            "size": args.size,
            "queue_items": args.queue_items,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
        },
        "summary": summary,
        "raw": rows,
        "exit_codes": codes,
    }


def main(args) -> int:
    report = run(args)
    for policy, row in report["summary"].items():
        p50, p99 = row["ttft_p50_s"], row["ttft_p99_s"]
        print(
            f"{policy:>9s} ({row['flags']}): refused "
            f"{row['refused']} of {row['requests']}; TTFT p50 / p99 "
            f"{p50 if p50 is None else round(p50, 3)} / {p99 if p99 is None else round(p99, 3)} s; "
            f"images {row['placements']}; inline patches peak {row['inline_patches_peak']}"
        )
    write_json(args.json, report)
    return 0 if all(code == 0 for code in report["exit_codes"].values()) else 1
