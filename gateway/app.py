"""The gateway's HTTP face: OpenAI's chat completions in front of encode workers and vLLM.

Per request (``Gateway.chat``): read the body (bounded), find its images and videos, load each
(``media``), hash and size each distinct one and place it on an encode worker (``dispatcher``),
rewrite the body so vLLM gets each placed item as its patch grid and identifier, with the rooms in
``ec_transfer_params`` (``chat.rewrite``), forward it to vLLM and relay the answer, streamed or
not. An item no worker took goes to vLLM inline (vLLM's own tower: colocated; a video is then
decoded and sampled by vLLM's own video loader). A request whose delivery fails inside vLLM (vLLM
answers 500, or its stream's first event is an error) is sent once more with every item inline
when ``retry_colocated``. A client that leaves, or a vLLM
refusal, cancels the request's rooms at once (the workers drop those items).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``; vLLM's own
errors are relayed as vLLM sent them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from PIL import Image
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ValidationError

from dispatcher.dispatch import Dispatcher
from dispatcher.media import DispatchedItem, DispatchError, Media
from dispatcher.workers import WorkerSet
from gateway.chat import (
    ChatRequest,
    ChatRequestError,
    EncodedMedia,
    InlineMedia,
    MediaRef,
    media_refs,
    rewrite,
)
from gateway.media import MediaError, MediaFetcher
from gateway.settings import GatewaySettings
from metrics import LATENCY_BUCKETS
from wire.ec_params import DeliveryReport, ItemDelivery, identifier
from wire.modality import Modality

log = logging.getLogger(__name__)


class GatewayMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        self.requests = Counter(
            "epd_gateway_requests",
            "Chat requests by outcome",
            labels + ["outcome"],
            registry=self.registry,
        )
        self.images = Counter(
            "epd_gateway_images",
            "Images and videos by who encoded them (encode_worker, colocated)",
            labels + ["encoder"],
            registry=self.registry,
        )
        self.colocated = Counter(
            "epd_gateway_colocated_fallbacks",
            "Images sent to vLLM inline instead of an encode worker, by reason",
            labels + ["reason"],
            registry=self.registry,
        )
        self.dispatch = Histogram(
            "epd_gateway_dispatch_seconds",
            "Request start -> every image placed",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_token = Histogram(
            "epd_gateway_time_to_first_token_seconds",
            "Request start -> first token relayed (streaming) or the answer",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "epd_gateway_requests_in_flight",
            "Chat requests being served now",
            labels,
            registry=self.registry,
        )
        self.model_name = model_name

    def count(self, outcome: str) -> None:
        self.requests.labels(self.model_name, outcome).inc()


class UpstreamRefusal(Exception):
    """vLLM answered another status than 200: relayed to the client as vLLM sent it."""

    def __init__(self, status: int, payload: bytes):
        super().__init__(f"vLLM answered {status}")
        self.status, self.payload = status, payload


class OpenAIError(Exception):
    """A refusal in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def response(self) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": str(self),
                    "type": self.kind,
                    "param": self.param,
                    "code": self.status,
                }
            },
            status_code=self.status,
        )


@dataclass
class _Prepared:
    """A request ready for vLLM: the client's body, its images and videos, and where each was
    placed."""

    request_id: str
    original: dict  # the client's body
    stream: bool
    refs: list[MediaRef] = field(default_factory=list)
    items: list[DispatchedItem] = field(default_factory=list)  # one per distinct item
    of_ref: list[int] = field(default_factory=list)  # the item of each image or video part
    dispatch_s: float = 0.0
    video_seconds: bool = False  # the model's positions take a video's seconds per patch

    @property
    def placed(self) -> list[DispatchedItem]:
        """The items an encode worker delivers (they have a room)."""
        return [item for item in self.items if item.worker is not None]

    def vllm_body(self) -> dict:
        """The body for vLLM as the items stand: a placed item as its grid and identifier, with
        its room in ``ec_transfer_params``; any other inline (vLLM encodes it)."""
        media, rooms = [], {}
        for ref, index in zip(self.refs, self.of_ref):
            item = self.items[index]
            if item.worker is not None:
                key = identifier(item.content_hash)
                seconds = item.seconds_per_grid_t if self.video_seconds else None
                media.append(EncodedMedia(key, item.grid_thw, ref.kind, seconds))
                rooms[key] = item.encode_handshake.model_dump()
            else:
                media.append(InlineMedia.of(ref, item.data, _media_type(item)))
        return rewrite(self.original, self.refs, media, rooms) if self.refs else self.original

    def report(self, delivery: DeliveryReport | None) -> GatewayReport:
        images = []
        for item in self.items:
            key = identifier(item.content_hash)
            images.append(
                ImageReport(
                    identifier=key,
                    encoder="encode_worker" if item.worker else "colocated",
                    worker=item.worker,
                    rows=item.rows,
                    error=item.error,
                    dispatch_ms=round(item.dispatch_s * 1e3, 3),
                    delivery=delivery.items.get(key) if delivery is not None else None,
                )
            )
        return GatewayReport(
            request_id=self.request_id, dispatch_ms=round(self.dispatch_s * 1e3, 3), images=images
        )


class ImageReport(BaseModel):
    """One distinct image of a request: who encoded it, and how its rows reached vLLM."""

    identifier: str  # its content hash, vLLM's identifier of the item
    encoder: Literal["encode_worker", "colocated"]
    worker: str | None  # the encode worker that took it
    rows: int
    error: str | None  # why it went to vLLM inline instead
    dispatch_ms: float  # request start -> the worker's acknowledgement
    delivery: ItemDelivery | None = None  # the EPD connector's report (non-streaming answers)


class GatewayReport(BaseModel):
    """The ``epd`` field the gateway adds to a non-streaming answer."""

    request_id: str  # the gateway's id (the encode workers' logs name items by it)
    dispatch_ms: float  # request start -> every image placed (or not)
    images: list[ImageReport]


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        processor,
        video_processor=None,
        registry: CollectorRegistry | None = None,
    ):
        """``processor`` / ``video_processor``: the checkpoint's (no video processor: videos are
        refused, 400)."""
        self.settings = settings
        family = settings.family()
        # the model's positions take a video's seconds per temporal patch (Qwen2.5-VL)
        self.video_seconds = video_processor is not None and family.video_seconds
        self.workers = WorkerSet(
            list(settings.workers), settings.dns, settings.bootstrap_port, settings.intake_port
        )
        self.dispatcher = Dispatcher(
            self.workers,
            processor,
            video_processor,
            rooms_url=settings.rooms_url,
            served_model=settings.served_model_name,
            handshake_token=settings.handshake_token,
            intake_token=settings.intake_token,
            sizing=family.sizing,
        )
        self.fetcher = MediaFetcher(
            settings.max_image_bytes,
            settings.fetch_timeout_s,
            settings.max_redirects,
            settings.allow_private_urls,
            settings.max_video_bytes,
        )
        self.metrics = GatewayMetrics(settings.served_model_name, registry)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout_s),
            connector=aiohttp.TCPConnector(limit=0),
        )
        await self.workers.refresh()
        self._spawn(self.workers.run())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.dispatcher.close()
        await self.workers.close()
        await self.fetcher.close()
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- one chat request -------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            body, chat = await self._read(request)
            prepared = await self._prepare(body, chat)
        except OpenAIError as exc:
            self.metrics.count("refused")
            return exc.response()
        except (
            Exception
        ) as exc:  # a fault of ours or a dependency's: still OpenAI's shape, and logged
            log.exception("chat request failed before vLLM was called")
            self.metrics.count("internal_error")
            return OpenAIError(
                500, f"internal error: {type(exc).__name__}", kind="internal_error"
            ).response()
        if prepared.stream:
            return await self._stream(request, prepared, started)
        return await self._complete(request, prepared, started)

    async def _read(self, request: Request) -> tuple[dict, ChatRequest]:
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.settings.max_body_bytes:
                raise OpenAIError(
                    413, f"request body larger than {self.settings.max_body_bytes} bytes"
                )
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise OpenAIError(400, f"request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object")
        try:
            return body, ChatRequest.model_validate(body)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise OpenAIError(400, f"{where}: {error['msg']}", param=where) from None

    async def _prepare(self, body: dict, chat: ChatRequest) -> _Prepared:
        try:
            refs = media_refs(chat)
        except ChatRequestError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from None
        prepared = _Prepared(
            f"gw-{uuid.uuid4().hex}", body, chat.stream, refs, video_seconds=self.video_seconds
        )
        if not refs:
            return prepared
        started = time.monotonic()
        loaded = await asyncio.gather(
            *(self.fetcher.load(ref.url, ref.kind) for ref in refs), return_exceptions=True
        )
        distinct: dict[Media, int] = {}
        for ref, data in zip(refs, loaded):
            if isinstance(data, MediaError):
                raise OpenAIError(400, f"{ref.param}: {data}", param=ref.param)
            if isinstance(data, BaseException):
                raise data
            media = Media(data, Modality[ref.kind.upper()])  # KINDS: the modalities in lower case
            prepared.of_ref.append(distinct.setdefault(media, len(distinct)))
        try:
            prepared.items = self.dispatcher.describe(
                list(distinct), [refs[prepared.of_ref.index(i)].param for i in range(len(distinct))]
            )
            await self.dispatcher.place(prepared.request_id, prepared.items, self.settings.near)
        except DispatchError as exc:
            raise OpenAIError(400, str(exc)) from None
        prepared.dispatch_s = time.monotonic() - started
        self.metrics.dispatch.labels(self.metrics.model_name).observe(prepared.dispatch_s)
        for item in prepared.items:
            self.metrics.images.labels(
                self.metrics.model_name, "encode_worker" if item.worker else "colocated"
            ).inc()
            if (
                item.worker is None
            ):  # no worker tried at all: none was healthy; else each tried one refused
                reason = "dispatch_failed" if item.attempts else "no_healthy_worker"
                self.metrics.colocated.labels(self.metrics.model_name, reason).inc()
        return prepared

    def _cancel(self, prepared: _Prepared, reason: str) -> None:
        if prepared.placed:
            self._spawn(self.dispatcher.cancel(prepared.placed, reason))

    async def _post(self, body: dict) -> aiohttp.ClientResponse:
        try:
            return await self._session.post(
                self.settings.vllm_url + "/v1/chat/completions", json=body
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise OpenAIError(
                502,
                f"vLLM at {self.settings.vllm_url} cannot be reached: {type(exc).__name__}: {exc}",
                kind="upstream_error",
            ) from None

    # ---- non-streaming ------------------------------------------------------------------------

    async def _until_client_leaves(
        self, request: Request, coroutine, prepared: _Prepared
    ) -> asyncio.Task | None:
        """The finished task of ``coroutine``, or None when the client left first: then the
        coroutine is cancelled (dropping the vLLM call makes vLLM abort the request) and so are
        the request's rooms."""
        work = asyncio.ensure_future(coroutine)
        left = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
        if work.done():
            return work
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        self._cancel(prepared, "the client disconnected")
        self.metrics.count("client_disconnected")
        return None

    def _upstream_failed(self, prepared: _Prepared, exc: OpenAIError | UpstreamRefusal) -> Response:
        self._cancel(prepared, str(exc))
        self.metrics.count("upstream_error")
        if isinstance(exc, UpstreamRefusal):
            return Response(exc.payload, status_code=exc.status, media_type="application/json")
        return exc.response()

    # ---- non-streaming ------------------------------------------------------------------------

    async def _complete(self, request: Request, prepared: _Prepared, started: float) -> Response:
        call = await self._until_client_leaves(request, self._call(prepared), prepared)
        if call is None:
            return Response(status_code=499)
        try:
            payload = call.result()
        except (OpenAIError, UpstreamRefusal) as exc:
            return self._upstream_failed(prepared, exc)
        self.metrics.first_token.labels(self.metrics.model_name).observe(time.monotonic() - started)
        self.metrics.count("ok")
        return Response(payload, media_type="application/json")

    async def _call(self, prepared: _Prepared) -> bytes:
        """vLLM's answer (``UpstreamRefusal`` for another status than 200); on a failed EPD
        delivery, once more with the images inline. The answer gets the ``epd`` report (where each
        image was encoded, and how it arrived)."""
        async with await self._post(prepared.vllm_body()) as response:
            status, payload = response.status, await response.read()
        if status == 500 and prepared.placed and self.settings.retry_colocated:
            self._fall_back_inline(prepared)
            async with await self._post(prepared.vllm_body()) as response:
                status, payload = response.status, await response.read()
        if status != 200:
            raise UpstreamRefusal(status, payload)
        try:
            answer = json.loads(payload)
            delivery = answer.pop("ec_transfer_params", None)
            report = prepared.report(DeliveryReport.model_validate(delivery) if delivery else None)
            answer["epd"] = report.model_dump(mode="json")
        except (ValueError, AttributeError) as exc:  # not the answer we know: relay vLLM's as it is
            log.warning(
                "request %s: vLLM's answer carries no delivery report we read: %s",
                prepared.request_id,
                exc,
            )
            return payload
        return json.dumps(answer).encode()

    def _fall_back_inline(self, prepared: _Prepared) -> None:
        """The request failed in vLLM with encode-worker images: from now on vLLM encodes them."""
        log.warning(
            "request %s failed in vLLM with encode-worker images; retrying with them inline",
            prepared.request_id,
        )
        for item in prepared.placed:
            self.metrics.colocated.labels(self.metrics.model_name, "delivery_failed").inc()
            item.worker, item.error = (
                None,
                f"delivery failed in vLLM (worker {item.worker}); vLLM encoded it",
            )

    # ---- streaming ----------------------------------------------------------------------------

    async def _stream(self, request: Request, prepared: _Prepared, started: float) -> Response:
        opened = await self._until_client_leaves(request, self._open(prepared), prepared)
        if opened is None:
            return Response(status_code=499)
        try:
            response, held, events = opened.result()
        except (OpenAIError, UpstreamRefusal) as exc:
            return self._upstream_failed(prepared, exc)
        return StreamingResponse(
            self._relay(response, held, events, prepared, started), media_type="text/event-stream"
        )

    async def _open(
        self, prepared: _Prepared
    ) -> tuple[aiohttp.ClientResponse, list[bytes], AsyncIterator[bytes]]:
        """vLLM's stream, its events up to the first token held back when a failed delivery must
        be retried inline (it shows up there as an error event); ``UpstreamRefusal`` for another
        status than 200. The stream is closed if this is cancelled (the client left)."""
        response = await self._post(prepared.vllm_body())
        try:
            if response.status != 200:
                raise UpstreamRefusal(response.status, await response.read())
            events, held = _events(response), []
            if not (prepared.placed and self.settings.retry_colocated):
                return response, held, events
            async for event in events:
                held.append(event)
                if _first_token_or_error(event) is not None:
                    break
            if not held or _first_token_or_error(held[-1]) != "error":
                return response, held, events
            response.close()
            self._fall_back_inline(prepared)
            response = await self._post(prepared.vllm_body())
            if response.status != 200:
                raise UpstreamRefusal(response.status, await response.read())
            return response, [], _events(response)
        except BaseException:
            response.close()
            raise

    async def _relay(
        self,
        response: aiohttp.ClientResponse,
        held: list[bytes],
        events: AsyncIterator[bytes],
        prepared: _Prepared,
        started: float,
    ) -> AsyncIterator[bytes]:
        outcome, waiting_first = "client_disconnected", True
        try:
            async for event in _chain(held, events):
                if waiting_first and _first_token_or_error(event) == "token":
                    waiting_first = False
                    self.metrics.first_token.labels(self.metrics.model_name).observe(
                        time.monotonic() - started
                    )
                yield event
            outcome = "ok"
        except (
            aiohttp.ClientError
        ) as exc:  # vLLM's side of the stream broke: the client's ends here too
            log.warning("request %s: vLLM's stream broke: %s", prepared.request_id, exc)
            outcome = "upstream_error"
            error = {
                "message": f"vLLM's stream broke: {type(exc).__name__}",
                "type": "upstream_error",
                "param": None,
                "code": 502,
            }
            yield f"data: {json.dumps({'error': error})}\n\n".encode()
        finally:
            response.close()  # before the end: vLLM sees the connection drop and aborts the request
            if outcome != "ok":
                self._cancel(prepared, outcome.replace("_", " "))
            self.metrics.count(outcome)

    # ---- the rest of the API ------------------------------------------------------------------

    async def models(self) -> Response:
        try:
            async with self._session.get(self.settings.vllm_url + "/v1/models") as response:
                return Response(
                    await response.read(),
                    status_code=response.status,
                    media_type="application/json",
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return OpenAIError(
                502,
                f"vLLM at {self.settings.vllm_url} cannot be reached: {exc}",
                kind="upstream_error",
            ).response()

    async def backend_ready(self) -> bool:
        try:
            async with self._session.get(
                self.settings.vllm_url + "/health", timeout=aiohttp.ClientTimeout(total=2)
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already: the next message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _chain(held: list[bytes], events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for event in held:
        yield event
    async for event in events:
        yield event


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """Server-sent events, each with its blank line, as vLLM wrote them."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buffer.strip():
        yield buffer


def _first_token_or_error(event: bytes) -> str | None:
    """ "token" for an event with generated text or a finish, "error" for an error event, else
    None."""
    if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
        return None
    try:
        data = json.loads(event[6:])
    except ValueError:
        return None
    if "error" in data:
        return "error"
    for choice in data.get("choices") or ():
        if (choice.get("delta") or {}).get("content") or choice.get("finish_reason"):
            return "token"
    return None


def _media_type(item: DispatchedItem) -> str:
    if item.modality is Modality.VIDEO:
        return "video/mp4"
    return Image.MIME.get(item.image_format, "application/octet-stream")


class InFlightLimit:
    """ASGI middleware: at most ``max_in_flight`` chat requests at once, counted from the first
    byte of the request to the last byte of the answer (a stream included); one more is refused at
    once with 503 and ``Retry-After``."""

    def __init__(self, app, gateway: Gateway):
        self.app, self.gateway = app, gateway
        self.count = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        limit = self.gateway.settings.max_in_flight
        if self.count >= limit:
            self.gateway.metrics.count("overloaded")
            refusal = OpenAIError(
                503,
                f"the gateway serves {limit} requests at once (--max-in-flight); retry shortly",
                kind="overloaded",
            ).response()
            refusal.headers["Retry-After"] = "1"
            return await refusal(scope, receive, send)
        gauge = self.gateway.metrics.in_flight.labels(self.gateway.metrics.model_name)
        self.count += 1
        gauge.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1
            gauge.dec()


def build_app(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(title="EPD gateway", version="1", lifespan=lifespan)
    app.add_middleware(InFlightLimit, gateway=gateway)
    app.state.gateway = gateway

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.chat(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return await gateway.models()

    @app.get("/health")
    @app.get("/healthz")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def ready() -> Response:
        if await gateway.backend_ready():
            return JSONResponse({"status": "ready", "encode_workers": gateway.workers.status()})
        return JSONResponse(
            {"status": f"vLLM at {gateway.settings.vllm_url} is not healthy"}, status_code=503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
