"""The room API's batch calls over ZMQ: the receivers' hot path beside the REST face.

A receiver's register-and-wait (and watch, cancel, ...) costs one HTTP exchange per request over
REST: on these machines the HTTP stacks (uvicorn and FastAPI's routing on the server, aiohttp on the
client) cost more CPU than the room work itself. The room socket carries the same bodies, validated
by the same models and answered by the same ``RoomCalls``, over one ZMQ DEALER -> ROUTER
connection per endpoint. REST stays the public face: ``GET /v1/rooms/socket`` names the socket's
port, ``HandshakeClient`` finds it there and falls back to REST where there is none, or where it
never answers (a port a firewall closes).

Request frames (after the ROUTER identity): ``[call id, route, token, body]``: a call id of 1..16
bytes the reply repeats, a route (a ``BATCH_BODIES`` name), the bearer token (empty without one) and
the JSON body. Reply: ``[call id, status, body]``, the status as ASCII digits and the body a
``BatchResponse`` or ``{"detail": ...}`` with the status REST would give (401, 404, 413, 422, 503).
A message without a readable call id is dropped: there is nothing to answer it by.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time

import zmq
import zmq.asyncio
from pydantic import ValidationError

from handshake.calls import BATCH_BODIES, RoomCalls
from handshake.models import BatchResponse
from multimodal.wire import Endpoint, endpoint_url

log = logging.getLogger(__name__)
MAX_CALL_ID_BYTES = 16
MAX_CALLS_IN_FLIGHT = 4096  # calls being answered (long-polls among them); beyond: 503
ROUTES = {name.encode(): name for name in BATCH_BODIES}


class RoomSocket:
    """The server: a ROUTER socket on the handshake server's event loop; each call is answered by
    a task of its own (a long-poll holds no thread), at most ``MAX_CALLS_IN_FLIGHT`` at once."""

    def __init__(self, calls: RoomCalls, token: str | None, max_body_bytes: int, metrics=None):
        self.calls = calls
        self.token = token.encode() if token else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics  # HandshakeMetrics: latency by route, as REST's
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self.port: int | None = None

    def bind(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); the port. ``zmq.ZMQError`` when it cannot."""
        socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IPV6, 1)
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_body_bytes + 4096)
        try:
            if port:
                socket.bind(endpoint_url("tcp", host, port))
                self.port = port
            else:
                self.port = socket.bind_to_random_port(endpoint_url("tcp", host))
        except zmq.ZMQError:
            socket.close(0)
            raise
        self._socket = socket
        return self.port

    async def serve(self) -> None:
        """Answer calls until cancelled (on the loop the socket is used from); then close."""
        try:
            while True:
                frames = await self._socket.recv_multipart()
                if len(frames) < 2 or not 1 <= len(frames[1]) <= MAX_CALL_ID_BYTES:
                    continue  # no call id to answer by
                identity, call_id = frames[0], frames[1]
                if len(frames) != 5:
                    await self._reply(
                        identity, call_id, 400, "expected [call id, route, token, body]"
                    )
                elif len(self._tasks) >= MAX_CALLS_IN_FLIGHT:
                    await self._reply(identity, call_id, 503, "too many calls in flight")
                else:
                    task = asyncio.ensure_future(self._answer(identity, call_id, *frames[2:]))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        finally:
            for task in self._tasks:
                task.cancel()
            self._socket.close(0)

    async def _answer(
        self, identity: bytes, call_id: bytes, route: bytes, token: bytes, body: bytes
    ):
        started = time.perf_counter()
        name = ROUTES.get(route)
        if self.token is not None and not hmac.compare_digest(token, self.token):
            await self._reply(identity, call_id, 401, "missing or wrong bearer token")
            return
        if name is None:
            await self._reply(identity, call_id, 404, f"no room call {route[:64]!r}")
            return
        if len(body) > self.max_body_bytes:
            await self._reply(
                identity, call_id, 413, f"body larger than {self.max_body_bytes} bytes"
            )
            return
        try:
            request = BATCH_BODIES[name].model_validate_json(body)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_context=False, include_input=False)
            for error in errors:
                error["loc"] = ("body", *error["loc"])
            await self._send(identity, call_id, 422, json.dumps({"detail": errors}).encode())
            return
        results = await self.calls.call(name, request)
        answer = BatchResponse.model_construct(results=results).model_dump_json().encode()
        await self._send(identity, call_id, 200, answer)
        if self.metrics is not None:
            self.metrics.observe(f"/v1/rooms/{name}", "ZMQ", time.perf_counter() - started)

    async def _reply(self, identity: bytes, call_id: bytes, status: int, detail: str) -> None:
        await self._send(identity, call_id, status, json.dumps({"detail": detail}).encode())

    async def _send(self, identity: bytes, call_id: bytes, status: int, body: bytes) -> None:
        await self._socket.send_multipart([identity, call_id, str(status).encode(), body])


class SocketSilent(Exception):
    """The room socket never answered: unreachable (a closed port), so REST it is."""


class RoomSocketClient:
    """One endpoint's room socket, for the event loop it is first used on: one DEALER socket, many
    calls in flight (at most ``max_in_flight``), each reply matched to its call by id."""

    def __init__(self, endpoint: Endpoint, token: str | None, max_in_flight: int = 1024):
        self.endpoint = endpoint
        self.token = token.encode() if token else b""
        self.max_in_flight = max_in_flight
        self.answered = False  # a reply has come: the socket is reachable
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IPV6, 1)
        self._socket.connect(endpoint_url("tcp", endpoint.host, endpoint.port))
        self._ids = itertools.count(1)
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def call(self, route: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        """``(status, body)`` of one call. ``TimeoutError`` when no answer comes in time
        (``SocketSilent`` when none ever came), ``OverflowError`` past ``max_in_flight``."""
        if len(self._waiting) >= self.max_in_flight:
            raise OverflowError(f"{self.max_in_flight} room calls in flight to {self.endpoint}")
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read_replies())
        call_id = next(self._ids).to_bytes(8, "big")
        future = self._waiting[call_id] = asyncio.get_running_loop().create_future()
        try:
            await self._socket.send_multipart([call_id, route.encode(), self.token, body])
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            if not self.answered:
                raise SocketSilent(f"room socket {self.endpoint} never answered") from None
            raise TimeoutError(f"no answer from room socket {self.endpoint}") from None
        finally:
            self._waiting.pop(call_id, None)

    async def _read_replies(self) -> None:
        while self._waiting:
            frames = await self._socket.recv_multipart()
            if len(frames) != 3 or not frames[1].isdigit():
                log.warning("room socket %s sent a malformed reply: dropped", self.endpoint)
                continue
            self.answered = True
            future = self._waiting.get(frames[0])
            if future is not None and not future.done():  # else: its call gave up already
                future.set_result((int(frames[1]), frames[2]))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._socket.close(0)
