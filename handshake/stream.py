"""The room stream (``/v1/rooms/stream``): one WebSocket per receiver (or writer) and room API,
carrying its registrations in and each registered room's end out, so a receiver pays one frame per
batch of rooms in either direction instead of a register call and a long-poll per request; a writer
whose rooms live here waits for their receivers, begins and commits its writes over it the same way.

A frame in is a ``StreamRegister`` or a ``StreamCancel`` (``wire.rooms.STREAM_FRAME``), applied as
the REST calls apply them, a dispatcher's ``StreamOpen`` (rooms with the ids it drew, each
answered), a ``StreamWatchStaged`` (a gateway's: each room pushed once its writer
holds the rows, or once it ended), or a writer's ``StreamWatchRegistered`` (each room pushed with
its registration once registered, or once it ended), ``StreamBeginWrite`` or ``StreamCommit``
(applied as the REST calls, each room answered). A frame out is a ``BatchResponse``: the calls
answered and the rooms that ended (or have what they were watched for) since the last frame (every
room that ends while the loop runs one step goes out in one frame: a batch committed together is
one frame). A malformed frame closes the stream (1007, with the reason). When the stream closes, its
rooms go on without it: their writer still commits or fails them, and nobody is told."""

from __future__ import annotations

import asyncio
import threading
import time

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from epdserve.wire.rooms import (
    LOST_AFTER_REGISTRATION,
    MAX_BATCH,
    STREAM_FRAME,
    STREAM_PATH,
    RoomState,
    StreamBeginWrite,
    StreamCancel,
    StreamOpen,
    StreamRegister,
    StreamWatchRegistered,
    StreamWatchStaged,
)
from handshake import answers
from handshake.rooms import RoomError, RoomStatus, RoomTable

POLICY_VIOLATION = 1008  # WebSocket close codes (RFC 6455)
INVALID_PAYLOAD = 1007
MAX_UNSENT = 65536  # answers not yet sent (a client that sends and never reads): closed beyond


class _EndOf:
    """A room's end, as the table tells its waiters: ``wake`` from whichever thread ended it."""

    __slots__ = ("stream", "room")
    until_ended = True
    with_registration = False  # the view pushed carries the room's registration

    def __init__(self, stream: RoomStream, room: int):
        self.stream = stream
        self.room = room

    @staticmethod
    def has_news(state, staged: bool) -> bool:
        return False  # only its end, which the table checks itself

    def wake(self) -> None:
        self.stream.ended(self.room)


class _StagedOrEnded(_EndOf):
    """Woken by any change of the room: the stream pushes it once it is staged or has ended,
    and listens again otherwise."""

    __slots__ = ()
    until_ended = False

    @staticmethod
    def has_news(state, staged: bool) -> bool:
        return staged

    def wake(self) -> None:
        self.stream.changed(self.room)


class _RegisteredOrEnded(_StagedOrEnded):
    """Woken by any change of the room: pushed, with its registration, once a receiver has
    registered it or once it has ended."""

    __slots__ = ()
    with_registration = True

    @staticmethod
    def has_news(state, staged: bool) -> bool:
        return state is not RoomState.PENDING


class RoomStream:
    """One client's stream over ``table``; ``observe(route, method, seconds)`` times each frame
    in."""

    def __init__(self, table: RoomTable, websocket: WebSocket, observe):
        self.table = table
        self.websocket = websocket
        self.observe = observe
        self.loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._listening: dict[int, _EndOf] = {}  # pushed once they have news, not yet
        self._out: list[answers.ResultJson] = []  # answers and refusals, for the next frame
        self._ended: list[int] = []  # rooms that ended, to go out with the next frame
        self._registered: list[int] = []  # the same, pushed with their registration
        self._news = asyncio.Event()
        self._closing: asyncio.Future | None = None  # the close a failed writer started

    async def serve(self) -> None:
        await self.websocket.accept()
        writer = asyncio.create_task(self._write())
        writer.add_done_callback(self._writer_ended)
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                started = time.perf_counter()
                raw = message.get("bytes") or message.get("text") or b""
                try:
                    frame = STREAM_FRAME.validate_json(raw)
                except ValidationError as exc:
                    reason = f"malformed frame: {exc.errors(include_url=False)[0]['msg']}"
                    await self.websocket.close(INVALID_PAYLOAD, reason[:120])
                    return
                if isinstance(frame, StreamRegister):
                    self._register(frame)
                elif isinstance(frame, StreamOpen):
                    self._answer(frame.rooms, self.table.open_all(frame.rooms, frame.ttl_s))
                elif isinstance(frame, StreamCancel):
                    self._cancel(frame)
                elif isinstance(frame, StreamWatchStaged):
                    self._watch(frame.rooms, _StagedOrEnded)
                elif isinstance(frame, StreamWatchRegistered):
                    self._watch(frame.rooms, _RegisteredOrEnded)
                elif isinstance(frame, StreamBeginWrite):
                    self._answer_writer(
                        [write.room for write in frame.writes],
                        self.table.begin_writes(frame.writes),
                    )
                else:
                    self._answer_writer(
                        [commit.room for commit in frame.commits],
                        self.table.commit_all(frame.commits),
                    )
                self.observe(STREAM_PATH, frame.op, time.perf_counter() - started)
                if len(self._out) + len(self._ended) + len(self._registered) > MAX_UNSENT:
                    await self.websocket.close(POLICY_VIOLATION, "answers left unread")
                    return
        except WebSocketDisconnect:
            return
        finally:
            writer.cancel()
            self.table.stop_listening(self._listening)
            self._listening.clear()

    def _writer_ended(self, writer: asyncio.Task) -> None:
        """A send that failed (the client went away mid-frame) ends the stream."""
        if not writer.cancelled() and writer.exception() is not None:
            self._closing = asyncio.ensure_future(self.websocket.close())

    def ended(self, room: int) -> None:
        """A registered room ended (any thread; the table's lock may be held): it goes out with
        the next frame."""
        if threading.get_ident() != self._thread:
            self._from_another_thread(self.ended, room)
            return
        listener = self._listening.pop(room, None)
        if listener is not None:
            (self._registered if listener.with_registration else self._ended).append(room)
            self._news.set()

    def changed(self, room: int) -> None:
        """A room watched until staged changed (any thread, the table's lock held): looked at
        on the loop's next step."""
        if threading.get_ident() != self._thread:
            self._from_another_thread(self._recheck, room)
        else:
            self.loop.call_soon(self._recheck, room)

    def _from_another_thread(self, callback, room: int) -> None:
        try:
            self.loop.call_soon_threadsafe(callback, room)
        except RuntimeError:  # the loop is closed: the stream is gone, nobody to tell
            if not self.loop.is_closed():
                raise

    def _recheck(self, room: int) -> None:
        """Pushed if it is staged or ended, else listened to again."""
        listener = self._listening.get(room)
        if listener is not None and not self.table.listen(room, listener):
            self.ended(room)

    def _register(self, frame: StreamRegister) -> None:
        registered = self.table.register_all(frame.receivers)
        for registration, status in zip(frame.receivers, registered):
            room = registration.room
            if isinstance(status, RoomError):
                self._refuse(room, status)
            elif room not in self._listening:  # (else a retry of a registration it holds)
                self._listen(room, _EndOf(self, room))

    def _watch(self, rooms: list[int], listener: type[_StagedOrEnded]) -> None:
        for room in rooms:
            if room not in self._listening:
                self._listen(room, listener(self, room))

    def _listen(self, room: int, listener: _EndOf) -> None:
        self._listening[room] = listener
        if not self.table.listen(room, listener):  # there already (or unknown): its view now
            self.ended(room)

    def _cancel(self, frame: StreamCancel) -> None:
        for room, status in zip(frame.rooms, self.table.cancel_all(frame.rooms, frame.reason)):
            if isinstance(status, RoomError):
                self._refuse(room, status)

    def _refuse(self, room: int, error: RoomError) -> None:
        self._out.append(answers.refused(room, str(error), error.status))
        self._news.set()

    def _answer(self, rooms: list[int], statuses: list[RoomStatus | RoomError]) -> None:
        """A call answered per room (an open): each room's view or why it was refused, in the
        next frame."""
        self._out += _pushed(rooms, statuses)
        self._news.set()

    def _answer_writer(self, rooms: list[int], statuses: list[RoomStatus | RoomError]) -> None:
        """A writer's call answered per room (a begin, a commit): each room's view without the
        registration and the commit (the writer has them), or why it was refused."""
        self._out += _pushed(rooms, statuses, with_registration=False, with_commit=False)
        self._news.set()

    async def _write(self) -> None:
        while True:
            await self._news.wait()
            self._news.clear()
            # (a room asked for twice in a frame goes out once: the views are made per room)
            ended, self._ended = list(dict.fromkeys(self._ended)), []
            registered, self._registered = list(dict.fromkeys(self._registered)), []
            results, self._out = self._out, []
            # a registered room whose end cannot be told is lost; a watched one unknown, or gone
            results += _pushed(
                ended,
                self.table.statuses(ended),
                with_registration=False,
                refused_status=LOST_AFTER_REGISTRATION,
            )
            results += _pushed(registered, self.table.statuses(registered))
            for start in range(0, len(results), MAX_BATCH):  # a frame within the peer's limit
                await self.websocket.send_text(answers.frame(results[start : start + MAX_BATCH]))


def _pushed(
    rooms: list[int],
    statuses: list[RoomStatus | RoomError],
    with_registration: bool = True,
    with_commit: bool = True,
    refused_status: int | None = None,
) -> list[answers.ResultJson]:
    """Each room's view (its JSON: ``RoomStatus.view_json``) as pushed, or why there is none (with
    ``refused_status``, else the error's own)."""
    return [
        answers.refused(room, str(status), refused_status or status.status)
        if isinstance(status, RoomError)
        else answers.viewed(room, status.view_json(with_registration, with_commit))
        for room, status in zip(rooms, statuses)
    ]
