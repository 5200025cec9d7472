"""`epd-dispatch`: send a request's images to encode workers and print the prefill request (or,
with ``--prefill``, what a reference prefill process received).

    epd-dispatch --model DIR --workers 10.0.0.5:8998:8999 a.png b.jpg
    epd-dispatch --model DIR --dns epd-encode-workers.default.svc.cluster.local --prefill http://prefill:9100 a.png

``--model`` is read for its image processor config only (rows per image). Every flag also reads
``EPD_DISPATCH_<FLAG>`` from the environment. Exit status: 0 when every item was placed (and,
with ``--prefill``, the prefill process received every one); 1 otherwise, or for a mistake in
the command line, which is one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys

from handshake.settings import (
    SettingError,
    check_checkpoint,
    env_var,
    flag_parser,
    handshake_token,
    port,
    read_secret,
    refuse,
    switch,
)

PROG = "epd-dispatch"
FLAGS = [
    # (flag, type, default, help)
    ("--model", str, None, "checkpoint directory whose image processor config the encode workers use"),
    ("--served-model", str, None, "model name to put in intake messages (workers refuse other models)"),
    ("--workers", str, "", "static workers: comma-separated host[:bootstrap_port[:intake_port]], "
                           "e.g. 10.0.0.5,10.0.0.6:9000:9001"),
    ("--dns", str, "", "DNS name listing the workers (a Kubernetes headless Service)"),
    ("--bootstrap-port", port, 8998, "workers' bootstrap (rooms) port, with --dns"),
    ("--intake-port", port, 8999, "workers' intake port, with --dns"),
    ("--rooms-url", str, "", "standalone handshake endpoint for all rooms (default: each item's worker)"),
    ("--near", str, "", "host of the prefill engine: its encode workers go first (same-node SHM)"),
    ("--prefill", str, "", "reference prefill URL to post the request to (epd-prefill)"),
    ("--verify", switch, "0", "1 = ask the prefill process to check every item against its own tower"),
    ("--request-id", str, "req-1", "request id"),
    ("--token-file", str, None, "handshake bearer token file (or $EPD_HANDSHAKE_TOKEN[_FILE])"),
    ("--intake-token-file", str, None, "intake token file (or $EPD_INTAKE_TOKEN)"),
]


def env_name(flag: str) -> str:
    return env_var("EPD_DISPATCH_", flag)


def build_parser() -> argparse.ArgumentParser:
    parser = flag_parser(PROG, __doc__.split("\n\n")[0], "EPD_DISPATCH_", FLAGS)
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


def _http_url(text: str, flag: str) -> str:
    import yarl

    url = yarl.URL(text)
    if url.scheme not in ("http", "https") or not url.host:
        raise SettingError(f"{flag} {text!r} is not an http:// URL")
    return text.rstrip("/")


def _setup(args):
    """Everything the command line names, checked: (workers, dispatcher, images, tokens)."""
    from dispatcher.workers import WorkerAddress

    if not args.model:
        raise SettingError("--model (or EPD_DISPATCH_MODEL) is required")
    check_checkpoint(args.model)
    try:
        static = [WorkerAddress.parse(w) for w in args.workers.split(",") if w.strip()]
    except ValueError as exc:
        raise SettingError(f"--workers: {exc}") from None
    if not static and not args.dns:
        raise SettingError("give the encode workers: --workers host[:bootstrap_port[:intake_port]],... or --dns NAME")
    for flag in ("--rooms-url", "--prefill"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value:
            _http_url(value, flag)
    images = []
    for path in args.images:
        try:
            with open(path, "rb") as f:
                images.append(f.read())
        except OSError as exc:
            raise SettingError(f"{path}: {exc.strerror}") from None
    intake_token = (read_secret(args.intake_token_file, "--intake-token-file") if args.intake_token_file
                    else os.environ.get("EPD_INTAKE_TOKEN") or None)
    return static, images, handshake_token(args.token_file), intake_token


def _processor(model: str):
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise SettingError(f"--model {model}: cannot read its image processor config: {exc}") from None


async def run(args) -> int:
    import aiohttp

    from dispatcher.dispatch import Dispatcher, DispatchError
    from dispatcher.workers import WorkerSet

    static, images, token, intake_token = _setup(args)
    workers = WorkerSet(static, args.dns or None, args.bootstrap_port, args.intake_port)
    dispatcher = Dispatcher(workers, _processor(args.model), rooms_url=args.rooms_url or None,
                            served_model=args.served_model, handshake_token=token, intake_token=intake_token)
    try:
        try:
            dispatcher.describe(images, args.images)  # refuse a bad file before any worker is asked
        except DispatchError as exc:
            raise SettingError(str(exc)) from None
        await workers.refresh()
        items = await dispatcher.dispatch(args.request_id, images, near=args.near or None, names=args.images)
        dispatched = [{"image": path, "rows": item.rows, "grid_thw": item.grid_thw, "worker": item.worker,
                       "content_hash": f"{item.content_hash:032x}", "error": item.error,
                       "dispatch_ms": round(item.dispatch_s * 1e3, 3),
                       "encode_handshake": item.encode_handshake.model_dump() if item.encode_handshake else None}
                      for path, item in zip(args.images, items)]
        output = {"workers": workers.status(), "items": dispatched}
        failed = [f"{path}: {item.error}" for path, item in zip(args.images, items) if item.error is not None]
        if args.prefill:
            output["prefill"] = await _post(args.prefill, prefill_body(args.request_id, items, args.verify))
            failed += [f"{_name(args.images, report.get('index'))}: prefill {report.get('state')}: "
                       f"{report.get('reason')}" for report in output["prefill"].get("items", [])
                       if report.get("state") != "DONE"]
            if output["prefill"].get("state") != "DONE" and not failed:
                failed.append(f"prefill answered {output['prefill'].get('state')}")
        else:
            output["prefill_request"] = prefill_body(args.request_id, items, False)
    except DispatchError as exc:
        raise SettingError(str(exc)) from None
    except aiohttp.ClientError as exc:
        raise SettingError(f"--prefill {args.prefill}: {type(exc).__name__}: {exc}") from None
    finally:
        await dispatcher.close()
        await workers.close()
    print(json.dumps(output, indent=2))
    for line in failed:
        print(f"{PROG}: {line}", file=sys.stderr)
    return 1 if failed else 0


def _name(paths: list[str], index) -> str:
    return paths[index] if isinstance(index, int) and 0 <= index < len(paths) else f"item {index}"


async def _post(url: str, body: dict) -> dict:
    """``POST /v1/prefill``: the prefill process's report; an answer that is not one is an error."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(url.rstrip("/") + "/v1/prefill", json=body) as response:
            text = await response.text()
            if response.status != 200:
                raise SettingError(f"--prefill {url} answered {response.status}: {text[:300]}")
            try:
                return json.loads(text)
            except ValueError:
                raise SettingError(f"--prefill {url} answered 200 with no JSON report: {text[:300]}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(run(args))
    except SettingError as exc:
        return refuse(PROG, exc)


if __name__ == "__main__":
    sys.exit(main())
