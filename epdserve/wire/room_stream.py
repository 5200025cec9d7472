"""A client's end of the room stream (``/v1/rooms/stream``, ``handshake.stream``): a dispatcher's
rooms to open, a receiver's registrations and cancels (a gateway's rooms to watch until staged, a
writer's rooms to watch until registered, its begins and commits) go out in frames: the calls of
one kind made while the loop runs one step share a frame, or two when they are more than
``FRAME_ROOMS_WHOLE`` (``step_frames``); the answers come in as batches. Pings are the caller's
to send (``ping``; ``last_heard`` says when the peer last spoke), so that the caller decides when
a silent peer is stalled. ``OpenOnce``: one open per endpoint at a time, however many callers
want it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable

import aiohttp
from pydantic import ValidationError

from epdserve.wire.room_client import HandshakeClient, HandshakeError
from epdserve.wire.rooms import (
    MAX_BATCH,
    BatchResponse,
    BeginWrite,
    CommitBody,
    Registration,
    RoomResult,
    StreamBeginWrite,
    StreamCancel,
    StreamCommit,
    StreamOpen,
    StreamRegister,
    StreamWatchRegistered,
    StreamWatchStaged,
    check_room_ttl,
)

FRAME_ROOMS_WHOLE = 8  # at most, in one step's calls of one kind sent as one frame


class RoomStreamClient:
    def __init__(self, websocket: aiohttp.ClientWebSocketResponse):
        self._websocket = websocket
        self._opens: dict[float, list[int]] = {}  # by TTL
        self._registrations: list[Registration] = []
        self._cancels: list[tuple[list[int], str]] = []
        self._staged: list[int] = []
        self._until_registered: list[int] = []
        self._begins: list[BeginWrite] = []
        self._commits: list[CommitBody] = []
        self._due = asyncio.Event()
        self._writer = asyncio.create_task(self._write())
        self._writer.add_done_callback(self._writer_ended)
        self._closing: asyncio.Future | None = None  # the close a failed writer started
        self.last_heard = time.monotonic()

    @classmethod
    async def open(cls, client: HandshakeClient) -> RoomStreamClient:
        """``HandshakeError`` when the stream cannot be opened."""
        return cls(await client.open_stream())

    @property
    def closed(self) -> bool:
        return self._websocket.closed or self._writer.done()

    def open_rooms(self, rooms: list[int], ttl_s: float) -> None:
        """Each room comes back opened (its view), or refused. ``ValueError`` for a TTL the
        frame cannot carry (checked here: in the writer it would end the stream)."""
        check_room_ttl(ttl_s)
        self._opens.setdefault(ttl_s, []).extend(rooms)
        self._due.set()

    def register(self, registrations: Iterable[Registration]) -> None:
        self._registrations.extend(registrations)
        self._due.set()

    def cancel(self, rooms: list[int], reason: str) -> None:
        for start in range(0, len(rooms), MAX_BATCH):
            self._cancels.append((rooms[start : start + MAX_BATCH], reason[:500]))
        self._due.set()

    def watch_staged(self, rooms: list[int]) -> None:
        """Each room comes back once its writer holds the rows, or once it has ended."""
        self._staged.extend(rooms)
        self._due.set()

    def watch_registered(self, rooms: list[int]) -> None:
        """Each room comes back, with its registration, once a receiver has registered it, or
        once it has ended."""
        self._until_registered.extend(rooms)
        self._due.set()

    def begin_write(self, writes: list[BeginWrite]) -> None:
        """Each room comes back begun (its view), or refused."""
        self._begins.extend(writes)
        self._due.set()

    def commit(self, commits: list[CommitBody]) -> None:
        """Each room comes back committed (its view), or refused."""
        self._commits.extend(commits)
        self._due.set()

    async def ping(self) -> None:
        await self._websocket.ping()

    async def receive(self) -> list[RoomResult]:
        """The next frame's results; ``HandshakeError`` once the stream has closed, saying why."""
        while True:
            message = await self._websocket.receive()
            self.last_heard = time.monotonic()
            if message.type is aiohttp.WSMsgType.TEXT or message.type is aiohttp.WSMsgType.BINARY:
                try:
                    return BatchResponse.model_validate_json(message.data).results
                except ValidationError as exc:
                    await self.close()
                    raise HandshakeError(0, f"malformed room-stream frame: {exc}") from exc
            if message.type is aiohttp.WSMsgType.PING:
                await self._websocket.pong(message.data)
            elif message.type is not aiohttp.WSMsgType.PONG:  # closing, closed or an error
                if self._writer.done() and not self._writer.cancelled():
                    error = self._writer.exception()
                else:
                    error = message.extra or self._websocket.exception()
                code = self._websocket.close_code
                raise HandshakeError(0, f"room stream closed ({code}): {error or 'by the peer'}")

    async def close(self) -> None:
        self._writer.cancel()
        await self._websocket.close()
        await asyncio.wait([self._writer])

    def _writer_ended(self, writer: asyncio.Task) -> None:
        """A send that failed ends the stream: its reader then says why."""
        if not writer.cancelled() and writer.exception() is not None:
            self._closing = asyncio.ensure_future(self._websocket.close())

    async def _write(self) -> None:
        while True:
            await self._due.wait()
            self._due.clear()
            while self._opens:
                ttl_s, rooms = self._opens.popitem()
                for chunk in step_frames(rooms):
                    await self._websocket.send_str(
                        StreamOpen(rooms=chunk, ttl_s=ttl_s).model_dump_json()
                    )
            for chunk in step_frames(self._registrations):
                await self._websocket.send_str(  # (validation would run each registration's
                    # Python checks again: 6 against 1.4 us for 8)
                    StreamRegister.model_construct(op="register", receivers=chunk).model_dump_json()
                )
            while self._cancels:
                rooms, reason = self._cancels.pop(0)
                await self._websocket.send_str(
                    StreamCancel(rooms=rooms, reason=reason).model_dump_json()
                )
            for rooms in step_frames(self._staged):
                await self._websocket.send_str(StreamWatchStaged(rooms=rooms).model_dump_json())
            for rooms in step_frames(self._until_registered):
                await self._websocket.send_str(StreamWatchRegistered(rooms=rooms).model_dump_json())
            for writes in step_frames(self._begins):
                await self._websocket.send_str(StreamBeginWrite(writes=writes).model_dump_json())
            for commits in step_frames(self._commits):
                await self._websocket.send_str(StreamCommit(commits=commits).model_dump_json())


def step_frames(pending: list):
    """``pending``'s entries (one step's calls of one kind) taken out at once and sent in frames:
    up to ``FRAME_ROOMS_WHOLE`` in one frame, more in two halves (each at most ``MAX_BATCH``);
    entries added while they are sent wait for the writer's next pass. The peer answers a frame
    once it has handled all of it; with every call of a step in one frame, callers that wait for
    the answers (lifecycles in a closed loop) move in lockstep and the two ends take turns, each
    idle while the other works (``docs/performance.md``, the handshake: 8-room lifecycles ran at
    two thirds of the rate). Two frames let the peer answer the first while the caller sends the
    second; more cost a frame's overhead each."""
    taken = pending[:]
    del pending[:]
    size = len(taken) if len(taken) <= FRAME_ROOMS_WHOLE else (len(taken) + 1) // 2
    size = max(1, min(size, MAX_BATCH))
    for start in range(0, len(taken), size):
        yield taken[start : start + size]


class OpenOnce:
    """Streams (or anything) opened once per key at a time: the first caller opens, every caller
    meanwhile awaits the same open; a caller that is cancelled leaves the open running for the
    others."""

    def __init__(self):
        self._opening: dict[Hashable, asyncio.Future] = {}

    async def __call__(self, key: Hashable, open_: Callable[[], Awaitable]):
        opening = self._opening.get(key)
        if opening is None:
            opening = self._opening[key] = asyncio.ensure_future(open_())
            opening.add_done_callback(lambda _: self._opening.pop(key, None))
        return await asyncio.shield(opening)
