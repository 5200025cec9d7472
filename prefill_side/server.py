"""`epd-prefill`: a reference prefill process around the receiver library (HTTP, FastAPI).

``POST /v1/prefill`` takes a request's items (placeholder offsets + ``encode_handshake``, and
optionally the image bytes for fallback or verification), receives every item's rows, and
reports per item: rows x width, transport, latency, outcome, and whether the rows equal a local
tower's (``verify``, needs ``--model``). It is what the demo, the integration tests and the
Kubernetes example run, and it shows engine developers the few calls an engine makes:
``receiver.start(request_id, mm_inputs)``, then ``job.poll()`` from the engine loop.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field

from data_plane.json_fields import json_float, json_int
from multimodal.items import Modality, MultimodalDataItem, MultimodalInputs
from multimodal.wire import EncodeHandshake
from prefill_side.receiver import PrefillReceiver, ReceiverConfig

MAX_IMAGE_B64 = 48 << 20


class PrefillItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    offsets: list[tuple[json_int(ge=0), json_int(ge=0)]] = Field(min_length=1, max_length=64)
    encode_handshake: EncodeHandshake | None = None
    image_b64: str | None = Field(default=None, max_length=MAX_IMAGE_B64)


class PrefillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=128)
    items: list[PrefillItem] = Field(min_length=1, max_length=64)
    verify: bool = False
    timeout_s: json_float(gt=0, le=600) = 60.0


class ItemReport(BaseModel):
    index: int
    state: str
    rows: int | None
    width: int | None
    transport: str | None
    seconds: float
    reason: str | None
    fallback: bool
    verified: bool | None


class PrefillResponse(BaseModel):
    request_id: str
    state: str
    items: list[ItemReport]


def create_app(receiver: PrefillReceiver, local_tower=None) -> FastAPI:
    app = FastAPI(title="EPD reference prefill", version="1",
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False})

    @app.post("/v1/prefill", response_model=PrefillResponse, responses={400: {"description": "Malformed JSON"}})
    async def prefill(body: PrefillRequest):
        """Receive every item's rows; report per item."""
        items = []
        for entry in body.items:
            feature = base64.b64decode(entry.image_b64) if entry.image_b64 else None
            items.append(MultimodalDataItem(Modality.IMAGE, offsets=[list(span) for span in entry.offsets],
                                            feature=feature,
                                            encode_handshake=entry.encode_handshake.model_dump()
                                            if entry.encode_handshake else None))
        job = receiver.start(body.request_id, MultimodalInputs(items))
        try:
            await asyncio.wait_for(asyncio.wrap_future(job.future), body.timeout_s)
        except asyncio.TimeoutError:
            job.cancel("prefill request timed out")
            await asyncio.wrap_future(job.future)
        reports = []
        for item, outcome in zip(items, job.outcomes):
            verified = None
            if body.verify and local_tower is not None and item.encoded is not None and item.feature is not None:
                expected = await asyncio.get_running_loop().run_in_executor(None, receiver.encode_locally, item)
                verified = bool(torch.equal(_wire_rows(item), expected))
            encoded = item.encoded
            reports.append(ItemReport(index=outcome.index, state=outcome.state,
                                      rows=encoded.shape[0] if encoded is not None else None,
                                      width=_wire_rows(item).shape[1] if encoded is not None else None,
                                      transport=outcome.transport, seconds=outcome.seconds, reason=outcome.reason,
                                      fallback=outcome.fallback, verified=verified))
        return Response(PrefillResponse(request_id=body.request_id, state=job.poll().value,
                                        items=reports).model_dump_json(), media_type="application/json")

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(generate_latest(receiver.registry), media_type="text/plain; version=0.0.4")

    return app


def _wire_rows(item: MultimodalDataItem) -> torch.Tensor:
    if item.encoded_deepstack is not None:
        return torch.cat([item.encoded, item.encoded_deepstack], dim=1)
    return item.encoded


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epd-prefill", description=__doc__.split("\n\n")[0])
    env = os.environ.get
    parser.add_argument("--host", default=env("EPD_PREFILL_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(env("EPD_PREFILL_PORT", "9100")))
    parser.add_argument("--model", default=env("EPD_MODEL"), help="checkpoint for verification / fallback; "
                        "also gives --width and --deepstack-width")
    parser.add_argument("--width", type=int, default=int(env("EPD_WIDTH", "0")), help="wire width of one row")
    parser.add_argument("--deepstack-width", type=int, default=int(env("EPD_DEEPSTACK_WIDTH", "0")))
    parser.add_argument("--dtype", default=env("EPD_DTYPE", "bfloat16"))
    parser.add_argument("--transports", default=env("EPD_TRANSPORTS", "shm,mooncake"))
    parser.add_argument("--pool-bytes", type=int, default=int(env("EPD_POOL_BYTES", str(1 << 30))))
    parser.add_argument("--slot-bytes", type=int, default=int(env("EPD_SLOT_BYTES", str(1 << 20))))
    parser.add_argument("--item-timeout-s", type=float, default=float(env("EPD_ITEM_TIMEOUT_S", "60")))
    parser.add_argument("--fallback", choices=("fail", "local_tower"), default=env("EPD_FALLBACK", "fail"))
    parser.add_argument("--token-file", default=env("EPD_HANDSHAKE_TOKEN_FILE"))
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    from handshake.server import load_token

    tower = None
    width, deepstack = args.width, args.deepstack_width
    if args.model:
        from encode_worker.tower import VisionTower

        tower = VisionTower.load(args.model, dtype=args.dtype)
        width = width or tower.info.wire_width
        deepstack = deepstack or tower.info.out_width * tower.info.deepstack_levels
    if width <= 0:
        raise SystemExit("epd-prefill: give --width (or --model to read it from the checkpoint)")
    config = ReceiverConfig(width=width, dtype=args.dtype, deepstack_width=deepstack, pool_bytes=args.pool_bytes,
                            slot_bytes=args.slot_bytes, transports=tuple(t for t in args.transports.split(",") if t),
                            item_timeout_s=args.item_timeout_s, fallback=args.fallback,
                            handshake_token=load_token(args.token_file))
    receiver = PrefillReceiver(config, local_tower=tower)
    try:
        uvicorn.run(create_app(receiver, tower), host=args.host, port=args.port, log_level="warning")
    finally:
        receiver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
