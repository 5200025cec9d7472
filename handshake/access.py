"""How a writer reaches a room: in-process (the encode worker's own table, no HTTP to itself) or
over the room stream of another endpoint (a standalone ``epd-handshake``, or another worker's table;
a dispatcher opens its rooms at a standalone ``epd-handshake`` the same way). Both raise
``RoomError`` subclasses, the remote one ``HandshakeError`` too. Waiting for a room's receiver
(``wait_registered``) runs on the caller's event loop and holds no thread; the other calls block,
and are made from other threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine

from epdserve.loop_threads import LoopThread
from epdserve.wire.room_client import HandshakeClient, HandshakeError
from epdserve.wire.room_stream import OpenOnce, RoomStreamClient
from epdserve.wire.rooms import (
    MAX_BATCH,
    BeginWrite,
    CommitBody,
    FailBody,
    RoomResult,
    RoomState,
    RoomView,
    check_room_ttl,
)
from handshake.rooms import RoomConflict, RoomError, RoomNotFound, RoomsFull, RoomTable

# a refusal's status -> the error it was raised as at the table
REFUSALS = {error.status: error for error in (RoomNotFound, RoomConflict, RoomsFull)}
# opens whose stream ended before their answer (they may be open), refused if asked for again:
# the newest kept
MAX_LOST_OPENS = 4096
# After its stream ended, a lost open's cancel goes out over REST at once, then again, for the rooms
# still unknown there or not reached, at each of these (an open on a stalled connection may land
# after the first cancel; a room never opened is answered unknown each time).
LOST_OPEN_CANCEL_AT_S = (0.0, 1.0, 10.0)
LOST_OPEN_REASON = "opened by a dispatcher that never learnt it was: its room stream ended first"


class LocalRooms:
    in_process = True  # calls never leave this process (they cannot block on a peer)

    def __init__(self, table: RoomTable):
        self.table = table

    async def wait_registered(self, room: int, wait_s: float) -> RoomView | None:
        """The room's view once a receiver has registered it (or it has ended); None when it is
        still waiting for one after ``wait_s`` (or changed otherwise: staged)."""
        status = self.table.status(room)
        if status.state is RoomState.PENDING:
            (status,) = await self.table.watch({room: status.version}, wait_s)
            if isinstance(status, RoomError):
                raise status
        return None if status.state is RoomState.PENDING else status.view()

    def begin_write(self, write: BeginWrite) -> RoomView:
        return self.table.begin_write(write)

    def commit(self, commit: CommitBody) -> RoomView:
        return self.table.commit(commit)

    def fail(self, room: int, reason: str, settled: bool, writer: str | None = None) -> RoomView:
        return self.table.fail(room, reason, settled, writer)


class _OpenStream:
    """A room stream and the calls in flight on it, by room; its reader and guard tasks. Once it
    has ended, every call on it has its answer (the error) and no call is added."""

    __slots__ = ("stream", "calls", "opens", "waiting_since", "tasks", "ended")

    def __init__(self, stream: RoomStreamClient):
        self.stream = stream
        self.calls: dict[int, asyncio.Future] = {}
        self.opens: set[int] = set()  # the rooms among ``calls`` whose call is an open
        self.waiting_since = time.monotonic()  # since when some call has waited (when any has)
        self.tasks: tuple[asyncio.Task, ...] = ()  # (the loop keeps only weak references)
        self.ended = False

    def end(self, error: HandshakeError) -> list[int]:
        """Every call in flight answered with ``error`` (a result: a watch nobody awaits any
        more logs nothing); the rooms whose open was in flight (they may be open)."""
        self.ended = True
        lost = [room for room in self.calls if room in self.opens]
        for call in self.calls.values():
            if not call.done():
                call.set_result(error)
        self.calls.clear()
        self.opens.clear()
        return lost


class RemoteRooms:
    """Another endpoint's rooms over one room stream to it, opened on first use and again once it
    has ended: a writer's waits, begins and commits (a dispatcher's opens) made while ``loop`` runs
    one step share a frame each, and each room's answer comes back by its room (a caller has one
    call in flight per room). ``fail`` goes over REST (a failure is rare, and a REST call needs no
    stream).

    A stream that ends answers every call in flight on it with why: a wait goes on over a new
    stream, a begin or a commit is sent once more there (both are idempotent: a commit that landed
    is answered as landed), and an endpoint that cannot be reached fails the call. A stream silent
    for half the client's timeout while calls wait on it is pinged, and one silent for the whole
    timeout is ended as stalled (a guard per stream: no timer per call). The blocking calls, for
    other threads, run on ``loop`` (None: the async calls only, on the caller's loop)."""

    in_process = False

    def __init__(self, loop: LoopThread | None, client: HandshakeClient):
        self.loop = loop
        self.client = client
        self._open: _OpenStream | None = None  # the loop's own
        self._opening = OpenOnce()
        # every stream's reader and guard not ended yet, and the lost opens' cancels
        self._tasks: set[asyncio.Task] = set()
        self._lost_opens: dict[int, None] = {}  # (oldest first) refused if asked for again

    # ---- on the loop -----------------------------------------------------------------------

    async def wait_registered(self, room: int, wait_s: float) -> RoomView | None:
        """The room's view once a receiver has registered it (or it has ended); None when
        neither within ``wait_s``, or when the stream ended meanwhile (the next call watches on
        a new one). The room is watched once per stream: a call that gives up leaves the watch
        to the next one, and the stream answers it when the room has news (every room ends, at
        its deadline at the latest), so no second answer can meet a later call."""
        open_ = self._open
        call = open_.calls.get(room) if open_ is not None and not open_.ended else None
        if call is None:
            call = await self._start(room, lambda stream: stream.watch_registered([room]))
        try:
            async with asyncio.timeout(wait_s):
                await asyncio.shield(call)
        except TimeoutError:
            if not call.done():  # (its answer may have come in the step the timeout fired)
                return None
        result = call.result()
        return None if isinstance(result, HandshakeError) else _view(result)

    async def open_rooms(
        self, rooms: list[int], ttl_s: float
    ) -> list[RoomView | RoomError | HandshakeError]:
        """Open rooms with the ids the caller drew (a dispatcher's), sent together: each room's
        view, or why it is not open (an id asked for twice, or with a call in flight, is refused
        here). An open is sent once: when the stream ends first, the room may be open or not; it
        is answered as not, refused if asked for again, and cancelled (nobody else knows its id:
        a room that was not opened is answered unknown there; the one hazard, an id drawn from 63
        random bits that was someone else's room, is a chance of 1e-14 per lost open with 100,000
        rooms live). The cancel goes over
        REST, and again while the room is unknown there (``LOST_OPEN_CANCEL_AT_S``: an open on a
        stalled connection may land after it); a room whose open lands after the last, or whose
        endpoint stays unreachable that long, or whose owner stops first, expires at its TTL.
        ``ValueError`` for a TTL the wire cannot carry."""
        check_room_ttl(ttl_s)  # (raised from a send, it would leave the calls started so far)
        calls: list[asyncio.Future | RoomError] = []
        try:
            for room in rooms:
                open_ = self._open
                if open_ is not None and room in open_.calls:
                    calls.append(RoomConflict(f"room {room} has a call in flight already"))
                elif room in self._lost_opens:
                    calls.append(RoomConflict(f"room {room}: its open was lost, it is cancelled"))
                else:
                    calls.append(
                        await self._start(
                            room, lambda stream, r=room: stream.open_rooms([r], ttl_s), opens=True
                        )
                    )
        except HandshakeError as exc:  # no stream could be opened (the rooms asked for so far
            # are answered on the stream that ended)
            calls.extend([exc] * (len(rooms) - len(calls)))
        answers = []
        for call in calls:
            try:
                answers.append(_view(await call) if isinstance(call, asyncio.Future) else call)
            except (RoomError, HandshakeError) as exc:
                answers.append(exc)
        return answers

    async def begin_write_async(self, write: BeginWrite) -> RoomView:
        return await self._call(write.room, lambda stream: stream.begin_write([write]))

    async def commit_async(self, commit: CommitBody) -> RoomView:
        return await self._call(commit.room, lambda stream: stream.commit([commit]))

    async def aclose(self) -> None:
        """Close the stream and the client."""
        open_, self._open = self._open, None
        if open_ is not None:  # (its lost opens are left to their TTL: no stream follows)
            open_.end(HandshakeError(0, "room stream closed: its owner stops"))
            await open_.stream.close()
        tasks = list(self._tasks)  # (streams that ended before: a guard may still sleep)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        await self.client.close()

    async def _call(self, room: int, send: Callable[[RoomStreamClient], None]) -> RoomView:
        """The call's answer; sent once more on a new stream when its stream ended first."""
        result = await (await self._start(room, send))
        if isinstance(result, HandshakeError):
            result = await (await self._start(room, send))
        return _view(result)

    async def _start(
        self, room: int, send: Callable[[RoomStreamClient], None], opens: bool = False
    ) -> asyncio.Future:
        """The call sent (``send``; ``opens``: it opens the room), its answer to come: the room's
        result, or why the stream ended first. ``HandshakeError`` when no stream can be opened."""
        open_ = self._open
        if open_ is None or open_.ended:
            open_ = await self._opening(None, self._connect)
            if open_.ended:  # it ended as it opened
                raise HandshakeError(0, "the room stream closed as it opened")
        if not open_.calls:
            open_.waiting_since = time.monotonic()
        call = open_.calls[room] = asyncio.get_running_loop().create_future()
        if opens:
            open_.opens.add(room)
        send(open_.stream)
        return call

    async def _connect(self) -> _OpenStream:
        open_ = self._open = _OpenStream(await RoomStreamClient.open(self.client))
        open_.tasks = (
            asyncio.create_task(self._read(open_)),
            asyncio.create_task(self._guard(open_)),
        )
        for task in open_.tasks:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return open_

    async def _read(self, open_: _OpenStream) -> None:
        error = HandshakeError(0, "room stream closed")
        try:
            while True:
                for result in await open_.stream.receive():
                    open_.opens.discard(result.room)
                    call = open_.calls.pop(result.room, None)
                    if call is not None and not call.done():
                        call.set_result(result)
        except HandshakeError as exc:
            error = exc
        except Exception as exc:  # (aiohttp's, a transport closing under a pong)
            error = HandshakeError(0, f"room stream closed: {type(exc).__name__}: {exc}")
        finally:  # (cancelled too: the owner stops)
            self._ended(open_, error)
            await open_.stream.close()  # (its writer would wait for calls forever)

    async def _guard(self, open_: _OpenStream) -> None:
        timeout_s = self.client.timeout_s
        while not open_.ended:
            await asyncio.sleep(timeout_s / 4)
            heard = max(open_.stream.last_heard, open_.waiting_since)
            silent_s = time.monotonic() - heard
            if open_.ended or not open_.calls or silent_s < timeout_s / 2:
                continue
            if silent_s < timeout_s:
                try:
                    await open_.stream.ping()
                    continue
                except Exception as exc:  # (aiohttp's: the transport is closing)
                    error = HandshakeError(0, f"room stream closed: {type(exc).__name__}: {exc}")
            else:
                error = HandshakeError(0, f"room stream silent for {silent_s:.1f} s: stalled")
            self._ended(open_, error)
            await open_.stream.close()

    def _ended(self, open_: _OpenStream, error: HandshakeError) -> None:
        if self._open is open_:
            self._open = None
        lost = open_.end(error)
        for room in lost:  # (the newest MAX_LOST_OPENS kept)
            self._lost_opens[room] = None
            if len(self._lost_opens) > MAX_LOST_OPENS:
                del self._lost_opens[next(iter(self._lost_opens))]
        if lost:
            task = asyncio.get_running_loop().create_task(self._cancel_lost(lost))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _cancel_lost(self, rooms: list[int]) -> None:
        """Cancel the rooms whose open was lost with their stream, over REST (a room no call
        waits on needs no stream): at once, then again for those still unknown there or not
        reached, at each of ``LOST_OPEN_CANCEL_AT_S``; a room that was opened ends CANCELLED
        with why."""
        started = time.monotonic()
        for at_s in LOST_OPEN_CANCEL_AT_S:
            await asyncio.sleep(max(0.0, started + at_s - time.monotonic()))
            left = []
            for start in range(0, len(rooms), MAX_BATCH):
                chunk = rooms[start : start + MAX_BATCH]
                try:
                    results = await self.client.cancel(chunk, LOST_OPEN_REASON)
                except HandshakeError:  # not reached: again at the next time
                    left += chunk
                    continue
                left += [r.room for r in results if r.status == RoomNotFound.status]
            rooms = left
            if not rooms:
                return

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
        """``call``'s result. Every call is answered within the stream guard's bounds (a stalled
        stream ends after the client's timeout, and the call is tried once more); the wait is
        bounded here too."""
        if self.loop is None or threading.current_thread() is self.loop.thread:
            call.close()  # (on the loop that serves it, it would wait for itself forever)
            raise RuntimeError("a blocking room call with no loop, or on the loop that serves it")
        bound_s = 4 * self.client.timeout_s + 1
        future = self.loop.submit(call)
        try:
            return future.result(bound_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise HandshakeError(0, f"room call unanswered for {bound_s:g} s") from None


def _view(result: RoomResult | HandshakeError) -> RoomView:
    """A room's answer: its view, or the refusal (or the stream's end) raised."""
    if isinstance(result, HandshakeError):
        raise result
    if not result.ok:
        raise REFUSALS.get(result.status, RoomError)(result.error)
    return result.view
