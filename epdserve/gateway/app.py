"""The gateway's HTTP face: OpenAI's chat completions in front of encode workers and vLLM.

Before any request: what vLLM runs is read from vLLM itself and followed (``readiness``); the
gateway is ready once it knows the engine and has probed its workers.

Per request (``Gateway.chat``): read the body (bounded), find its images and videos, load each
(``media``), hash and size each distinct one and place it on an encode worker (``dispatcher``),
rewrite the body so vLLM gets each placed item as its patch grid and identifier, with the rooms in
``ec_transfer_params`` (``chat.rewrite``), wait until the workers hold every placed item's rows
(``stage_wait_s``: vLLM then waits for a write, not an encode), forward it to vLLM and relay the
answer, streamed or not. An item no worker took goes to vLLM inline (vLLM's own tower: colocated; a
video is then decoded and sampled by vLLM's own video loader); one the workers refused as busy
overflows inline within ``--max-inline-patches``, past which the request is refused (503,
Retry-After) (``placement``). A request whose delivery fails inside
vLLM (vLLM answers 500, or its stream's first event is an error) is sent once more with every item
inline when ``retry_colocated``. A client that leaves, or a vLLM refusal, cancels the request's
rooms at once (the workers drop those items).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``; vLLM's own errors
are relayed as vLLM sent them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
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
from epdserve.gateway.errors import OpenAIError, UpstreamRefusal
from epdserve.gateway.media import MediaError, MediaFetcher
from epdserve.gateway.metrics import GatewayMetrics
from epdserve.gateway.placement import InlineBudget, PlacementCosts, Placements, Reason
from epdserve.gateway.prepared import PreparedChat
from epdserve.gateway.readiness import Readiness
from epdserve.gateway.settings import GatewaySettings
from epdserve.gateway.upstream import (
    FINISHING,
    Upstream,
    chain_events,
    first_token_or_error,
    server_events,
    with_report,
)
from epdserve.wire.ec_params import DeliveryReport
from epdserve.wire.modality import BY_VLLM_NAME

log = logging.getLogger(__name__)


class Gateway:
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
        self.readiness = Readiness(settings, self.workers, on_refusal)
        self.reading = BodyBudget(settings.max_receiving_bytes)
        self.fetcher = MediaFetcher(
            settings.max_image_bytes,
            settings.fetch_timeout_s,
            settings.max_redirects,
            settings.allow_private_urls,
            settings.max_video_bytes,
        )
        self.metrics = GatewayMetrics(settings.served_model_name, registry)
        self.inline = InlineBudget(settings.max_inline_patches)
        self.costs = PlacementCosts()
        self.placements = Placements(settings.placement, self.inline, self.costs, self.metrics)
        self.upstream = Upstream(
            settings.vllm_url, settings.request_timeout_s, settings.vllm_api_key
        )
        # rooms at a standalone authority say nothing of the workers' rows: no wait then
        self.staged = (
            StagedWatch(settings.handshake_token, lost=self.readiness.worker_lost)
            if settings.stage_wait_s > 0 and settings.rooms_url is None
            else None
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
            prepared = await self._prepare(body, chat)
            # the request's end releases its inline patches at the latest, even where its stream
            # never started (the client gone before its first byte)
            request.scope[InFlightLimit.ON_END] = lambda: self.placements.release_inline(prepared)
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
            return await self._stream(request, prepared, started)
        return await self._complete(request, prepared, started)

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

    # ---- non-streaming ------------------------------------------------------------------------

    async def _until_client_leaves(
        self, request: Request, coroutine, prepared: PreparedChat
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

    def _upstream_failed(
        self, prepared: PreparedChat, exc: OpenAIError | UpstreamRefusal
    ) -> Response:
        self._cancel(prepared, str(exc))
        self.metrics.count("upstream_error")
        if isinstance(exc, UpstreamRefusal):
            return Response(exc.payload, status_code=exc.status, media_type="application/json")
        return exc.response()

    # ---- non-streaming ------------------------------------------------------------------------

    async def _complete(self, request: Request, prepared: PreparedChat, started: float) -> Response:
        try:
            call = await self._until_client_leaves(request, self._call(prepared), prepared)
        finally:
            self.placements.release_inline(prepared)
        if call is None:
            return Response(status_code=499)
        try:
            payload = call.result()
        except (OpenAIError, UpstreamRefusal) as exc:
            return self._upstream_failed(prepared, exc)
        self.placements.first_token(prepared, started)
        self.metrics.count("ok")
        return Response(payload, media_type="application/json")

    async def _until_staged(self, prepared: PreparedChat) -> None:
        """Until the encode workers hold the rows of every placed item (or ``stage_wait_s``
        passed): vLLM then waits for a write, not an encode. An item whose room ended instead
        (the worker failed it) goes to vLLM inline."""
        if self.staged is None or not prepared.placed:
            return
        started = time.monotonic()
        ended = await self.staged.until_staged(prepared.placed, self.settings.stage_wait_s)
        prepared.staged_s = time.monotonic() - started
        self.metrics.staged.labels(self.metrics.model_name).observe(prepared.staged_s)
        for item in prepared.placed:
            reason = ended.get(item.index)
            if reason is not None:
                item.worker, item.error = (
                    None,
                    f"the encode worker ({item.worker}) failed it, {reason}; vLLM encoded it",
                )
                self.placements.send_inline(prepared, item, Reason.ENCODE_FAILED, moved=True)

    async def _call(self, prepared: PreparedChat) -> bytes:
        """vLLM's answer (``UpstreamRefusal`` for another status than 200); on a failed EPD
        delivery, once more with the images inline. The answer gets the ``epd`` report (where each
        image was encoded, and how it arrived)."""
        await self._until_staged(prepared)
        async with await self.upstream.post(prepared.vllm_body()) as response:
            status, payload = response.status, await response.read()
        if status == 500 and prepared.placed and self.settings.retry_colocated:
            self._fall_back_inline(prepared)
            async with await self.upstream.post(prepared.vllm_body()) as response:
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

    def _fall_back_inline(self, prepared: PreparedChat) -> None:
        """The request failed in vLLM with encode-worker images: from now on vLLM encodes them."""
        log.warning(
            "request %s failed in vLLM with encode-worker images; retrying with them inline",
            prepared.request_id,
        )
        for item in prepared.placed:
            item.worker, item.error = (
                None,
                f"delivery failed in vLLM (worker {item.worker}); vLLM encoded it",
            )
            self.placements.send_inline(prepared, item, Reason.DELIVERY_FAILED, moved=True)

    # ---- streaming ----------------------------------------------------------------------------

    async def _stream(self, request: Request, prepared: PreparedChat, started: float) -> Response:
        try:
            opened = await self._until_client_leaves(request, self._open(prepared), prepared)
        except BaseException:
            self.placements.release_inline(prepared)
            raise
        if opened is None:
            self.placements.release_inline(prepared)
            return Response(status_code=499)
        try:
            response, held, events = opened.result()
        except (OpenAIError, UpstreamRefusal) as exc:
            self.placements.release_inline(prepared)
            return self._upstream_failed(prepared, exc)
        return StreamingResponse(
            self._relay(response, held, events, prepared, started), media_type="text/event-stream"
        )

    async def _open(
        self, prepared: PreparedChat
    ) -> tuple[aiohttp.ClientResponse, list[bytes], AsyncIterator[bytes]]:
        """vLLM's stream, its events up to the first token held back when a failed delivery must
        be retried inline (it shows up there as an error event); ``UpstreamRefusal`` for another
        status than 200. The stream is closed if this is cancelled (the client left)."""
        await self._until_staged(prepared)
        response = await self.upstream.post(prepared.vllm_body())
        try:
            if response.status != 200:
                raise UpstreamRefusal(response.status, await response.read())
            events, held = server_events(response), []
            if not (prepared.placed and self.settings.retry_colocated):
                return response, held, events
            async for event in events:
                held.append(event)
                if first_token_or_error(event) is not None:
                    break
            if not held or first_token_or_error(held[-1]) != "error":
                return response, held, events
            response.close()
            self._fall_back_inline(prepared)
            response = await self.upstream.post(prepared.vllm_body())
            if response.status != 200:
                raise UpstreamRefusal(response.status, await response.read())
            return response, [], server_events(response)
        except BaseException:
            response.close()
            raise

    async def _relay(
        self,
        response: aiohttp.ClientResponse,
        held: list[bytes],
        events: AsyncIterator[bytes],
        prepared: PreparedChat,
        started: float,
    ) -> AsyncIterator[bytes]:
        outcome, waiting_first = "client_disconnected", True
        report = None
        try:
            async for event in chain_events(held, events):
                if FINISHING in event:  # a completion's last chunk carries the report
                    report = report or prepared.report(None).model_dump(mode="json")
                    event = with_report(event, report)
                if waiting_first and first_token_or_error(event) == "token":
                    waiting_first = False
                    self.placements.release_inline(prepared)
                    self.placements.first_token(prepared, started)
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
            self.placements.release_inline(prepared)
            response.close()  # before the end: vLLM sees the connection drop and aborts the request
            if outcome != "ok":
                self._cancel(prepared, outcome.replace("_", " "))
            self.metrics.count(outcome)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already: the next message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
