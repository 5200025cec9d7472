"""Until a request's placed items are staged: each one's encode worker holds its rows and waits
for a receiver (``RoomView.staged``), watched over one room stream per worker endpoint. A gateway
forwards the request then, so that the engine waits for a write (a millisecond) rather than for an
encode, stepping its loop all the while.

An item whose room ends first (the worker failed it), or whose worker's stream closed (the worker
stopped or died: ``lost`` is told, and the gateway takes the worker out of rotation), comes back
with the reason: the gateway sends it to the engine inline. An item not staged within the wait is
forwarded as it is: the engine's connector waits for it, and falls back, as it would have without
this."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NamedTuple

from epdserve.dispatcher.media import DispatchedItem
from epdserve.wire.addresses import Endpoint
from epdserve.wire.room_client import HandshakeClient, HandshakeError
from epdserve.wire.room_stream import OpenOnce, RoomStreamClient
from epdserve.wire.rooms import RoomResult

log = logging.getLogger(__name__)
MAX_STREAMS = 256  # worker endpoints with an open stream; the oldest is closed beyond


class _Lost(NamedTuple):
    reason: str  # why the stream its room was watched over closed


class StagedWatch:
    def __init__(
        self,
        token: str | None,
        timeout_s: float = 5.0,
        lost: Callable[[Endpoint, str], None] = lambda endpoint, reason: None,
    ):
        """``lost(endpoint, reason)``: a worker endpoint's stream closed under waiting items."""
        self.token = token
        self.timeout_s = timeout_s  # opening a stream
        self.lost = lost
        self._streams: dict[Endpoint, tuple[HandshakeClient, RoomStreamClient]] = {}
        self._opening = OpenOnce()
        self._waiting: dict[tuple[Endpoint, int], asyncio.Future[RoomResult | _Lost]] = {}
        self._readers: set[asyncio.Task] = set()

    async def until_staged(self, items: list[DispatchedItem], wait_s: float) -> dict[int, str]:
        """Wait (at most ``wait_s``, opening the streams included) until every placed item is
        staged or its room has ended; why, by the item's index, for those whose room ended
        without being staged."""
        deadline = asyncio.get_running_loop().time() + wait_s
        by_endpoint: dict[Endpoint, list[DispatchedItem]] = {}
        for item in items:
            if item.encode_handshake is not None:
                by_endpoint.setdefault(item.encode_handshake.endpoint, []).append(item)
        waits: dict[int, asyncio.Future] = {}
        keys: list[tuple[Endpoint, int]] = []
        try:
            async with asyncio.timeout_at(deadline):
                streams = await asyncio.gather(
                    *(self._stream(endpoint) for endpoint in by_endpoint), return_exceptions=True
                )
            for (endpoint, placed), stream in zip(by_endpoint.items(), streams):
                if isinstance(stream, BaseException):  # forwarded as they are: vLLM waits
                    log.info(
                        "no room stream to %s (%s): not waiting for its items", endpoint, stream
                    )
                    continue
                for item in placed:
                    room = item.encode_handshake.bootstrap_room
                    future = asyncio.get_running_loop().create_future()
                    self._waiting[(endpoint, room)] = waits[item.index] = future
                    keys.append((endpoint, room))
                stream.watch_staged([item.encode_handshake.bootstrap_room for item in placed])
            if waits:
                await asyncio.wait(
                    waits.values(), timeout=max(0.0, deadline - asyncio.get_running_loop().time())
                )
        except TimeoutError:  # the streams took the whole wait to open: forwarded as they are
            return {}
        finally:
            for key in keys:
                self._waiting.pop(key, None)
        ended = {}
        for index, future in waits.items():
            result = future.result() if future.done() else None
            if result is None:
                continue
            if isinstance(result, _Lost):
                ended[index] = result.reason
            elif not result.ok:
                ended[index] = f"room lost at its encode worker: {result.error}"
            elif not result.view.staged:
                view = result.view
                ended[index] = f"room {view.state.value}: {view.reason or 'no reason given'}"
        return ended

    async def close(self) -> None:
        for task in list(self._readers):
            task.cancel()
        for client, stream in self._streams.values():
            await stream.close()
            await client.close()
        self._streams.clear()

    async def _stream(self, endpoint: Endpoint) -> RoomStreamClient:
        open_ = self._streams.get(endpoint)
        if open_ is not None and not open_[1].closed:
            return open_[1]
        return await self._opening(endpoint, lambda: self._open(endpoint))

    async def _open(self, endpoint: Endpoint) -> RoomStreamClient:
        client = HandshakeClient(endpoint.url("http"), self.token, timeout_s=self.timeout_s)
        try:
            stream = await RoomStreamClient.open(client)
        except HandshakeError:
            await client.close()
            raise
        replaced = self._streams.pop(endpoint, None)  # closed: its reader has ended
        if replaced is None and len(self._streams) >= MAX_STREAMS:  # the oldest goes
            replaced = self._streams.pop(next(iter(self._streams)))
        if replaced is not None:
            await replaced[1].close()
            await replaced[0].close()
        self._streams[endpoint] = (client, stream)
        reader = asyncio.ensure_future(self._read(endpoint, stream))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        return stream

    async def _read(self, endpoint: Endpoint, stream: RoomStreamClient) -> None:
        try:
            while True:
                for result in await stream.receive():
                    future = self._waiting.pop((endpoint, result.room), None)
                    if future is not None and not future.done():
                        future.set_result(result)
        except HandshakeError as exc:  # what waits on it goes to the engine inline
            log.info("room stream to %s closed: %s", endpoint, exc)
            lost = _Lost(f"its encode worker's room stream closed ({exc}): the worker is gone")
            waited = False
            for (where, _), future in list(self._waiting.items()):
                if where == endpoint and not future.done():
                    future.set_result(lost)
                    waited = True
            if waited:
                self.lost(endpoint, lost.reason)
