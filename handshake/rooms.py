"""The room table: one state machine per item, bounded, thread-safe, with long-poll waiters.

States move forward only: PENDING -> REGISTERED -> WRITING -> SUCCESS, and any live state ->
FAILED / CANCELLED / EXPIRED. No step is skipped: a commit needs a begun write (the one writer
that began it, when either names itself), a registration a room that has not ended. Terminal states
are sticky; every call is idempotent (a retry gets the same answer, a conflicting call gets
``RoomConflict`` and changes nothing). A cancel that arrives during a write is recorded and applied
when the writer reports its outcome (or its write deadline passes). Rooms live at most
``max_ttl_s``; terminal rooms stay as tombstones for ``tombstone_ttl_s`` and at most
``max_tombstones``; live rooms are capped at ``max_live_rooms``.

A tombstone is a flat tuple of numbers, strings and JSON bytes, which the garbage collector does
not track: with 130k tombstones kept as objects, each full collection paused the process (and so
every long-poll and, in an encode worker, the tower) for 0.3-0.5 s.

The table is used in-process by the encode worker and over REST (``handshake.app``) by everyone
else; waiters are woken across threads and event loops.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from wire.rooms import (
    MAX_ROOM_ID,
    BeginWrite,
    CommitBody,
    Registration,
    RoomState,
    RoomView,
)


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
class _Room:
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
    waiters: list = field(default_factory=list)

    def tombstone(self, ended_at: float) -> tuple:
        """The final state as a tuple the GC does not track (a terminal room never changes
        again)."""
        registration = self.registration.model_dump_json().encode() if self.registration else None
        commit = self.commit.model_dump_json().encode() if self.commit else None
        return (
            ended_at,
            self.room_id,
            self.deadline,
            self.state.value,
            self.version,
            registration,
            self.transport,
            commit,
            self.reason,
            self.cancel_requested,
            self.writer_settled,
        )

    @classmethod
    def from_tombstone(cls, record: tuple) -> _Room:
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
        )


@dataclass(frozen=True)
class RoomLimits:
    max_live_rooms: int = 65536
    max_tombstones: int = 131072
    tombstone_ttl_s: float = 120.0
    # the longest a minted room lives: a flood of rooms nobody uses holds the table at most this
    # long
    max_ttl_s: float = 300.0


class _Waiter:
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


class RoomTable:
    def __init__(
        self, limits: RoomLimits = RoomLimits(), clock: Callable[[], float] = time.monotonic
    ):
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}  # live rooms
        self._tombstones: collections.OrderedDict[int, tuple] = (
            collections.OrderedDict()
        )  # oldest first
        # The rooms that ended last, as objects too: a view of a room that just ended (the
        # receiver's long-poll answered by the commit) is not parsed back from its tombstone.
        self._recent: collections.OrderedDict[int, _Room] = collections.OrderedDict()
        self._counts = collections.Counter()  # rooms now in each state
        self._entered = collections.Counter()  # transitions into each state, ever (a metric)
        self._due: list[tuple[float, int]] = []  # (deadline, room id) heap; stale entries skipped
        self.waiters = 0

    # ---- queries ---------------------------------------------------------------------------

    def counts(self) -> dict[RoomState, int]:
        with self._lock:
            return {state: self._counts[state] for state in RoomState}

    def entered(self) -> dict[RoomState, int]:
        """How many times a room entered each state (minting enters PENDING)."""
        with self._lock:
            return {state: self._entered[state] for state in RoomState}

    @property
    def live_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    def full(self) -> bool:
        """True while no room can be minted (rooms past their deadline are expired first)."""
        with self._lock:
            self._sweep_locked()
            return len(self._rooms) >= self.limits.max_live_rooms

    def view(self, room_id: int) -> RoomView:
        with self._lock:
            return self._view(self._get(room_id))

    # ---- transitions -----------------------------------------------------------------------

    def mint(self, count: int, ttl_s: float) -> list[int]:
        """``count`` new rooms with unique random ids."""
        deadline = self._deadline(ttl_s)
        with self._lock:
            self._make_room_for(count)
            minted = []
            while len(minted) < count:
                room_id = secrets.randbelow(MAX_ROOM_ID) + 1
                if room_id not in self._rooms and room_id not in self._tombstones:  # never reused
                    self._add(room_id, deadline)
                    minted.append(room_id)
            return minted

    def open(self, room_id: int, ttl_s: float) -> None:
        """A room with the id its sender chose (an encode worker's intake opens the room a
        dispatcher named, so that minting costs no call of its own). ``RoomConflict`` when the id
        is or was in use here: ids are never reused."""
        if not 1 <= room_id <= MAX_ROOM_ID:
            raise RoomError(f"room id {room_id} is outside [1, {MAX_ROOM_ID}]")
        deadline = self._deadline(ttl_s)
        with self._lock:
            if room_id in self._rooms or room_id in self._tombstones:
                raise RoomConflict(f"room {room_id} exists already")
            self._make_room_for(1)
            self._add(room_id, deadline)

    def discard(self, room_id: int) -> None:
        """Forget a room ``open`` made that nobody has touched since (still PENDING at its first
        version), leaving no tombstone: its opener refused the item after all, and the id was
        never handed out. ``RoomConflict`` for any other room."""
        with self._lock:
            room = self._rooms.get(room_id)
            untouched = room is not None and room.version == MINTED_VERSION
            if not untouched or room.state is not RoomState.PENDING:
                raise RoomConflict(f"room {room_id} is not an untouched pending room")
            del self._rooms[room_id]  # its entry in _due is skipped when it comes up
            self._counts[RoomState.PENDING] -= 1

    def _deadline(self, ttl_s: float) -> float:
        if not 0 < ttl_s <= self.limits.max_ttl_s:
            raise RoomError(
                f"ttl_s {ttl_s} is outside (0, {self.limits.max_ttl_s}], this table's room lifetime"
            )
        return self._clock() + ttl_s

    def _make_room_for(self, count: int) -> None:
        self._sweep_locked()
        if len(self._rooms) + count > self.limits.max_live_rooms:
            raise RoomsFull(f"{self.limits.max_live_rooms} live rooms already; retry shortly")

    def _add(self, room_id: int, deadline: float) -> None:
        self._rooms[room_id] = _Room(room_id, deadline)
        heapq.heappush(self._due, (deadline, room_id))
        self._counts[RoomState.PENDING] += 1
        self._entered[RoomState.PENDING] += 1

    def register(self, registration: Registration) -> RoomView:
        with self._lock:
            room = self._get(registration.room)
            if room.registration is not None:
                if room.registration != registration:
                    raise RoomConflict("room already has a different receiver registration")
            elif room.state is RoomState.PENDING:
                room.registration = registration
                if (
                    registration.deadline_s is not None
                    and self._clock() + registration.deadline_s < room.deadline
                ):
                    room.deadline = self._clock() + registration.deadline_s
                    heapq.heappush(self._due, (room.deadline, room.room_id))
                self._move(room, RoomState.REGISTERED)
            else:  # ended before any receiver came: refused, with why
                raise RoomConflict(
                    f"room {room.room_id} ended {room.state.value} before this receiver "
                    f"registered: {room.reason or 'no reason given'}"
                )
            return self._view(room)  # this registration, or a retry of it

    def begin_write(self, write: BeginWrite) -> RoomView:
        with self._lock:
            room = self._get(write.room)
            if room.state is RoomState.PENDING:
                raise RoomConflict("no receiver has registered this room yet")
            if room.registration is not None and room.registration.generation != write.generation:
                raise RoomConflict(
                    f"stale generation {write.generation}; the slot holds "
                    f"{room.registration.generation}"
                )
            if room.state is RoomState.REGISTERED:
                room.transport, room.writer = write.transport, write.writer
                room.write_deadline = min(room.deadline, self._clock() + write.write_timeout_s)
                heapq.heappush(self._due, (room.write_deadline, room.room_id))
                self._move(room, RoomState.WRITING)
            elif room.state is RoomState.WRITING:
                if room.writer != write.writer:
                    raise RoomConflict(
                        f"another writer ({room.writer or 'unnamed'}) is writing this room"
                    )
                if room.transport != write.transport:
                    raise RoomConflict(f"write already started over {room.transport}")
            return self._view(room)

    def commit(self, commit: CommitBody) -> RoomView:
        with self._lock:
            room = self._get(commit.room)
            if room.state.terminal:
                if room.state is RoomState.SUCCESS and room.commit != commit:
                    raise RoomConflict("room already committed with different content")
                return self._view(room)
            if room.registration is None:
                raise RoomConflict("no receiver has registered this room yet")
            registration = room.registration
            if commit.generation != registration.generation:
                raise RoomConflict(
                    f"stale generation {commit.generation}; the slot holds "
                    f"{registration.generation}"
                )
            if (commit.rows, commit.width, commit.dtype) != (
                registration.rows,
                registration.width,
                registration.dtype,
            ):
                raise RoomConflict(
                    f"commit [{commit.rows}, {commit.width}] {commit.dtype} does not match the "
                    "reservation "
                    f"[{registration.rows}, {registration.width}] {registration.dtype}"
                )
            if room.state is not RoomState.WRITING:
                raise RoomConflict("no write has begun in this room (begin_write first)")
            if (
                commit.writer is not None
                and room.writer is not None
                and commit.writer != room.writer
            ):
                raise RoomConflict(
                    f"commit by {commit.writer}, but {room.writer} began this room's write"
                )
            if commit.transport != room.transport:
                raise RoomConflict(
                    f"commit over {commit.transport} but the write began over {room.transport}"
                )
            room.commit = commit
            room.transport = commit.transport
            room.writer_settled = True
            if room.cancel_requested:
                self._move(room, RoomState.CANCELLED)
            else:
                self._move(room, RoomState.SUCCESS)
            return self._view(room)

    def fail(self, room_id: int, reason: str, settled: bool, writer: str | None = None) -> RoomView:
        with self._lock:
            room = self._get(room_id)
            if (
                room.state is RoomState.WRITING
                and writer is not None
                and room.writer is not None
                and writer != room.writer
            ):
                raise RoomConflict(f"{writer} cannot fail a room {room.writer} is writing")
            if not room.state.terminal:
                room.reason = (
                    reason if not room.cancel_requested else f"{room.reason}; writer: {reason}"
                )
                room.writer_settled = settled or room.state is not RoomState.WRITING
                self._move(room, RoomState.CANCELLED if room.cancel_requested else RoomState.FAILED)
            return self._view(room)

    def cancel(self, room_id: int, reason: str) -> RoomView:
        with self._lock:
            room = self._get(room_id)
            if room.state is RoomState.WRITING:
                if not room.cancel_requested:
                    room.cancel_requested = True
                    room.reason = reason
                    self._touch(room)  # wake the writer so it can stop early
            elif not room.state.terminal:
                room.reason = reason
                room.writer_settled = True  # no write has begun
                self._move(room, RoomState.CANCELLED)
            return self._view(room)

    # ---- waiting ---------------------------------------------------------------------------

    async def watch(
        self,
        versions: dict[int, int],
        wait_s: float,
        until_ended: bool = False,
        changed_only: bool = False,
    ) -> list[RoomView | RoomError | None]:
        """Views of the rooms, in ``versions``' order, returned as soon as any is past its version
        (``until_ended``: as soon as any has ended), or after ``wait_s``. ``changed_only``: None
        for each room still at its version (no view built for it)."""
        waiter = (
            self._arm(versions, asyncio.get_running_loop(), until_ended) if wait_s > 0 else None
        )
        if waiter is not None:
            timer = waiter.loop.call_later(
                wait_s, waiter._resolve
            )  # one future, no wait_for/shield tasks
            try:
                await waiter.future
            finally:
                timer.cancel()
                self._disarm(waiter, versions)
        return self._views(versions, changed_only)

    def _arm(self, versions: dict[int, int], loop, until_ended: bool) -> _Waiter | None:
        """Register a waiter on every room, unless one already has news (ended or unknown, or,
        unless ``until_ended``, changed)."""
        with self._lock:
            rooms = []
            for room_id, after in versions.items():
                room = self._rooms.get(room_id)
                if room is None:  # terminal (it will not change again) or unknown: news either way
                    return None
                self._expire_if_due(room, self._clock())
                if room.state.terminal or (room.version > after and not until_ended):
                    return None
                rooms.append(room)
            waiter = _Waiter(loop, until_ended)
            for room in rooms:
                room.waiters.append(waiter)
            self.waiters += 1
            return waiter

    def _disarm(self, waiter: _Waiter, versions: dict[int, int]) -> None:
        with self._lock:
            self.waiters -= 1
            for room_id in versions:
                room = self._rooms.get(room_id)
                if room is not None and waiter in room.waiters:
                    room.waiters.remove(waiter)

    def _views(
        self, versions: dict[int, int], changed_only: bool
    ) -> list[RoomView | RoomError | None]:
        with self._lock:
            views = []
            for room_id, after in versions.items():
                try:
                    room = self._get(room_id)
                except RoomNotFound as exc:
                    views.append(exc)
                    continue
                views.append(None if changed_only and room.version <= after else self._view(room))
            return views

    # ---- housekeeping ----------------------------------------------------------------------

    def sweep(self) -> None:
        """Expire rooms past their deadline and drop old tombstones (called periodically)."""
        with self._lock:
            self._sweep_locked()

    def _sweep_locked(self) -> None:
        now = self._clock()
        while self._due and self._due[0][0] <= now:
            _, room_id = heapq.heappop(self._due)
            room = self._rooms.get(room_id)
            if room is not None:
                self._expire_if_due(room, now)
        ttl_edge = now - self.limits.tombstone_ttl_s
        while self._tombstones and next(iter(self._tombstones.values()))[0] <= ttl_edge:
            self._drop_oldest_tombstone()

    def _drop_oldest_tombstone(self) -> None:
        room_id, record = self._tombstones.popitem(last=False)
        self._recent.pop(room_id, None)
        self._counts[RoomState(record[3])] -= 1

    def _get(self, room_id: int) -> _Room:
        room = self._rooms.get(room_id)
        if room is not None:
            self._expire_if_due(room, self._clock())
            return room
        recent = self._recent.get(room_id)  # ended rooms never change: the object is the tombstone
        if recent is not None:
            return recent
        record = self._tombstones.get(room_id)
        if record is None:
            raise RoomNotFound(
                f"room {room_id} is unknown here (never minted, or its tombstone expired)"
            )
        return _Room.from_tombstone(record)

    def _expire_if_due(self, room: _Room, now: float) -> None:
        if room.state.terminal:
            return
        if (
            room.state is RoomState.WRITING
            and room.write_deadline is not None
            and now >= room.write_deadline
        ):
            room.reason = room.reason or "the writer reported no outcome before its write deadline"
            self._move(room, RoomState.CANCELLED if room.cancel_requested else RoomState.EXPIRED)
        elif now >= room.deadline:
            room.reason = room.reason or "the room's deadline passed"
            room.writer_settled = room.state is not RoomState.WRITING
            self._move(room, RoomState.EXPIRED)

    def _move(self, room: _Room, new: RoomState) -> None:
        old = room.state
        room.state = new
        self._counts[old] -= 1
        self._counts[new] += 1
        self._entered[new] += 1
        self._touch(room)
        if new.terminal:
            del self._rooms[room.room_id]
            self._tombstones[room.room_id] = room.tombstone(self._clock())
            self._recent[room.room_id] = room
            if len(self._recent) > RECENT_ROOMS:
                self._recent.popitem(last=False)
            while len(self._tombstones) > self.limits.max_tombstones:
                self._drop_oldest_tombstone()

    def _touch(self, room: _Room) -> None:
        room.version += 1
        ended = room.state.terminal
        waiters, room.waiters = room.waiters, []
        for waiter in waiters:
            if waiter.until_ended and not ended:
                room.waiters.append(waiter)
            else:
                waiter.wake()

    def _view(self, room: _Room) -> RoomView:
        # Built from fields the table already validated: model_construct skips re-validation,
        # which would otherwise run for every room in every answer.
        return RoomView.model_construct(
            room=room.room_id,
            state=room.state,
            version=room.version,
            registration=room.registration,
            transport=room.transport,
            commit=room.commit,
            reason=room.reason,
            cancel_requested=room.cancel_requested,
            writer_settled=room.writer_settled,
            expires_in_s=max(0.0, room.deadline - self._clock()),
        )
