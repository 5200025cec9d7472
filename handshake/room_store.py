"""The room table's state, below its transitions (``handshake.rooms``): the errors a room call
answers with, the table's limits, one room (``Room``, and its tombstone: a flat tuple of numbers,
strings and JSON bytes that the garbage collector does not track), what a call answers of a room
(``RoomStatus``), a long-poll waiter, and the store of a table's rooms (``RoomStore``).

With 130k tombstones kept as objects, each full collection paused the process (and so every
long-poll and, in an encode worker, the tower) for 0.3-0.5 s: ended rooms are kept as tuples,
the last ``RECENT_ROOMS`` as objects too."""

from __future__ import annotations

import asyncio
import collections
import heapq
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from epdserve.wire.rooms import CommitBody, Registration, RoomState, RoomView
from handshake import answers


class RoomError(Exception):
    status = 400


class RoomNotFound(RoomError):
    status = 404


class RoomConflict(RoomError):
    status = 409


class RoomsFull(RoomError):
    status = 503


RECENT_ROOMS = 1024  # ended rooms kept as objects beside their tombstones


MINTED_VERSION = 1  # a room's version when minted; every change adds one


@dataclass(slots=True)
class Room:
    room_id: int
    deadline: float
    state: RoomState = RoomState.PENDING
    version: int = MINTED_VERSION
    registration: Registration | None = None
    transport: str | None = None
    write_deadline: float | None = None
    commit: CommitBody | None = None
    reason: str | None = None
    cancel_requested: bool = False
    writer_settled: bool = False
    writer: str | None = None
    staged: bool = False  # the writer holds the rows, waiting for a receiver
    waiters: list = field(default_factory=list)
    # the registration's and the commit's JSON, made once (``take_registration``,
    # ``take_commit``): every view of the room and its tombstone splice them in
    registration_json: bytes | None = None
    commit_json: bytes | None = None

    def take_registration(self, registration: Registration) -> None:
        self.registration = registration
        self.registration_json = _json(registration)

    def take_commit(self, commit: CommitBody) -> None:
        self.commit = commit
        self.commit_json = _json(commit)

    def tombstone(self, ended_at: float) -> tuple:
        """The final state as a tuple the GC does not track (a terminal room never changes
        again)."""
        return (
            ended_at,
            self.room_id,
            self.deadline,
            self.state.value,
            self.version,
            self.registration_json,
            self.transport,
            self.commit_json,
            self.reason,
            self.cancel_requested,
            self.writer_settled,
        )

    @classmethod
    def from_tombstone(cls, record: tuple) -> Room:
        (
            _,
            room_id,
            deadline,
            state,
            version,
            registration,
            transport,
            commit,
            reason,
            cancel,
            settled,
        ) = record
        return cls(
            room_id,
            deadline,
            RoomState(state),
            version,
            Registration.model_validate_json(registration) if registration else None,
            transport,
            None,
            CommitBody.model_validate_json(commit) if commit else None,
            reason,
            cancel,
            settled,
            registration_json=registration,
            commit_json=commit,
        )


def _json(model: Registration | CommitBody) -> bytes:
    """The model's JSON (the serializer's bytes: model_dump_json's str, encoded, costs twice as
    much)."""
    return model.__pydantic_serializer__.to_json(model)


class RoomStatus(msgspec.Struct, frozen=True, gc=False):
    """A room as a call left it: ``RoomView``'s fields in its order, and the registration's and
    the commit's JSON the room made when it took them. Every room call answers each room with one
    (or with the ``RoomError`` why it refused it), made in the table's lock and read outside it:
    this process's own callers read its fields, the REST API and the room stream send its
    ``view_json``, a caller that wants the model takes its ``view``. A struct made in C (~0.2 us;
    a validated ``RoomView`` costs ~2 us); untracked by the garbage collector (it references only
    models, strings and bytes)."""

    room: int
    state: RoomState
    version: int
    registration: Registration | None
    transport: str | None
    commit: CommitBody | None
    reason: str | None
    staged: bool
    cancel_requested: bool
    writer_settled: bool
    expires_in_s: float
    registration_json: bytes | None
    commit_json: bytes | None

    def view_json(self, with_registration: bool = True, with_commit: bool = True) -> msgspec.Raw:
        """The view's document, without a model (``handshake.answers``); a writer's view leaves
        out the registration and the commit it sent, a receiver's the registration."""
        return answers.view(
            answers.ViewJson(
                self.room,
                self.state,
                self.version,
                _raw(self.registration_json) if with_registration else None,
                self.transport,
                _raw(self.commit_json) if with_commit else None,
                self.reason,
                self.staged,
                self.cancel_requested,
                self.writer_settled,
                self.expires_in_s,
            )
        )

    def view(self) -> RoomView:
        # Validated, though the table checked every field: pydantic-core's validation costs less
        # than model_construct (2.1 against 2.6 us), which runs in Python.
        return RoomView(
            room=self.room,
            state=self.state,
            version=self.version,
            registration=self.registration,
            transport=self.transport,
            commit=self.commit,
            reason=self.reason,
            staged=self.staged,
            cancel_requested=self.cancel_requested,
            writer_settled=self.writer_settled,
            expires_in_s=self.expires_in_s,
        )


def _raw(document: bytes | None) -> msgspec.Raw | None:
    return None if document is None else msgspec.Raw(document)


@dataclass(frozen=True)
class RoomLimits:
    max_live_rooms: int = 65536
    max_tombstones: int = 131072
    tombstone_ttl_s: float = 120.0
    # the longest a minted room lives: a flood of rooms nobody uses holds the table at most this
    # long
    max_ttl_s: float = 300.0


class Waiter:
    """Woken when any room it watches changes (``until_ended``: ends), from any thread; armed on
    its event loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, until_ended: bool = False):
        self.loop = loop
        self.until_ended = until_ended
        self.future = loop.create_future()
        self.thread = threading.get_ident()

    def wake(self) -> None:
        if threading.get_ident() == self.thread:  # a change made on the waiter's own loop
            self._resolve()
        else:
            self.loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class RoomStore:
    """The rooms of one table and their bookkeeping: the live rooms, the ended ones as tombstones
    (the last ``RECENT_ROOMS`` as objects too), counts by state, and a heap of deadlines (stale
    entries skipped). Every method but ``schedule`` reads or changes them: its caller holds
    ``lock``."""

    def __init__(self, limits: RoomLimits, clock: Callable[[], float]):
        self.limits = limits
        self.clock = clock
        self.lock = threading.Lock()
        self.rooms: dict[int, Room] = {}  # live rooms
        self.tombstones: collections.OrderedDict[int, tuple] = (
            collections.OrderedDict()
        )  # oldest first
        # The rooms that ended last, as objects too: a view of a room that just ended (the
        # receiver's long-poll answered by the commit) is not parsed back from its tombstone.
        self.recent: collections.OrderedDict[int, Room] = collections.OrderedDict()
        self.counts = collections.Counter()  # rooms now in each state
        self.entered = collections.Counter()  # transitions into each state, ever (a metric)
        self.due: list[tuple[float, int]] = []  # (deadline, room id) heap

    def known(self, room_id: int) -> bool:
        """Whether the id is or was a room here (ids are never reused)."""
        return room_id in self.rooms or room_id in self.tombstones

    def schedule(self, deadline: float, room_id: int) -> None:
        """Look at the room again at ``deadline`` (a later deadline of it is skipped then)."""
        heapq.heappush(self.due, (deadline, room_id))

    def deadline(self, ttl_s: float) -> float:
        if not 0 < ttl_s <= self.limits.max_ttl_s:
            raise RoomError(
                f"ttl_s {ttl_s} is outside (0, {self.limits.max_ttl_s}], this table's room lifetime"
            )
        return self.clock() + ttl_s

    def make_room_for(self, count: int) -> None:
        self.sweep()
        if len(self.rooms) + count > self.limits.max_live_rooms:
            raise RoomsFull(f"{self.limits.max_live_rooms} live rooms already; retry shortly")

    def add(self, room_id: int, deadline: float) -> None:
        self.rooms[room_id] = Room(room_id, deadline)
        self.schedule(deadline, room_id)
        self.counts[RoomState.PENDING] += 1
        self.entered[RoomState.PENDING] += 1

    def remove_untouched(self, room_id: int) -> None:
        """Undo ``add`` for a room nobody has touched (its ``due`` entry is skipped when it comes
        up); it was never handed out, so it leaves no tombstone."""
        del self.rooms[room_id]
        self.counts[RoomState.PENDING] -= 1

    def sweep(self) -> None:
        now = self.clock()
        while self.due and self.due[0][0] <= now:
            _, room_id = heapq.heappop(self.due)
            room = self.rooms.get(room_id)
            if room is not None:
                self.expire_if_due(room, now)
        ttl_edge = now - self.limits.tombstone_ttl_s
        while self.tombstones and next(iter(self.tombstones.values()))[0] <= ttl_edge:
            self.drop_oldest_tombstone()

    def drop_oldest_tombstone(self) -> None:
        room_id, record = self.tombstones.popitem(last=False)
        self.recent.pop(room_id, None)
        self.counts[RoomState(record[3])] -= 1

    def get(self, room_id: int) -> Room:
        room = self.rooms.get(room_id)
        if room is not None:
            self.expire_if_due(room, self.clock())
            return room
        recent = self.recent.get(room_id)  # ended rooms never change: the object is the tombstone
        if recent is not None:
            return recent
        record = self.tombstones.get(room_id)
        if record is None:
            raise RoomNotFound(
                f"room {room_id} is unknown here (never minted, or its tombstone expired)"
            )
        return Room.from_tombstone(record)

    def expire_if_due(self, room: Room, now: float) -> None:
        if room.state.terminal:
            return
        if (
            room.state is RoomState.WRITING
            and room.write_deadline is not None
            and now >= room.write_deadline
        ):
            room.reason = room.reason or "the writer reported no outcome before its write deadline"
            self.move(room, RoomState.CANCELLED if room.cancel_requested else RoomState.EXPIRED)
        elif now >= room.deadline:
            room.reason = room.reason or "the room's deadline passed"
            room.writer_settled = room.state is not RoomState.WRITING
            self.move(room, RoomState.EXPIRED)

    def move(self, room: Room, new: RoomState) -> None:
        old = room.state
        room.state = new
        self.counts[old] -= 1
        self.counts[new] += 1
        self.entered[new] += 1
        self.touch(room)
        if new.terminal:
            del self.rooms[room.room_id]
            self.tombstones[room.room_id] = room.tombstone(self.clock())
            self.recent[room.room_id] = room
            if len(self.recent) > RECENT_ROOMS:
                self.recent.popitem(last=False)
            while len(self.tombstones) > self.limits.max_tombstones:
                self.drop_oldest_tombstone()

    def touch(self, room: Room) -> None:
        room.version += 1
        ended = room.state.terminal
        waiters, room.waiters = room.waiters, []
        for waiter in waiters:  # until_ended: woken by the end only; else by any change
            if waiter.until_ended and not ended:
                room.waiters.append(waiter)
            else:
                waiter.wake()

    def status(self, room: Room) -> RoomStatus:
        """The room as it is now (``RoomStatus``)."""
        return RoomStatus(
            room.room_id,
            room.state,
            room.version,
            room.registration,
            room.transport,
            room.commit,
            room.reason,
            room.staged,
            room.cancel_requested,
            room.writer_settled,
            max(0.0, room.deadline - self.clock()),
            room.registration_json,
            room.commit_json,
        )
