"""The gateway's HTTP face: OpenAI's chat completions in front of encode workers and vLLM.

Before any request: what vLLM runs is read from vLLM itself and followed (``readiness``); the
gateway is ready once it knows the engine and has probed its workers.

Per request (``Gateway.chat``): read the body (bounded), find its images and videos, load each
(``media``), hash and size each distinct one and place it on an encode worker (``dispatcher``; an
item no worker took, or one the workers refused as busy within ``--max-inline-patches``, goes to
vLLM inline, else the request is refused: ``placement``), then forward it to vLLM once the workers
hold every placed item's rows and relay the answer, streamed or not (``upstream``: the body
rewritten so vLLM gets each placed item as its patch grid and identifier, or, for a model vLLM
takes no request of grids alone for, as the item itself and its identifier, with the rooms in
``ec_transfer_params``, ``prepared``, ``chat.rewrite``; a failed delivery retried inline; the
rooms cancelled when the client leaves or vLLM refuses). At most ``--max-in-flight`` requests at
once (``InFlightLimit``).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``; vLLM's own errors
are relayed as vLLM sent them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from epdserve.bearer_auth import BearerAuth
from epdserve.dispatcher.media import DispatchError, Media
from epdserve.dispatcher.staged import StagedWatch
from epdserve.dispatcher.workers import WorkerSet
from epdserve.gateway.chat import BodyBudget, ChatRequest, ChatRequestError, media_refs, read_chat
from epdserve.gateway.engine_load import EngineLoad
from epdserve.gateway.errors import OpenAIError
from epdserve.gateway.media import MediaError, MediaFetcher
from epdserve.gateway.metrics import GatewayMetrics
from epdserve.gateway.placement import InlineBudget, PlacementCosts, Placements
from epdserve.gateway.prepared import PreparedChat
from epdserve.gateway.readiness import Readiness
from epdserve.gateway.settings import GatewaySettings
from epdserve.gateway.upstream import Forwarder, Upstream
from epdserve.wire.modality import BY_VLLM_NAME

log = logging.getLogger(__name__)


class Gateway:
    """One gateway process: its encode workers, vLLM's engine followed (``readiness``), and each
    chat request read, placed (``placements``) and forwarded (``forwarder``)."""

    def __init__(
        self,
        settings: GatewaySettings,
        registry: CollectorRegistry | None = None,
        on_refusal=lambda reason: None,
    ):
        """``on_refusal(reason)``: called once when the gateway's flags or checkpoint disagree
        with the engine's (the process then stops: ``epd-gateway`` exits 1); until then, and
        after, the gateway is not ready."""
        self.settings = settings
        self.workers = WorkerSet(
            list(settings.workers), settings.dns, settings.bootstrap_port, settings.intake_port
        )
        self.metrics = GatewayMetrics(settings.served_model_name, registry)
        self.load = EngineLoad(settings.vllm_url, self.metrics, settings.vllm_api_key)
        self.readiness = Readiness(settings, self.workers, self.load, on_refusal)
        self.reading = BodyBudget(settings.max_receiving_bytes)
        self.fetcher = MediaFetcher(
            settings.max_image_bytes,
            settings.fetch_timeout_s,
            settings.max_redirects,
            settings.allow_private_urls,
            settings.max_video_bytes,
        )
        self.inline = InlineBudget(settings.max_inline_patches)
        self.costs = PlacementCosts()
        self.placements = Placements(
            settings.placement, self.inline, self.costs, self.metrics, self.load
        )
        self.upstream = Upstream(
            settings.vllm_url, settings.request_timeout_s, settings.vllm_api_key
        )
        # rooms at a standalone authority say nothing of the workers' rows: no wait then
        self.staged = (
            StagedWatch(settings.handshake_token, lost=self.readiness.worker_lost)
            if settings.stage_wait_s > 0 and settings.rooms_url is None
            else None
        )
        self.forwarder = Forwarder(
            self.upstream, settings, self.staged, self.placements, self.metrics, self._cancel
        )
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.upstream.start()
        self._spawn(self.readiness.follow())
        self._spawn(self.workers.run())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.readiness.dispatcher is not None:
            await self.readiness.dispatcher.close()
        if self.staged is not None:
            await self.staged.close()
        await self.workers.close()
        await self.fetcher.close()
        await self.upstream.close()

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def not_ready(self) -> str | None:
        """Why the gateway should get no requests now, or None (``Readiness.not_ready``)."""
        return self.readiness.not_ready()

    # ---- one chat request -------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        started = time.monotonic()
        limit = request.scope.get(InFlightLimit.SCOPE_KEY)
        if limit is not None and limit.full():  # refused before its body is read
            return limit.refusal()
        try:
            try:
                async with asyncio.timeout(self.settings.body_timeout_s):
                    body, chat = await read_chat(
                        request, self.settings.max_body_bytes, self.reading
                    )
            except TimeoutError:  # a slow (or stalled) upload holds no more than this
                raise OpenAIError(
                    408, f"request body not received within {self.settings.body_timeout_s} s"
                ) from None
            except ClientDisconnect:  # the client hung up while sending: nobody to answer
                self.metrics.count("client_disconnected")
                return Response(status_code=400)
            if limit is not None and not limit.admit(request.scope):
                return limit.refusal()
            # counted in vLLM's load from here: a placement decided meanwhile sees it
            self.load.admitted += 1
            try:
                prepared = await self._prepare(body, chat)
            except BaseException:
                self.load.admitted -= 1
                raise
            # the request's end releases its inline patches at the latest, even where its stream
            # never started (the client gone before its first byte), and leaves vLLM's load
            request.scope[InFlightLimit.ON_END] = lambda: self._ended(prepared)
        except OpenAIError as exc:
            self.metrics.count("overloaded" if exc.kind == "overloaded" else "refused")
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
            return await self.forwarder.stream(request, prepared, started)
        return await self.forwarder.complete(request, prepared, started)

    async def _prepare(self, body: dict, chat: ChatRequest) -> PreparedChat:
        try:
            refs = media_refs(chat)
        except ChatRequestError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from None
        readiness = self.readiness
        if refs and (readiness.engine is None or readiness.refused is not None):
            raise OpenAIError(
                503,
                f"the gateway is not ready: {self.not_ready()}",
                kind="overloaded",
                retry_after_s=1,
            )
        self._within_limits(refs)
        prepared = PreparedChat(
            f"gw-{uuid.uuid4().hex}",
            body,
            chat.stream,
            refs,
            video_seconds=readiness.video_seconds,
            video_timestamps=readiness.video_timestamps,
            grid_only_requests=readiness.grid_only_requests,
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
            media = Media(data, BY_VLLM_NAME[ref.kind])
            prepared.of_ref.append(distinct.setdefault(media, len(distinct)))
        try:
            dispatcher = readiness.dispatcher
            prepared.items = dispatcher.describe(
                list(distinct),
                [refs[prepared.of_ref.index(i)].param for i in range(len(distinct))],
                vllm_decodes=True,
            )
            if not self.placements.decided_inline(prepared):
                await dispatcher.place(prepared.request_id, prepared.items, self.settings.near)
        except DispatchError as exc:
            raise OpenAIError(400, str(exc)) from None
        prepared.dispatch_s = time.monotonic() - started
        self.metrics.dispatch.labels(self.metrics.model_name).observe(prepared.dispatch_s)
        try:
            self.placements.overflow(prepared)
        except OpenAIError:  # refused whole: the rooms of its placed items are not needed
            self._cancel(prepared, "the encode workers are busy: request refused")
            raise
        self.placements.dispatched(prepared, self.workers.states())
        return prepared

    def _ended(self, prepared: PreparedChat) -> None:
        """A prepared request has ended (its answer sent, or not): once."""
        self.placements.ended(prepared)
        self.load.admitted -= 1

    def _within_limits(self, refs: list) -> None:
        """vLLM's per-prompt limits (as vLLM says them), checked before any worker encodes an
        item vLLM would refuse the request for."""
        engine = self.readiness.engine
        limits = engine.limits if engine is not None else {}
        for kind, limit in limits.items():
            count = sum(ref.kind == kind for ref in refs)
            if count > limit:
                raise OpenAIError(
                    400,
                    f"At most {limit} {kind}(s) may be provided in one prompt, got {count} "
                    "(vLLM's --limit-mm-per-prompt)",
                )

    def _cancel(self, prepared: PreparedChat, reason: str) -> None:
        if prepared.placed:
            self._spawn(self.readiness.dispatcher.cancel(prepared.placed, reason))


class InFlightLimit:
    """ASGI middleware: at most ``max_in_flight`` chat requests at once, counted from the moment
    a request's body is in (``Gateway.chat`` admits it then: a slow upload holds no place) to
    the last byte of the answer (a stream included); one more is refused at once with 503 and
    ``Retry-After``. A request's end, however it ends, also calls what the gateway left in its
    scope at ``ON_END``."""

    SCOPE_KEY = "epd.in_flight"  # the limit, in a chat request's ASGI scope
    ADMITTED = "epd.admitted"
    ON_END = "epd.on_end"  # called once the request has ended (its answer sent, or not)

    def __init__(self, app, gateway: Gateway):
        self.app, self.gateway = app, gateway
        self.count = 0
        self.gauge = gateway.metrics.in_flight.labels(gateway.metrics.model_name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        scope[self.SCOPE_KEY] = self
        try:
            await self.app(scope, receive, send)
        finally:
            on_end = scope.get(self.ON_END)
            if on_end is not None:
                on_end()
            if scope.get(self.ADMITTED):
                self.count -= 1
                self.gauge.dec()

    def full(self) -> bool:
        return self.count >= self.gateway.settings.max_in_flight

    def admit(self, scope) -> bool:
        """Count the request in (its body is in); False when ``max_in_flight`` are already."""
        if self.count >= self.gateway.settings.max_in_flight:
            return False
        self.count += 1
        self.gauge.inc()
        scope[self.ADMITTED] = True
        return True

    def refusal(self) -> Response:
        limit = self.gateway.settings.max_in_flight
        self.gateway.metrics.count("overloaded")
        return OpenAIError(
            503,
            f"the gateway serves {limit} requests at once (--max-in-flight); retry shortly",
            kind="overloaded",
            retry_after_s=1,
        ).response()


def build_app(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    docs = gateway.settings.docs
    app = FastAPI(
        title="EPD gateway",
        version="1",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.add_middleware(InFlightLimit, gateway=gateway)
    # clients' /v1 calls carry the API key (--api-key-file), as vLLM's --api-key asks
    app.add_middleware(BearerAuth, token=gateway.settings.api_key)
    app.state.gateway = gateway

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Routing's own answers (404 unknown path, 405 wrong method) in OpenAI's error shape,
        as vLLM's server gives them."""
        response = OpenAIError(exc.status_code, str(exc.detail)).response()
        response.headers.update(exc.headers or {})
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.chat(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return await gateway.upstream.models()

    @app.get("/health")
    @app.get("/healthz")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def ready() -> Response:
        """Ready once the gateway knows vLLM's engine, has probed its workers and vLLM is
        healthy; each worker's state either way (an incompatible one with what differs)."""
        workers = gateway.workers.status()
        engine = gateway.readiness.engine
        model = (
            {
                "engine": {
                    "model_type": engine.description.fingerprint.model_type,
                    "fingerprint": engine.fingerprint,
                }
            }
            if engine is not None
            else {}
        )
        reason = gateway.not_ready()
        if reason is None and not await gateway.upstream.ready():
            reason = f"vLLM at {gateway.settings.vllm_url} is not healthy"
        if reason is not None:
            return JSONResponse(
                {"status": reason, **model, "encode_workers": workers}, status_code=503
            )
        return JSONResponse({"status": "ready", **model, "encode_workers": workers})

    @app.get("/metrics")
    async def metrics() -> Response:
        gateway.metrics.workers_now(gateway.workers.states())
        gateway.metrics.inline_now(gateway.inline.patches, gateway.inline.peak)
        gateway.load.exported()
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
