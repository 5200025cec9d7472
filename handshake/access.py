"""How a writer reaches a room: in-process (the encode worker's own table, no HTTP to itself) or
over the room stream of another endpoint (a standalone ``epd-handshake``, or another worker's
table). Both raise ``RoomError`` subclasses, the remote one ``HandshakeError`` too. Waiting for a
room's receiver (``wait_registered``) runs on the caller's event loop and holds no thread; the other
calls block, and are made from other threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine

from handshake.rooms import RoomError, RoomNotFound, RoomTable
from loop_threads import LoopThread
from wire.room_client import HandshakeClient, HandshakeError
from wire.room_stream import OpenOnce, RoomStreamClient
from wire.rooms import BeginWrite, CommitBody, FailBody, RoomResult, RoomState, RoomView


class LocalRooms:
    in_process = True  # calls never leave this process (they cannot block on a peer)

    def __init__(self, table: RoomTable):
        self.table = table

    async def wait_registered(self, room: int, wait_s: float) -> RoomView | None:
        """The room's view once a receiver has registered it (or it has ended); None when it is
        still waiting for one after ``wait_s`` (or changed otherwise: staged)."""
        view = self.table.view(room)
        if view.state is RoomState.PENDING:
            (view,) = await self.table.watch({room: view.version}, wait_s)
            if isinstance(view, RoomError):
                raise view
        return None if view.state is RoomState.PENDING else view

    def begin_write(self, write: BeginWrite) -> RoomView:
        return self.table.begin_write(write)

    def commit(self, commit: CommitBody) -> RoomView:
        return self.table.commit(commit)

    def fail(self, room: int, reason: str, settled: bool, writer: str | None = None) -> RoomView:
        return self.table.fail(room, reason, settled, writer)


class RemoteRooms:
    """Another endpoint's rooms over one room stream to it, opened on first use and again once it
    has closed: a writer's waits, begins and commits made while ``loop`` runs one step share a
    frame each, and each room's answer comes back by its room (a writer has one call in flight
    per room). ``fail`` goes over REST (a failure is rare, and a REST call needs no stream). A
    stream that closes fails every call in flight on it; a call unanswered within the client's
    timeout closes the stream, as stalled. The blocking calls, for other threads, run on
    ``loop`` (None: the async calls only, on the caller's loop)."""

    in_process = False

    def __init__(self, loop: LoopThread | None, client: HandshakeClient):
        self.loop = loop
        self.client = client
        self._stream: RoomStreamClient | None = None
        self._open = OpenOnce()
        self._reader: asyncio.Task | None = None  # (the loop keeps only weak references)
        # by room: the calls in flight on the open stream (a stream's reader fails its own when it
        # closes); the loop's own
        self._calls: dict[int, asyncio.Future] = {}

    # ---- on the loop -----------------------------------------------------------------------

    async def wait_registered(self, room: int, wait_s: float) -> RoomView | None:
        """The room's view once a receiver has registered it (or it has ended); None when
        neither within ``wait_s``. The room is watched once: a call that gives up leaves the
        watch to the next one, and the stream answers it when the room has news (every room
        ends, at its deadline at the latest), so no second answer can meet a later call."""
        call = self._calls.get(room) or await self._start(
            room, lambda stream: stream.watch_registered([room])
        )
        try:
            async with asyncio.timeout(wait_s):
                return _view(await asyncio.shield(call))
        except TimeoutError:
            return None

    async def begin_write_async(self, write: BeginWrite) -> RoomView:
        return await self._call(write.room, lambda stream: stream.begin_write([write]))

    async def commit_async(self, commit: CommitBody) -> RoomView:
        return await self._call(commit.room, lambda stream: stream.commit([commit]))

    async def aclose(self) -> None:
        """Close the stream and the client."""
        if self._stream is not None:
            await self._stream.close()
        await self.client.close()

    async def _start(self, room: int, send: Callable[[RoomStreamClient], None]) -> asyncio.Future:
        stream = self._stream
        if stream is None or stream.closed:
            stream = await self._open(None, self._connect)
        call = self._calls[room] = asyncio.get_running_loop().create_future()
        send(stream)
        return call

    async def _call(self, room: int, send: Callable[[RoomStreamClient], None]) -> RoomView:
        call = await self._start(room, send)
        try:
            async with asyncio.timeout(self.client.timeout_s):
                return _view(await call)
        except TimeoutError:
            if self._calls.get(room) is call:
                del self._calls[room]
            stream, self._stream = self._stream, None
            if stream is not None:
                await stream.close()  # (its reader fails what else was in flight on it)
            raise HandshakeError(
                0, f"room stream: no answer for room {room} within {self.client.timeout_s:g} s"
            ) from None

    async def _connect(self) -> RoomStreamClient:
        stream = await RoomStreamClient.open(self.client)
        self._stream, self._calls = stream, {}
        self._reader = asyncio.create_task(self._read(stream, self._calls))
        return stream

    async def _read(self, stream: RoomStreamClient, calls: dict[int, asyncio.Future]) -> None:
        try:
            while True:
                for result in await stream.receive():
                    call = calls.pop(result.room, None)
                    if call is not None and not call.done():
                        call.set_result(result)
        except HandshakeError as exc:
            closed = exc
        if self._stream is stream:
            self._stream = None
        for call in calls.values():  # (a result: a watch nobody awaits any more logs nothing)
            if not call.done():
                call.set_result(closed)
        calls.clear()

    # ---- from other threads ----------------------------------------------------------------

    def begin_write(self, write: BeginWrite) -> RoomView:
        return self._blocking(self.begin_write_async(write))

    def commit(self, commit: CommitBody) -> RoomView:
        return self._blocking(self.commit_async(commit))

    def fail(self, room: int, reason: str, settled: bool, writer: str | None = None) -> RoomView:
        body = FailBody(room=room, reason=reason[:500], settled=settled, writer=writer)
        (result,) = self._blocking(self.client.fail([body]))
        return _view(result)

    def close(self) -> concurrent.futures.Future:
        """Close the stream and the client (the loop still running)."""
        return self.loop.submit(self.aclose())

    def _blocking(self, call: Coroutine):
        if self.loop is None or threading.current_thread() is self.loop.thread:
            call.close()  # (on the loop that serves it, it would wait for itself forever)
            raise RuntimeError("a blocking room call with no loop, or on the loop that serves it")
        return self.loop.run(call)


def _view(result: RoomResult | HandshakeError) -> RoomView:
    """A room's answer: its view, or the refusal (or the stream's end) raised."""
    if isinstance(result, HandshakeError):
        raise result
    if not result.ok:
        raise (RoomNotFound if result.status == 404 else RoomError)(result.error)
    return result.view
