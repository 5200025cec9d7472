"""``epd-prefill``'s HTTP API: ``POST /v1/prefill`` (a request's items received, each reported),
``/healthz``, ``/readyz``, ``/metrics``; and the local tower it encodes colocated items with."""

from __future__ import annotations

import asyncio
import base64
import threading
import time

import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from epdserve.bearer_auth import BearerAuth
from epdserve.data_plane.commit import checksum
from epdserve.metrics import exposition_registry
from epdserve.multimodal.items import GRID_KEYS, MultimodalDataItem, MultimodalInputs
from epdserve.multimodal.rows import RowContractError
from epdserve.prefill_server.settings import MAX_BODY_BYTES
from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.json_fields import JsonBool, json_float, json_int
from epdserve.wire.modality import EncodedModality, Modality
from epdserve.wire.rooms import EncodeTimings
from epdserve.wire.states import ItemState
from handshake.app import BodyLimit
from prefill_side import PrefillReceiver
from prefill_side.job import ItemOutcome, ReceiveJob

MAX_IMAGE_B64 = 48 << 20


class PrefillItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    modality: EncodedModality = Modality.IMAGE
    offsets: list[tuple[json_int(ge=0), json_int(ge=0)]] = Field(min_length=1, max_length=64)
    encode_handshake: EncodeHandshake | None = None
    # an image's file, for the local tower (fallback, verify); videos are received only
    image_b64: str | None = Field(default=None, max_length=MAX_IMAGE_B64)
    # the patch grid the request expects; a commit with another one fails the item
    grid_thw: (
        tuple[json_int(ge=1, le=65536), json_int(ge=1, le=65536), json_int(ge=1, le=65536)] | None
    ) = None

    @model_validator(mode="after")
    def _image_bytes_for_images(self) -> PrefillItem:
        if self.image_b64 is not None and self.modality is not Modality.IMAGE:
            raise ValueError("image_b64 is for image items: a video item's rows are received only")
        return self


class PrefillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=128)
    items: list[PrefillItem] = Field(min_length=1, max_length=64)
    verify: JsonBool = False
    # how long to wait for the encode workers; past it, the items not yet settled are FAILED
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
    encoder: EncodeTimings | None = None  # the encode worker's split of its part (from the commit)
    checksum: int | None = (
        None  # xxh3-64 of the published wire rows, for checks against a reference
    )


class PrefillResponse(BaseModel):
    request_id: str
    state: str
    items: list[ItemReport]
    # when the job started, on this host's monotonic clock (CLOCK_MONOTONIC, shared by the processes
    # of one host): an item settled at started_monotonic + seconds
    started_monotonic: float | None = None


def create_app(
    receiver: PrefillReceiver,
    local_tower=None,
    max_body_bytes: int = MAX_BODY_BYTES,
    model_name: str | None = None,
) -> FastAPI:
    """The reference prefill API over ``receiver``; ``model_name`` labels every metric family."""
    served = exposition_registry(receiver.registry, model_name)
    app = FastAPI(
        title="EPD reference prefill",
        version="1",
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
    )
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    # /v1/prefill takes the handshake token as its bearer, as the room API does
    app.add_middleware(BearerAuth, token=receiver.config.handshake_token)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, exc: RequestValidationError):
        # FastAPI's own answer echoes each bad input, and an out-of-range number (1e400 parses as
        # inf) cannot be written back as JSON: that was a 500, and the connection closed
        errors = [
            {key: error[key] for key in ("type", "loc", "msg") if key in error}
            for error in exc.errors()
        ]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.post(
        "/v1/prefill",
        response_model=PrefillResponse,
        responses={400: {"description": "Malformed JSON"}},
    )
    async def prefill(body: PrefillRequest):
        """Receive every item's rows; report per item."""
        try:
            items = _data_items(body.items)
        except _NotBase64 as bad:
            return bad.answer()
        job = receiver.start(body.request_id, MultimodalInputs(items))
        await _settled(job, body.timeout_s)
        if local_tower is not None:
            await _encode_colocated(receiver, job)
        verify = body.verify and local_tower is not None
        reports = []
        for item, outcome in zip(items, job.outcomes):
            verified = await _verified(receiver, item, outcome) if verify else None
            reports.append(_report(item, outcome, verified))
        report = PrefillResponse(
            request_id=body.request_id,
            state=job.poll().value,
            items=reports,
            started_monotonic=job.started,
        )
        return Response(report.model_dump_json(), media_type="application/json")

    liveness_errors = {503: {"description": "No transport left: this process cannot receive"}}

    @app.get("/health", responses=liveness_errors)  # as vLLM and SGLang name it
    @app.get("/healthz", responses=liveness_errors)
    async def healthz():
        """Liveness: 503 once the process can never receive again (restart it)."""
        health = receiver.health()
        return JSONResponse(
            {"ok": health["cannot_receive"] is None, **_summary(health)},
            status_code=503 if health["cannot_receive"] else 200,
        )

    @app.get(
        "/readyz", responses={503: {"description": "Cannot take an item now, with the reason"}}
    )
    async def readyz():
        """Readiness: 503 while no receive slot is free (or no transport is left), with the
        reason."""
        health = receiver.health()
        return JSONResponse(
            {
                "ready": health["not_ready"] is None,
                "reason": health["not_ready"],
                **_summary(health),
            },
            status_code=503 if health["not_ready"] else 200,
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return Response(generate_latest(served), media_type="text/plain; version=0.0.4")

    return app


def _summary(health: dict) -> dict:
    stats = health["pool"]
    return {
        "transports": health["transports"],
        "lost": health["lost"],
        "pool": {
            key: stats[key] for key in ("slots", "free_slots", "leased_slots", "quarantined_slots")
        },
    }


class _NotBase64(ValueError):
    """An item's ``image_b64`` that is not base64."""

    def __init__(self, index: int):
        super().__init__(f"item {index}: image_b64 is not base64")
        self.index = index

    def answer(self) -> JSONResponse:
        """In the shape of the 422 the schema declares."""
        error = {
            "type": "value_error",
            "loc": ["body", "items", self.index, "image_b64"],
            "msg": "image_b64 is not base64",
        }
        return JSONResponse({"detail": [error]}, status_code=422)


def _data_items(entries: list[PrefillItem]) -> list[MultimodalDataItem]:
    """The receiver's items for a request's (their image bytes decoded); ``_NotBase64`` names the
    first whose ``image_b64`` is not base64."""
    items = []
    for index, entry in enumerate(entries):
        try:
            feature = base64.b64decode(entry.image_b64, validate=True) if entry.image_b64 else None
        except ValueError:
            raise _NotBase64(index) from None
        grid = entry.grid_thw
        grids = {GRID_KEYS[entry.modality]: torch.tensor([list(grid)])} if grid else {}
        handshake = entry.encode_handshake.model_dump() if entry.encode_handshake else None
        offsets = [list(span) for span in entry.offsets]
        items.append(
            MultimodalDataItem(
                entry.modality,
                offsets=offsets,
                feature=feature,
                model_specific_data=grids,
                encode_handshake=handshake,
            )
        )
    return items


async def _settled(job: ReceiveJob, timeout_s: float) -> None:
    """Until every item of ``job`` has settled; past ``timeout_s`` the job is aborted (the items not
    yet settled FAILED, with why)."""
    ended = asyncio.wrap_future(job.future)
    # asyncio.wait, not wait_for: a timed-out wait_for cancels the wrapper, and with it the job's
    # own future (the request then got a 500 instead of its report)
    if not (await asyncio.wait({ended}, timeout=timeout_s))[0]:
        job.abort(f"timed out: not received within the request's timeout_s ({timeout_s:g} s)")
        await ended  # at once: abort settles every item


async def _verified(
    receiver: PrefillReceiver, item: MultimodalDataItem, outcome: ItemOutcome
) -> bool | None:
    """Whether the rows received for ``item`` are the local tower's for its image (False when the
    local processor disagrees on the rows or the grid); None for an item with nothing to compare:
    no rows, no image bytes, or rows the local tower made itself."""
    if item.encoded is None or item.feature is None or outcome.transport == "local":
        return None
    try:
        expected = await asyncio.get_running_loop().run_in_executor(
            None, receiver.encode_locally, item
        )
        return bool(torch.equal(_wire_rows(item), expected))
    except RowContractError:
        return False


def _report(item: MultimodalDataItem, outcome: ItemOutcome, verified: bool | None) -> ItemReport:
    """One item's report: its outcome, the rows it ended with and their checksum."""
    encoded = item.encoded
    wire = _wire_rows(item) if encoded is not None else None
    return ItemReport(
        index=outcome.index,
        state=outcome.state,
        rows=encoded.shape[0] if encoded is not None else None,
        width=wire.shape[1] if wire is not None else None,
        transport=outcome.transport,
        seconds=outcome.seconds,
        reason=outcome.reason,
        fallback=outcome.fallback,
        verified=verified,
        encoder=outcome.encoder,
        checksum=checksum(wire) if wire is not None else None,
    )


async def _encode_colocated(receiver: PrefillReceiver, job) -> None:
    """Items that came with image bytes and no room: this process's own tower encodes them, in
    one batch (item by item if the batch fails, so a bad image fails only itself)."""
    local = [
        (item, outcome)
        for item, outcome in zip(job.inputs.mm_items, job.outcomes)
        if outcome.state == ItemState.SKIPPED
        and item.encoded is None
        and isinstance(item.feature, bytes)
    ]
    if not local:
        return
    loop = asyncio.get_running_loop()
    items = [item for item, _ in local]
    try:
        rows = await loop.run_in_executor(None, receiver.encode_locally_batch, items)
    except Exception:  # a bad image: encode item by item, so it fails alone
        rows = [await _encode_one(loop, receiver, item) for item in items]
    for (item, outcome), item_rows in zip(local, rows):
        if isinstance(item_rows, Exception):
            outcome.state, outcome.reason = ItemState.FAILED, f"local tower failed: {item_rows}"
            continue
        receiver.set_encoded(item, item_rows)
        outcome.state, outcome.transport = ItemState.DONE, "local"
        outcome.seconds = time.monotonic() - job.started


async def _encode_one(loop, receiver: PrefillReceiver, item) -> torch.Tensor | Exception:
    try:
        return await loop.run_in_executor(None, receiver.encode_locally, item)
    except Exception as exc:
        return exc


def _wire_rows(item: MultimodalDataItem) -> torch.Tensor:
    if item.encoded_deepstack is not None:
        return torch.cat([item.encoded, item.encoded_deepstack], dim=1)
    return item.encoded


class TowerCalls:
    """A ``VisionTower`` that runs at most ``calls`` forward passes at once (colocated items,
    fallback, verification); decoding and preprocessing stay concurrent. With 1, as an engine's
    model runner runs its encoder, and as an encode worker runs its tower (one encode thread)."""

    def __init__(self, tower, calls: int):
        self.tower = tower
        self._calls = threading.BoundedSemaphore(calls)

    def __getattr__(self, name: str):
        return getattr(self.tower, name)

    def encode_items(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> list[torch.Tensor]:
        with self._calls:
            return self.tower.encode_items(pixel_values, grid_thw)
