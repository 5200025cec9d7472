"""The handshake REST app (FastAPI): rooms under ``/v1``, plus ``/health`` (``/healthz``),
``/readyz``, ``/metrics``.

Every body route takes a batch (an 8-image request costs one call per side) and answers per room:
``{"results": [{"room", "ok", "view" | "error", "status"}]}``. Bad bodies get 4xx with a reason and
change nothing. Auth (optional) is a bearer token compared in constant time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import time
from collections.abc import Callable

from fastapi import FastAPI, HTTPException, Path, Query, Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ValidationError
from starlette.convertors import IntegerConvertor, register_url_convertor
from starlette.routing import Match

from epdserve.bearer_auth import bearer_matches
from epdserve.metrics import LATENCY_BUCKETS, PROBE_PATHS, exposition_registry
from epdserve.wire.fingerprint import ModelFingerprint
from epdserve.wire.rooms import (
    MAX_ROOM_ID,
    MAX_WAIT_S,
    STREAM_PATH,
    BatchResponse,
    BeginWriteRequest,
    CancelRequest,
    CommitRequest,
    FailRequest,
    MintRequest,
    MintResponse,
    RegisterRequest,
    RoomView,
    WatchRequest,
)
from handshake import answers
from handshake.rooms import RoomError, RoomsFull, RoomStatus, RoomTable
from handshake.stream import POLICY_VIOLATION, RoomStream

MAX_BODY_BYTES = 1 << 20
SWEEP_INTERVAL_S = 0.1
BODY_ERRORS = {400: {"description": "Malformed JSON body"}, 413: {"description": "Body too large"}}
AUTH_ERRORS = {401: {"description": "Missing or wrong bearer token"}}


class RoomIdConvertor(IntegerConvertor):
    """A room id in a path: 1 to 19 digits (a room id is below 2**63). Starlette's ``int``
    convertor takes any number of digits, and Python's ``int()`` refuses more than 4,300: a
    500 for a long path; this one leaves such a path unmatched (404)."""

    regex = "[0-9]{1,19}"


register_url_convertor("room_id", RoomIdConvertor())


class HandshakeMetrics:
    def __init__(self, table: RoomTable, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.latency = Histogram(
            "epd_handshake_request_seconds",
            "Request latency by route",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        Gauge(
            "epd_handshake_longpoll_waiters", "Long-poll waiters now", registry=self.registry
        ).set_function(lambda: table.waiters)
        self.registry.register(_RoomCollector(table))
        # labels() looks the child up on every call: bind each (route, method) once
        self._latency_children: dict[tuple[str, str], object] = {}

    def observe(self, route: str, method: str, seconds: float) -> None:
        child = self._latency_children.get((route, method))
        if child is None:
            child = self._latency_children.setdefault(
                (route, method), self.latency.labels(route, method)
            )
        child.observe(seconds)


class _RoomCollector:
    """Rooms by state and transitions, read from the table at scrape time (the table counts them
    under its own lock, so a transition makes no Prometheus call)."""

    def __init__(self, table: RoomTable):
        self.table = table

    def collect(self):
        rooms = GaugeMetricFamily(
            "epd_handshake_rooms", "Rooms by state (terminal ones are tombstones)", labels=["state"]
        )
        for state, count in self.table.counts().items():
            rooms.add_metric([state.value], count)
        yield rooms
        transitions = CounterMetricFamily(
            "epd_handshake_transitions", "Room state transitions", labels=["to"]
        )
        for state, count in self.table.entered().items():
            transitions.add_metric([state.value], count)
        yield transitions


class BodyTooLarge(HTTPException):
    """A request body passed its size limit. Raised from a limited ``receive``; inside a FastAPI
    app, FastAPI answers it (413) like any HTTPException."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"body larger than {max_bytes} bytes")


def declared_too_large(headers: dict[bytes, bytes], max_bytes: int) -> bool:
    """A Content-Length over the limit (or not a number): refuse before reading a byte."""
    length = headers.get(b"content-length")
    return length is not None and (not length.isdigit() or int(length) > max_bytes)


def limit_body(receive, max_bytes: int):
    """``receive`` that raises ``BodyTooLarge`` as soon as more than ``max_bytes`` have arrived
    (a body without a Content-Length, or a lying one): nothing larger is ever held."""
    received = 0

    async def limited_receive():
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > max_bytes:
            raise BodyTooLarge(max_bytes)
        return message

    return limited_receive


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets a 413 (for apps without the
    handshake's front door, such as the reference prefill server)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if declared_too_large(dict(scope["headers"]), self.max_bytes):
            return await _reply(send, 413, BodyTooLarge(self.max_bytes).detail)
        try:
            await self.app(scope, limit_body(receive, self.max_bytes), send)
        except BodyTooLarge as exc:
            await _reply(send, 413, exc.detail)


class _ClientGone(Exception):
    """The client disconnected before its body arrived: nobody to answer."""


async def _reply(send, status: int, detail: str, extra: dict | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _BodyRoute(APIRoute):
    """A route whose endpoint takes one pydantic body and returns a ``Response``. The body is parsed
    once by pydantic's JSON path (FastAPI's dependency solver skipped); the OpenAPI schema still
    comes from the endpoint's signature; a bad body gets the 422 ``{"detail": [errors]}`` FastAPI
    would send."""

    def get_route_handler(self):
        (parameter,) = inspect.signature(self.endpoint, eval_str=True).parameters.values()
        self.body_model: type[BaseModel] = parameter.annotation

        async def handler(request: Request) -> Response:
            return await self.respond(await request.body())

        return handler

    def matches(self, scope) -> tuple[Match, dict]:
        """The path compared as a string (the room API's paths have no parameters), where
        Starlette's route would match a regex against the path less its root path: the router
        asks every route in turn, and that match cost rivalled the room work itself."""
        if scope["type"] != "http" or scope.get("root_path"):
            return super().matches(scope)
        if scope["path"] != self.path:
            return Match.NONE, {}
        child_scope = {"endpoint": self.endpoint, "path_params": {}, "route": self}
        return (Match.FULL if scope["method"] in self.methods else Match.PARTIAL), child_scope

    async def handle(self, scope, receive, send) -> None:
        """Routed here by the app's router: the body read, answered by ``respond``, without the
        per-route wrappers (a request object, FastAPI's handler and exception wrapping), whose CPU
        per request rivals the room work itself. A body over the limit gets its 413 here, before
        anything else could answer."""
        if scope["method"] not in self.methods:  # a partial match: Starlette's 405
            return await super().handle(scope, receive, send)
        try:
            response = await self.respond(await _read_body(receive))
        except BodyTooLarge as exc:
            return await _reply(send, 413, exc.detail)
        except _ClientGone:
            return
        await response(scope, receive, send)

    async def respond(self, raw: bytes) -> Response:
        try:
            body = self.body_model.model_validate_json(raw)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_context=False, include_input=False)
            for error in errors:
                error["loc"] = ("body", *error["loc"])
            return JSONResponse({"detail": errors}, status_code=422)
        return await self.endpoint(body)


class HandshakeAPI(FastAPI):
    """FastAPI with a front door: bearer auth on ``/v1``, the body size limit and latency by route
    for every request, then FastAPI's own stack and router (the room API's POST routes first)."""

    def configure_front_door(
        self, token: str | None, max_body_bytes: int, metrics: HandshakeMetrics
    ) -> None:
        self.token = token.encode() if token else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":  # the room stream: its frames are bounded by the server
            if not self._authorized(scope):  # closed before it opens: the server answers 403
                return await send({"type": "websocket.close", "code": POLICY_VIOLATION})
            return await super().__call__(scope, receive, send)
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        started = time.perf_counter()
        headers = dict(scope["headers"])
        if not self._authorized(scope, headers):
            return await _reply(
                send, 401, "missing or wrong bearer token", {"www-authenticate": "Bearer"}
            )
        if declared_too_large(headers, self.max_body_bytes):
            return await _reply(send, 413, BodyTooLarge(self.max_body_bytes).detail)
        try:
            await super().__call__(scope, limit_body(receive, self.max_body_bytes), send)
        except BodyTooLarge as exc:
            await _reply(send, 413, exc.detail)
        except _ClientGone:
            return
        if scope["path"] not in PROBE_PATHS:  # probes and scrapes are not room traffic
            route = scope.get("route")
            self.metrics.observe(
                route.path if route else "unmatched", scope["method"], time.perf_counter() - started
            )

    def _authorized(self, scope, headers: dict[bytes, bytes] | None = None) -> bool:
        """No token set, a path outside ``/v1``, or the bearer token (compared in constant
        time)."""
        if self.token is None or not scope["path"].startswith("/v1"):
            return True
        return bearer_matches(
            headers if headers is not None else dict(scope["headers"]), self.token
        )


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _json(model) -> Response:
    """Serialize once (pydantic's Rust path); FastAPI would otherwise re-validate the return
    value."""
    return Response(model.model_dump_json(), media_type="application/json")


def _answer(results: list[answers.ResultJson]) -> Response:
    """A batch route's answer, ``BatchResponse``'s document made without a model per room
    (``handshake.answers``)."""
    return Response(answers.frame(results), media_type="application/json")


def _batch_results(
    rooms, statuses: list[RoomStatus | RoomError | None]
) -> list[answers.ResultJson]:
    """Per room, in ``rooms``' order, its view's JSON or why it was refused; a room without news
    (None: ``changed_only``) left out."""
    return [
        answers.refused(room, str(status), status.status)
        if isinstance(status, RoomError)
        else answers.viewed(room, status.view_json())
        for room, status in zip(rooms, statuses)
        if status is not None
    ]


def create_app(
    table: RoomTable | None = None,
    token: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    not_ready: Callable[[], str | None] = lambda: None,
    registry: CollectorRegistry | None = None,
    model_name: str | None = None,
    fingerprint: ModelFingerprint | None = None,
) -> HandshakeAPI:
    """The handshake app over ``table``. An embedding process (the encode worker) gates ``/readyz``
    with ``not_ready`` (why it is not ready, or None), adds its own metrics to ``/metrics``
    through ``registry``, names the model every family is labelled with (``model_name``; a
    standalone room authority serves none) and says in every ``/readyz`` answer which model its
    rows are (``fingerprint``: a dispatcher keeps a worker of another model than its engine's out
    of rotation)."""
    model = {"model": fingerprint.model_dump(mode="json")} if fingerprint is not None else {}
    table = table or RoomTable()
    metrics = HandshakeMetrics(table, registry)
    served = exposition_registry(metrics.registry, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def sweeper():
            while True:
                table.sweep()
                await asyncio.sleep(SWEEP_INTERVAL_S)

        task = asyncio.create_task(sweeper())
        # What is alive once serving starts (modules, the app, an embedding process's tower) lives
        # as long as the process: out of every full collection, whose pause grows with it.
        gc.collect()
        gc.freeze()
        yield
        task.cancel()

    # FastAPI's native OpenTelemetry hooks are off (CPU on every request); we export Prometheus.
    telemetry = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
    app = HandshakeAPI(
        title="EPD handshake",
        version="1",
        lifespan=lifespan,
        telemetry=telemetry,
        description="Bootstrap rooms: one per item, pairing an encode worker's write with its "
        "receiver.",
    )
    app.state.table = table
    app.state.metrics = metrics

    def body_route(path: str, **kwargs):
        def add(endpoint):
            app.router.add_api_route(
                path, endpoint, methods=["POST"], route_class_override=_BodyRoute, **kwargs
            )
            return endpoint

        return add

    @body_route(
        "/v1/rooms",
        response_model=MintResponse,
        responses={
            **BODY_ERRORS,
            **AUTH_ERRORS,
            400: {"description": "ttl_s over this table's room lifetime (RoomLimits.max_ttl_s)"},
            503: {"description": "Too many live rooms; retry after Retry-After seconds"},
        },
    )
    async def mint(body: MintRequest):
        """Mint ``count`` rooms with unique 63-bit ids, alive for ``ttl_s`` (at most the table's
        maximum)."""
        try:
            rooms = table.mint(body.count, body.ttl_s)
        except RoomsFull as exc:
            return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})
        except RoomError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=exc.status)
        return _json(MintResponse(rooms=rooms, ttl_s=body.ttl_s))

    @body_route(
        "/v1/rooms/register", response_model=BatchResponse, responses={**BODY_ERRORS, **AUTH_ERRORS}
    )
    async def register(body: RegisterRequest):
        """A receiver reserves its slot per room: generation, rows x width x dtype, transport
        offers. With ``wait_s`` it then long-polls until one of the rooms changes again (as
        ``/v1/rooms/watch``, ``until_ended`` included), answered with every room: the caller
        learns each one's version."""
        rooms = [registration.room for registration in body.receivers]
        registered = table.register_all(body.receivers)
        if body.wait_s > 0:
            versions = {
                room: status.version
                for room, status in zip(rooms, registered)
                if not isinstance(status, RoomError) and not status.state.terminal
            }
            if len(versions) == len(registered):  # (each room once, every one live)
                statuses = await table.watch(versions, body.wait_s, body.until_ended)
                return _answer(_batch_results(versions, statuses))
        return _answer(_batch_results(rooms, registered))

    @body_route(
        "/v1/rooms/begin-write",
        response_model=BatchResponse,
        responses={**BODY_ERRORS, **AUTH_ERRORS},
    )
    async def begin_write(body: BeginWriteRequest):
        """A sender starts writing (REGISTERED -> WRITING); a cancelled room answers CANCELLED
        instead."""
        rooms = [write.room for write in body.writes]
        return _answer(_batch_results(rooms, table.begin_writes(body.writes)))

    @body_route(
        "/v1/rooms/commit", response_model=BatchResponse, responses={**BODY_ERRORS, **AUTH_ERRORS}
    )
    async def commit(body: CommitRequest):
        """A sender's write completed: generation, layout, checksum. Stale generations are
        refused."""
        rooms = [commit.room for commit in body.commits]
        return _answer(_batch_results(rooms, table.commit_all(body.commits)))

    @body_route(
        "/v1/rooms/fail", response_model=BatchResponse, responses={**BODY_ERRORS, **AUTH_ERRORS}
    )
    async def fail(body: FailRequest):
        """Fail rooms with a reason the other side can read; ``settled`` if no byte can still
        land."""
        rooms = [failure.room for failure in body.failures]
        return _answer(_batch_results(rooms, table.fail_all(body.failures)))

    @body_route(
        "/v1/rooms/cancel", response_model=BatchResponse, responses={**BODY_ERRORS, **AUTH_ERRORS}
    )
    async def cancel(body: CancelRequest):
        """Cancel rooms; one being written stays WRITING (cancel_requested) until the writer's
        outcome."""
        return _answer(_batch_results(body.rooms, table.cancel_all(body.rooms, body.reason)))

    @body_route(
        "/v1/rooms/watch", response_model=BatchResponse, responses={**BODY_ERRORS, **AUTH_ERRORS}
    )
    async def watch(body: WatchRequest):
        """Long-poll: answers once any room is past its ``after_version`` (``until_ended``: once
        any has ended) or after ``wait_s``; ``changed_only``: with the rooms past it only."""
        versions = {item.room: item.after_version for item in body.rooms}
        return _answer(
            _batch_results(
                versions,
                await table.watch(versions, body.wait_s, body.until_ended, body.changed_only),
            )
        )

    @app.websocket(STREAM_PATH)
    async def stream(websocket: WebSocket):
        """The room stream (a WebSocket): a dispatcher's opens, a receiver's registrations and
        cancels, a gateway's and a writer's watches, a writer's begins and commits in
        (``wire.rooms.STREAM_FRAME``); ``BatchResponse`` frames out, each room's answer
        (``handshake.stream``)."""
        await RoomStream(table, websocket, metrics.observe).serve()

    @app.get(
        "/v1/rooms/{room:room_id}",
        response_model=RoomView,
        responses={**AUTH_ERRORS, 404: {"description": "Unknown room"}},
    )
    async def get_room(
        room: int = Path(ge=1, le=MAX_ROOM_ID),
        after_version: int = Query(0, ge=0, lt=1 << 63),
        wait_s: float = Query(0.0, ge=0, le=MAX_WAIT_S),
    ):
        """One room; with ``wait_s`` it long-polls until its version passes ``after_version``."""
        (status,) = await table.watch({room: after_version}, wait_s)
        if isinstance(status, RoomError):
            return JSONResponse({"detail": str(status)}, status_code=status.status)
        return Response(bytes(status.view_json()), media_type="application/json")

    @app.get("/health")  # as vLLM and SGLang name it
    @app.get("/healthz")
    async def healthz():
        """Liveness: the process answers."""
        return {"ok": True}

    @app.get("/readyz", responses={503: {"description": "Not ready, with the reason"}})
    async def readyz():
        """Readiness: the embedding process's own check, and a room table with room for one more."""
        reason = not_ready()
        if reason is not None:
            return JSONResponse({"ready": False, "reason": reason, **model}, status_code=503)
        if table.full():
            return JSONResponse(
                {
                    "ready": False,
                    "reason": f"room table full: {table.limits.max_live_rooms} "
                    "live rooms, no room can be minted",
                    **model,
                },
                status_code=503,
            )
        return {"ready": True, "live_rooms": table.live_rooms, **model}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        """Prometheus metrics: rooms by state, transitions, long-poll waiters, latency by route."""
        return Response(generate_latest(served), media_type=CONTENT_TYPE_LATEST)

    # The router tries routes in order: the room API first, FastAPI's /docs and /openapi.json last.
    app.router.routes.sort(key=lambda route: not getattr(route, "path", "").startswith("/v1/"))
    app.configure_front_door(token, max_body_bytes, metrics)
    return app
