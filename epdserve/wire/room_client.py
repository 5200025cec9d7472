"""Client of the handshake API for both sides: async (aiohttp) first, with a thin sync wrapper.

One session per client (connections are reused), a timeout on every call, and retries with
exponential backoff only for idempotent calls (everything but ``mint``) on connection errors
(a peer that dies mid-answer included), timeouts and 503s. Whatever the peer does, a call raises
``HandshakeError`` or returns a parsed answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Iterable

import aiohttp
import yarl
from pydantic import BaseModel, ValidationError

from epdserve.loop_threads import LoopThread
from epdserve.wire.rooms import (
    MAX_FRAME_BYTES,
    STREAM_PATH,
    BatchResponse,
    BeginWrite,
    BeginWriteRequest,
    CancelRequest,
    CommitBody,
    CommitRequest,
    FailBody,
    FailRequest,
    MintRequest,
    MintResponse,
    RegisterRequest,
    Registration,
    RoomResult,
    RoomView,
    WatchItem,
    WatchRequest,
)

JSON_HEADERS = {"Content-Type": "application/json"}
# Idle pooled connections are dropped after this; the server keeps them longer (handshake.server),
# so the client always lets go first and never sends on a connection the server is closing.
KEEPALIVE_S = 30.0
ROUTES = (
    "/v1/rooms",
    "/v1/rooms/register",
    "/v1/rooms/begin-write",
    "/v1/rooms/commit",
    "/v1/rooms/fail",
    "/v1/rooms/cancel",
    "/v1/rooms/watch",
    "/healthz",
)


class HandshakeError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(f"handshake answered {status}: {detail}")
        self.status = status
        self.detail = detail


class HandshakeClient:
    """``timeout_s`` bounds each call beyond its long-poll wait. With ``retry_timeouts=False`` a
    call that timed out is not retried: an endpoint that does not answer in time is stalled, and
    each retry would add another timeout before the caller learns it (connection errors and 503s are
    still retried)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.05,
        retry_timeouts: bool = True,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.retry_timeouts = retry_timeouts
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None
        # Parsed once per client, not per call: URL and timeout objects are on every request's path.
        self._urls = {path: yarl.URL(self.base_url + path) for path in ROUTES}
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    async def __aenter__(self) -> HandshakeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=KEEPALIVE_S),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        params=None,
        idempotent=True,
        extra_timeout: float = 0.0,
    ) -> bytes:
        attempts = self.retries + 1 if idempotent else 1
        timeout = self._timeout(extra_timeout)
        url = self._urls.get(path) or yarl.URL(self.base_url + path)
        headers = JSON_HEADERS if body is not None else None
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                async with self._client().request(
                    method, url, data=body, params=params, headers=headers, timeout=timeout
                ) as response:
                    answer = await response.read()
                    if response.status == 503 and not last:
                        retry_after = float(response.headers.get("Retry-After", self.backoff_s))
                        await asyncio.sleep(min(retry_after, self.backoff_s * 2**attempt))
                        continue
                    if response.status >= 400:
                        raise HandshakeError(response.status, _detail(answer))
                    return answer
            except (
                aiohttp.ClientConnectionError,
                aiohttp.ClientPayloadError,
                asyncio.TimeoutError,
            ) as exc:
                if last or (isinstance(exc, asyncio.TimeoutError) and not self.retry_timeouts):
                    raise HandshakeError(0, f"{type(exc).__name__}: {exc or 'no answer'}") from exc
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def _timeout(self, extra_s: float) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(extra_s)
        if timeout is None:
            if (
                len(self._timeouts) >= 16
            ):  # callers use a few long-poll lengths; stay bounded anyway
                self._timeouts.clear()
            timeout = self._timeouts[extra_s] = aiohttp.ClientTimeout(
                total=self.timeout_s + extra_s
            )
        return timeout

    async def _batch(self, path: str, request: BaseModel, wait_s: float = 0.0) -> list[RoomResult]:
        """POST one batch body (serialized once by pydantic) and parse the per-room results."""
        # fields at their defaults stay out: a server that predates one still reads the body
        body = request.model_dump_json(exclude_defaults=True).encode()
        return _parse(
            BatchResponse, await self._call("POST", path, body=body, extra_timeout=wait_s)
        ).results

    async def mint(self, count: int = 1, ttl_s: float = 120.0) -> list[int]:
        body = MintRequest(count=count, ttl_s=ttl_s).model_dump_json().encode()
        return _parse(
            MintResponse, await self._call("POST", "/v1/rooms", body=body, idempotent=False)
        ).rooms

    async def register(
        self, registrations: Iterable[Registration], wait_s: float = 0.0, until_ended: bool = False
    ) -> list[RoomResult]:
        """Register receivers; with ``wait_s``, also wait for the next change of any of the
        rooms (``until_ended``: for the end of any)."""
        return await self._batch(
            "/v1/rooms/register",
            RegisterRequest(receivers=list(registrations), wait_s=wait_s, until_ended=until_ended),
            wait_s,
        )

    async def begin_write(self, writes: Iterable[BeginWrite]) -> list[RoomResult]:
        return await self._batch("/v1/rooms/begin-write", BeginWriteRequest(writes=list(writes)))

    async def commit(self, commits: Iterable[CommitBody]) -> list[RoomResult]:
        return await self._batch("/v1/rooms/commit", CommitRequest(commits=list(commits)))

    async def fail(self, failures: Iterable[FailBody]) -> list[RoomResult]:
        return await self._batch("/v1/rooms/fail", FailRequest(failures=list(failures)))

    async def cancel(
        self, rooms: Iterable[int], reason: str = "cancelled by the receiver"
    ) -> list[RoomResult]:
        return await self._batch(
            "/v1/rooms/cancel", CancelRequest(rooms=list(rooms), reason=reason)
        )

    async def watch(
        self,
        versions: dict[int, int],
        wait_s: float = 0.0,
        until_ended: bool = False,
        changed_only: bool = False,
    ) -> list[RoomResult]:
        items = [WatchItem(room=room, after_version=version) for room, version in versions.items()]
        return await self._batch(
            "/v1/rooms/watch",
            WatchRequest(
                rooms=items, wait_s=wait_s, until_ended=until_ended, changed_only=changed_only
            ),
            wait_s,
        )

    async def get(self, room: int, after_version: int = 0, wait_s: float = 0.0) -> RoomView:
        params = {"after_version": after_version, "wait_s": wait_s}
        body = await self._call("GET", f"/v1/rooms/{room}", params=params, extra_timeout=wait_s)
        return _parse(RoomView, body)

    async def open_stream(self) -> aiohttp.ClientWebSocketResponse:
        """The room stream (``/v1/rooms/stream``) on this client's session, opened within
        ``timeout_s``; pings and pongs reach the caller (``autoping`` off: it decides when a
        silent peer is stalled). ``HandshakeError`` when it cannot be opened."""
        url = yarl.URL(self.base_url + STREAM_PATH)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._client().ws_connect(
                    url,
                    autoping=False,
                    max_msg_size=MAX_FRAME_BYTES,
                    timeout=aiohttp.ClientWSTimeout(ws_close=self.timeout_s),
                )
        except aiohttp.WSServerHandshakeError as exc:
            raise HandshakeError(exc.status, f"room stream refused: {exc.message}") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise HandshakeError(0, f"{type(exc).__name__}: {exc or 'no answer'}") from exc

    async def healthy(self) -> bool:
        try:
            await self._call("GET", "/healthz", idempotent=False)
            return True
        except HandshakeError:
            return False


def _parse(model: type[BaseModel], body: bytes):
    """An answer in the shape the API declares; anything else (a proxy's page, a truncated or
    foreign body) is a ``HandshakeError``, like a peer that does not answer."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise HandshakeError(
            0, f"malformed answer ({exc.error_count()} errors for {model.__name__})"
        ) from exc


def _detail(body: bytes) -> str:
    try:
        detail = json.loads(body).get("detail", body.decode(errors="replace"))
    except (ValueError, AttributeError):
        detail = body.decode(errors="replace")
    return detail if isinstance(detail, str) else str(detail)[:500]


class SyncHandshakeClient:
    """Blocking wrapper: the async client runs on its own event-loop thread."""

    def __init__(self, *args, **kwargs):
        self._loop = LoopThread("handshake-client")
        self.client = HandshakeClient(*args, **kwargs)

    def submit(self, name: str, *args, **kwargs) -> concurrent.futures.Future:
        """Start a client call on the client's thread without waiting (``asyncio.wrap_future`` it
        to await the answer from another event loop)."""
        return self._loop.submit(getattr(self.client, name)(*args, **kwargs))

    def __getattr__(self, name):
        method = getattr(self.client, name)
        return lambda *args, **kwargs: self._loop.run(method(*args, **kwargs))

    def close(self) -> None:
        self._loop.run(self.client.close())
        self._loop.stop()
