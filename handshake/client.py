"""Client of the handshake API for both sides: async (aiohttp) first, with a thin sync wrapper.

One session per client (connections are reused), a timeout on every call, and retries with
exponential backoff only for idempotent calls (everything but ``mint``) on connection errors,
timeouts and 503s.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterable

import aiohttp

from handshake.models import (
    BatchResponse,
    BeginWrite,
    CommitBody,
    FailBody,
    MintResponse,
    Registration,
    RoomResult,
    RoomView,
)


class HandshakeError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(f"handshake answered {status}: {detail}")
        self.status = status
        self.detail = detail


class HandshakeClient:
    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.05):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HandshakeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=30))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, *, body=None, params=None, idempotent=True,
                    extra_timeout: float = 0.0) -> bytes:
        attempts = self.retries + 1 if idempotent else 1
        timeout = aiohttp.ClientTimeout(total=self.timeout_s + extra_timeout)
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                async with self._client().request(method, self.base_url + path, json=body, params=params,
                                                  timeout=timeout) as response:
                    body = await response.read()
                    if response.status == 503 and not last:
                        retry_after = float(response.headers.get("Retry-After", self.backoff_s))
                        await asyncio.sleep(min(retry_after, self.backoff_s * 2 ** attempt))
                        continue
                    if response.status >= 400:
                        raise HandshakeError(response.status, _detail(body))
                    return body
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                if last:
                    raise HandshakeError(0, f"{type(exc).__name__}: {exc or 'no answer'}") from exc
                await asyncio.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _batch(self, path: str, key: str, items: Iterable, wait_s: float = 0.0) -> list[RoomResult]:
        payload = {key: [item.model_dump(mode="json") for item in items]}
        if wait_s:
            payload["wait_s"] = wait_s
        return BatchResponse.model_validate_json(
            await self._call("POST", path, body=payload, extra_timeout=wait_s)).results

    async def mint(self, count: int = 1, ttl_s: float = 120.0) -> list[int]:
        body = await self._call("POST", "/v1/rooms", body={"count": count, "ttl_s": ttl_s}, idempotent=False)
        return MintResponse.model_validate_json(body).rooms

    async def register(self, registrations: Iterable[Registration], wait_s: float = 0.0) -> list[RoomResult]:
        """Register receivers; with ``wait_s``, also wait for the next change of any of the rooms."""
        return await self._batch("/v1/rooms/register", "receivers", registrations, wait_s)

    async def begin_write(self, writes: Iterable[BeginWrite]) -> list[RoomResult]:
        return await self._batch("/v1/rooms/begin-write", "writes", writes)

    async def commit(self, commits: Iterable[CommitBody]) -> list[RoomResult]:
        return await self._batch("/v1/rooms/commit", "commits", commits)

    async def fail(self, failures: Iterable[FailBody]) -> list[RoomResult]:
        return await self._batch("/v1/rooms/fail", "failures", failures)

    async def cancel(self, rooms: Iterable[int], reason: str = "cancelled by the receiver") -> list[RoomResult]:
        body = await self._call("POST", "/v1/rooms/cancel", body={"rooms": list(rooms), "reason": reason})
        return BatchResponse.model_validate_json(body).results

    async def watch(self, versions: dict[int, int], wait_s: float = 0.0) -> list[RoomResult]:
        payload = {"rooms": [{"room": r, "after_version": v} for r, v in versions.items()], "wait_s": wait_s}
        body = await self._call("POST", "/v1/rooms/watch", body=payload, extra_timeout=wait_s)
        return BatchResponse.model_validate_json(body).results

    async def get(self, room: int, after_version: int = 0, wait_s: float = 0.0) -> RoomView:
        params = {"after_version": after_version, "wait_s": wait_s}
        body = await self._call("GET", f"/v1/rooms/{room}", params=params, extra_timeout=wait_s)
        return RoomView.model_validate_json(body)

    async def healthy(self) -> bool:
        try:
            await self._call("GET", "/healthz", idempotent=False)
            return True
        except HandshakeError:
            return False


def _detail(body: bytes) -> str:
    try:
        detail = json.loads(body).get("detail", body.decode(errors="replace"))
    except (ValueError, AttributeError):
        detail = body.decode(errors="replace")
    return detail if isinstance(detail, str) else str(detail)[:500]


class SyncHandshakeClient:
    """Blocking wrapper: the async client runs on its own event-loop thread."""

    def __init__(self, *args, **kwargs):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="handshake-client", daemon=True)
        self._thread.start()
        self.client = HandshakeClient(*args, **kwargs)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name):
        method = getattr(self.client, name)
        return lambda *args, **kwargs: self._run(method(*args, **kwargs))

    def close(self) -> None:
        self._run(self.client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
