"""`epd-dispatch`: send a request's images and videos to encode workers and print the prefill
request (or, with ``--prefill``, what a reference prefill process received).

    epd-dispatch --model DIR --workers 10.0.0.5:8990:8999 a.png b.jpg clip.mp4
    epd-dispatch --model DIR --dns epd-encode-workers.default.svc.cluster.local \\
        --prefill http://prefill:9100 a.png

``--model`` is read for its image and video processor configs only (rows per item). Every flag
also reads ``EPD_DISPATCH_<FLAG>`` from the environment. Exit status: 0 when every item was placed
(and, with ``--prefill``, the prefill process received every one); 1 otherwise, or for a mistake
in the command line, which is one line on stderr.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from typing import ClassVar, NoReturn

from pydantic import Field
from pydantic_settings import CliPositionalArg, SettingsConfigDict

from epdserve.dispatcher.settings import EncodeWorkerTargets, HttpUrl
from epdserve.process_settings import SettingError, check_checkpoint, exit_process, refuse

VIDEO_SUFFIXES = {".mp4", ".mov", ".m4v"}


class DispatchSettings(EncodeWorkerTargets):
    """Send a request's images to encode workers and print the prefill request (or, with --prefill,
    what a reference prefill process received)."""

    model_config = SettingsConfigDict(env_prefix="EPD_DISPATCH_")
    PROG: ClassVar[str] = "epd-dispatch"

    images: CliPositionalArg[list[str]] = Field(
        min_length=1, description="image files (PNG, JPEG, WebP, BMP, GIF) and videos (MP4, MOV)"
    )
    prefill: HttpUrl = Field(
        None, description="reference prefill URL to post the request to (epd-prefill)"
    )
    verify: bool = Field(
        False, description="ask the prefill process to check every item against its own tower"
    )
    request_id: str = Field("req-1", min_length=1, description="request id")


def prefill_body(request_id: str, items, verify: bool) -> dict:
    """The `POST /v1/prefill` body for dispatched items: consecutive placeholder spans."""
    from epdserve.wire.modality import Modality

    body, start = [], 0
    for item in items:
        body.append(
            {
                "modality": item.modality.name,
                "offsets": [[start, start + item.rows - 1]],
                "grid_thw": list(item.grid_thw),
                "encode_handshake": item.encode_handshake.model_dump()
                if item.encode_handshake
                else None,
                "image_b64": base64.b64encode(item.data).decode()
                if verify and item.modality is Modality.IMAGE
                else None,
            }
        )
        start += item.rows
    return {"request_id": request_id, "items": body, "verify": verify}


def _read_files(paths: list[str]) -> list[bytes]:
    """Every file the command line names, read (one it cannot read is refused)."""
    contents = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                contents.append(f.read())
        except OSError as exc:
            raise SettingError(f"{path}: {exc.strerror}") from None
    return contents


def _media(paths: list[str], contents: list[bytes]) -> list:
    """The files as media: a video by its suffix (.mp4, .mov, .m4v), else an image."""
    from epdserve.dispatcher.media import Media
    from epdserve.wire.modality import Modality

    return [
        Media(
            data,
            Modality.VIDEO
            if os.path.splitext(path)[1].lower() in VIDEO_SUFFIXES
            else Modality.IMAGE,
        )
        for path, data in zip(paths, contents)
    ]


async def run(args: DispatchSettings) -> int:
    # a file it cannot read and a --model that is no checkpoint directory are refused before
    # torch and transformers are imported (in a fraction of a second), in this order
    contents = _read_files(args.images)
    check_checkpoint(args.model, weights=False)
    import aiohttp

    from epdserve.dispatcher.dispatch import Dispatcher
    from epdserve.dispatcher.media import DispatchError
    from epdserve.dispatcher.workers import WorkerSet

    images = _media(args.images, contents)
    workers = WorkerSet(list(args.workers), args.dns, args.bootstrap_port, args.intake_port)
    dispatcher = Dispatcher(
        workers,
        args.image_processor(),
        args.video_processor(),
        rooms_url=args.rooms_url,
        served_model=args.served_model_name,
        handshake_token=args.handshake_token,
        intake_token=args.intake_token,
        intake_timeout_s=args.intake_timeout_s,
        sizing=args.family().sizing,
        max_image_pixels=args.max_image_pixels,
    )
    try:
        try:
            dispatcher.describe(images, args.images)  # refuse a bad file before any worker is asked
        except DispatchError as exc:
            raise SettingError(str(exc)) from None
        await workers.refresh()
        items = await dispatcher.dispatch(
            args.request_id, images, near=args.near, names=args.images
        )
        dispatched = [
            {
                "image": path,
                "rows": item.rows,
                "grid_thw": item.grid_thw,
                "worker": item.worker,
                "content_hash": f"{item.content_hash:032x}",
                "error": item.error,
                "dispatch_ms": round(item.dispatch_s * 1e3, 3),
                "encode_handshake": item.encode_handshake.model_dump()
                if item.encode_handshake
                else None,
            }
            for path, item in zip(args.images, items)
        ]
        output = {"workers": workers.status(), "items": dispatched}
        failed = [
            f"{path}: {item.error}"
            for path, item in zip(args.images, items)
            if item.error is not None
        ]
        if args.prefill:
            output["prefill"] = await _post(
                args.prefill,
                prefill_body(args.request_id, items, args.verify),
                args.handshake_token,
            )
            failed += [
                f"{_name(args.images, report.get('index'))}: prefill {report.get('state')}: "
                f"{report.get('reason')}"
                for report in output["prefill"].get("items", [])
                if report.get("state") != "DONE"
            ]
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
        print(f"{DispatchSettings.PROG}: {line}", file=sys.stderr)
    return 1 if failed else 0


def _name(paths: list[str], index) -> str:
    return paths[index] if isinstance(index, int) and 0 <= index < len(paths) else f"item {index}"


async def _post(url: str, body: dict, token: str | None) -> dict:
    """``POST /v1/prefill`` (``token``: the handshake token, epd-prefill's bearer): the prefill
    process's report; an answer that is not one is an error."""
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.post(url.rstrip("/") + "/v1/prefill", json=body) as response:
            text = await response.text()
            if response.status != 200:
                raise SettingError(f"--prefill {url} answered {response.status}: {text[:300]}")
            try:
                return json.loads(text)
            except ValueError:
                raise SettingError(
                    f"--prefill {url} answered 200 with no JSON report: {text[:300]}"
                ) from None


def main(argv: list[str] | None = None) -> NoReturn:
    """Dispatch, print, and end the process with the exit status (through ``exit_process``: its
    clients are closed by then)."""
    try:
        status = asyncio.run(run(DispatchSettings.from_command_line(argv)))
    except SettingError as exc:
        status = refuse(DispatchSettings.PROG, exc)
    exit_process(status)


if __name__ == "__main__":
    main()
