"""`epd-prefill`: a reference prefill process around the receiver library (HTTP, FastAPI).

``POST /v1/prefill`` takes a request's items (placeholder offsets + ``encode_handshake``, and
optionally the image bytes for fallback or verification), receives every item's rows, and
reports per item: rows x width, transport, latency (with the encode worker's own split from its
commit), outcome, and whether the rows equal a local tower's (``verify``, needs ``--model``).
An item with image bytes and no ``encode_handshake`` is encoded here by the local tower, as a
colocated engine would (transport ``local``); its rows must match its placeholders, as on the wire.
A request that reaches its ``timeout_s`` is answered 200 with its report: the items not yet settled
are FAILED ("timed out ..."), their rooms cancelled, their slots freed or quarantined as their rooms
end. ``/healthz`` is 503 once the process cannot receive at all (no transport left: restart it),
``/readyz`` also while no receive slot is free; both report the transports offered and lost.
It is what the demo, the integration tests and the Kubernetes example run, and it shows engine
developers the few calls an engine makes: ``receiver.start(request_id, mm_inputs)``, then
``job.poll()`` from the engine loop.
"""

from __future__ import annotations

import asyncio
import base64
import os
import sys
import threading
import time
from typing import ClassVar, Literal

import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from data_plane.commit import checksum
from handshake.app import BodyLimit
from metrics import exposition_registry
from multimodal.items import GRID_KEYS, MultimodalDataItem, MultimodalInputs
from multimodal.rows import RowContractError
from prefill_side import PrefillReceiver, ReceiverConfig
from prefill_side.settings import ReceiverSettings
from process_settings import (
    Dtype,
    NonNegativeInt,
    Port,
    PositiveByteSize,
    PositiveInt,
    SettingError,
    refuse,
)
from process_settings.groups import ModelNaming, MooncakeReceiver
from process_settings.secrets import HandshakeToken
from wire.addresses import EncodeHandshake
from wire.json_fields import JsonBool, json_float, json_int
from wire.modality import EncodedModality, Modality
from wire.rooms import EncodeTimings
from wire.states import ItemState

MAX_IMAGE_B64 = 48 << 20
MAX_BODY_BYTES = 256 << 20  # a request's whole body: items, and image bytes when they travel


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
        items = []
        for index, entry in enumerate(body.items):
            try:
                feature = (
                    base64.b64decode(entry.image_b64, validate=True) if entry.image_b64 else None
                )
            except ValueError:  # answered in the shape of the 422 the schema declares
                return JSONResponse(
                    {
                        "detail": [
                            {
                                "type": "value_error",
                                "loc": ["body", "items", index, "image_b64"],
                                "msg": "image_b64 is not base64",
                            }
                        ]
                    },
                    status_code=422,
                )
            items.append(
                MultimodalDataItem(
                    entry.modality,
                    offsets=[list(span) for span in entry.offsets],
                    feature=feature,
                    model_specific_data={
                        GRID_KEYS[entry.modality]: torch.tensor([list(entry.grid_thw)])
                    }
                    if entry.grid_thw
                    else {},
                    encode_handshake=entry.encode_handshake.model_dump()
                    if entry.encode_handshake
                    else None,
                )
            )
        job = receiver.start(body.request_id, MultimodalInputs(items))
        ended = asyncio.wrap_future(job.future)
        # asyncio.wait, not wait_for: a timed-out wait_for cancels the wrapper, and with it the
        # job's own future (the request then got a 500 instead of its report)
        if not (await asyncio.wait({ended}, timeout=body.timeout_s))[0]:
            job.abort(
                f"timed out: not received within the request's timeout_s ({body.timeout_s:g} s)"
            )
            await ended  # at once: abort settles every item
        if local_tower is not None:
            await _encode_colocated(receiver, job)
        reports = []
        for item, outcome in zip(items, job.outcomes):
            verified = None
            if (
                body.verify
                and local_tower is not None
                and item.encoded is not None
                and item.feature is not None
                and outcome.transport != "local"
            ):
                try:
                    expected = await asyncio.get_running_loop().run_in_executor(
                        None, receiver.encode_locally, item
                    )
                    verified = bool(torch.equal(_wire_rows(item), expected))
                except (
                    RowContractError
                ):  # the local tower's processor disagrees on the rows or the grid
                    verified = False
            encoded = item.encoded
            wire = _wire_rows(item) if encoded is not None else None
            reports.append(
                ItemReport(
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
            )
        return Response(
            PrefillResponse(
                request_id=body.request_id,
                state=job.poll().value,
                items=reports,
                started_monotonic=job.started,
            ).model_dump_json(),
            media_type="application/json",
        )

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


class PrefillSettings(HandshakeToken, ReceiverSettings, MooncakeReceiver, ModelNaming):
    """Reference prefill process: receives each item's rows from the encode workers. Rows arrive in
    the encode workers' dtype: --dtype must be theirs, and --width their tower's row width (--model
    gives it). A mismatch fails every item."""

    model_config = SettingsConfigDict(env_prefix="EPD_PREFILL_")
    PROG: ClassVar[str] = "epd-prefill"

    host: str = Field("0.0.0.0", min_length=1, description="address to listen on")
    port: Port = Field(9100, description="port of /v1/prefill, /healthz, /readyz, /metrics")
    model: str | None = Field(
        None,
        description="checkpoint for verification / fallback; also gives --width and "
        "--deepstack-width",
    )
    width: NonNegativeInt = Field(
        0, description="wire width of one row (the encode workers' tower's; default: from --model)"
    )
    deepstack_width: NonNegativeInt = Field(
        0, description="the last columns of a row that are DeepStack levels (default: from --model)"
    )
    dtype: Dtype = Field(
        "bfloat16",
        description="dtype of the rows: the encode workers' --dtype (bfloat16, float16, float32)",
    )
    fallback: Literal["fail", "local_tower"] = Field(
        "fail",
        description="an item whose rows do not arrive: fail it, or encode it here (needs --model)",
    )
    tower_calls: PositiveInt = Field(
        1,
        description="local tower forward passes at once (colocated items, fallback, verification)",
    )
    max_body_bytes: PositiveByteSize = Field(
        MAX_BODY_BYTES, description="largest accepted request body"
    )

    @model_validator(mode="after")
    def _consistent(self) -> PrefillSettings:
        if self.slot_bytes > self.pool_bytes:
            raise SettingError(
                f"--slot-bytes {self.slot_bytes} is larger than --pool-bytes {self.pool_bytes}"
            )
        return self


def _start(settings: PrefillSettings):
    """Check every setting, load the tower, reserve the pool: ``(receiver, tower)``, or
    ``SettingError`` with the one line to print."""
    from data_plane.shm import ShmError
    from data_plane.transport import TransportUnavailable, build_transports
    from process_settings import check_checkpoint, check_listen, check_memory, check_shm_space
    from wire.offers import transport_spec

    check_listen(settings.host, settings.port, "--port")
    check_memory(settings.pool_bytes, "--pool-bytes")
    # with a transport that does not need it (Mooncake), a full /dev/shm falls back to process
    # memory
    if all(transport_spec(name).needs_shm_pool for name in settings.transports):
        check_shm_space(settings.pool_bytes, "--pool-bytes")
    tower = None
    width, deepstack = settings.width, settings.deepstack_width
    if settings.model:
        from vision.tower import TowerLoadError, VisionTower

        directory = check_checkpoint(settings.model)
        try:
            tower = TowerCalls(
                VisionTower.load(
                    directory, settings.dtype, processor_kwargs=settings.mm_processor_kwargs
                ),
                settings.tower_calls,
            )
        except (TowerLoadError, OSError, ValueError) as exc:
            raise SettingError(
                f"--model {settings.model}: cannot load the vision tower: {exc}"
            ) from None
        for flag, given, own in (
            ("--width", width, tower.info.wire_width),
            ("--deepstack-width", deepstack, tower.info.out_width * tower.info.deepstack_levels),
        ):
            if given and given != own:
                raise SettingError(
                    f"{flag} {given} differs from the checkpoint's ({own}); leave it out"
                )
        width, deepstack = tower.info.wire_width, tower.info.out_width * tower.info.deepstack_levels
    if width <= 0:
        raise SettingError("give --width (or --model to read it from the checkpoint)")
    if deepstack >= width:
        raise SettingError(
            f"--deepstack-width {deepstack} leaves no main embedding in rows of {width}"
        )
    try:
        config = ReceiverConfig(
            **settings.receiver_settings(),
            width=width,
            dtype=settings.dtype,
            deepstack_width=deepstack,
            fallback=settings.fallback,
            handshake_token=settings.handshake_token,
        )
        # Mooncake advertises the address encode workers reach (the pod IP), not loopback.
        mooncake = settings.mooncake_config(settings.mooncake_host)
        receiver = PrefillReceiver(
            config,
            build_transports(config.transports, {"mooncake": mooncake}, optional=True),
            local_tower=tower,
        )
    except (TransportUnavailable, ShmError, ValueError) as exc:  # no usable transport or pool
        raise SettingError(f"cannot start: {exc}") from None
    return receiver, tower


def main(argv: list[str] | None = None) -> int:
    """Every setting is checked first: a mistake is one line on stderr and exit status 1."""
    import logging

    from handshake.server import serve

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = PrefillSettings.from_command_line(argv)
        receiver, tower = _start(settings)
    except SettingError as exc:
        return refuse(PrefillSettings.PROG, exc)
    config = receiver.config
    logging.getLogger("epd-prefill").info(
        "epd-prefill ready: http://%s:%d (/v1/prefill, /healthz, /readyz, /metrics); rows of %d x "
        "%s; "
        "transports %s (Mooncake host %s); local tower %s",
        settings.host,
        settings.port,
        config.width,
        config.dtype,
        ",".join(receiver.transports),
        settings.mooncake_host,
        settings.model or "none",
    )
    try:
        app = create_app(receiver, tower, settings.max_body_bytes, settings.served_model_name)
        serve(app, settings.host, settings.port)
    finally:
        receiver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
