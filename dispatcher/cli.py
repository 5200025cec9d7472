"""`epd-dispatch`: send a request's images to encode workers and print the prefill request (or,
with ``--prefill``, what a reference prefill process received).

    epd-dispatch --model DIR --workers 10.0.0.5:8998:8999 a.png b.jpg
    epd-dispatch --model DIR --dns epd-encode-workers.default.svc.cluster.local --prefill http://prefill:9100 a.png

``--model`` is read for its image processor config only (rows per image). Every flag also reads
``EPD_DISPATCH_<FLAG>`` from the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys

FLAGS = [
    # (flag, type, default, help)
    ("--model", str, None, "checkpoint directory whose image processor config the encode workers use"),
    ("--served-model", str, None, "model name to put in intake messages (workers refuse other models)"),
    ("--workers", str, "", "static workers: comma-separated host[:bootstrap_port[:intake_port]]"),
    ("--dns", str, "", "DNS name listing the workers (a Kubernetes headless Service)"),
    ("--bootstrap-port", int, 8998, "workers' bootstrap (rooms) port, with --dns"),
    ("--intake-port", int, 8999, "workers' intake port, with --dns"),
    ("--rooms-url", str, "", "standalone handshake endpoint for all rooms (default: each item's worker)"),
    ("--near", str, "", "host of the prefill engine: its encode workers go first (same-node SHM)"),
    ("--prefill", str, "", "reference prefill URL to post the request to (epd-prefill)"),
    ("--verify", int, 0, "1 = ask the prefill process to check every item against its own tower"),
    ("--request-id", str, "req-1", "request id"),
    ("--token-file", str, None, "handshake bearer token file (or $EPD_HANDSHAKE_TOKEN[_FILE])"),
    ("--intake-token-file", str, None, "intake token file (or $EPD_INTAKE_TOKEN)"),
]


def env_name(flag: str) -> str:
    return "EPD_DISPATCH_" + flag.lstrip("-").replace("-", "_").upper()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd-dispatch", description=__doc__.split("\n\n")[0],
                                     epilog="Each flag also reads EPD_DISPATCH_<FLAG> from the environment.")
    for flag, kind, default, text in FLAGS:
        value = os.environ.get(env_name(flag))
        parser.add_argument(flag, type=kind, default=kind(value) if value is not None else default,
                            help=f"{text} [{env_name(flag)}]")
    parser.add_argument("images", nargs="+", help="image files (PNG, JPEG, WebP, BMP)")
    return parser


def prefill_body(request_id: str, items, verify: bool) -> dict:
    """The `POST /v1/prefill` body for dispatched items: consecutive placeholder spans."""
    body, start = [], 0
    for item in items:
        body.append({"offsets": [[start, start + item.rows - 1]], "grid_thw": list(item.grid_thw),
                     "encode_handshake": item.encode_handshake.model_dump() if item.encode_handshake else None,
                     "image_b64": base64.b64encode(item.image).decode() if verify else None})
        start += item.rows
    return {"request_id": request_id, "items": body, "verify": verify}


async def run(args) -> int:
    import aiohttp
    from transformers import AutoImageProcessor

    from dispatcher.dispatch import Dispatcher
    from dispatcher.workers import WorkerAddress, WorkerSet
    from handshake.server import load_token

    if not args.model:
        raise SystemExit("epd-dispatch: --model (or EPD_DISPATCH_MODEL) is required")
    static = [WorkerAddress.parse(w) for w in args.workers.split(",") if w.strip()]
    workers = WorkerSet(static, args.dns or None, args.bootstrap_port, args.intake_port)
    intake_token = None
    if args.intake_token_file:
        with open(args.intake_token_file) as f:
            intake_token = f.read().strip()
    dispatcher = Dispatcher(workers, AutoImageProcessor.from_pretrained(args.model, local_files_only=True),
                            rooms_url=args.rooms_url or None, served_model=args.served_model,
                            handshake_token=load_token(args.token_file),
                            intake_token=intake_token or os.environ.get("EPD_INTAKE_TOKEN") or None)
    images = []
    for path in args.images:
        with open(path, "rb") as f:
            images.append(f.read())
    try:
        await workers.refresh()
        items = await dispatcher.dispatch(args.request_id, images, near=args.near or None)
        dispatched = [{"image": path, "rows": item.rows, "grid_thw": item.grid_thw, "worker": item.worker,
                       "content_hash": f"{item.content_hash:032x}", "error": item.error,
                       "dispatch_ms": round(item.dispatch_s * 1e3, 3),
                       "encode_handshake": item.encode_handshake.model_dump() if item.encode_handshake else None}
                      for path, item in zip(args.images, items)]
        output = {"workers": workers.status(), "items": dispatched}
        if args.prefill:
            async with aiohttp.ClientSession() as session:
                async with session.post(args.prefill.rstrip("/") + "/v1/prefill",
                                        json=prefill_body(args.request_id, items, bool(args.verify))) as response:
                    output["prefill"] = await response.json()
        else:
            output["prefill_request"] = prefill_body(args.request_id, items, False)
    finally:
        await dispatcher.close()
        await workers.close()
    print(json.dumps(output, indent=2))
    return 0 if all(item.error is None for item in items) else 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
