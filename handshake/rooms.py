"""The room table: one state machine per item, bounded, thread-safe, with long-poll waiters.

States move forward only: PENDING -> REGISTERED -> WRITING -> SUCCESS, and any live state ->
FAILED / CANCELLED / EXPIRED. No step is skipped: a commit needs a begun write (the one writer
that began it, when either names itself), a registration a room that has not ended. Terminal states
are sticky; every call is idempotent (a retry gets the same answer, a conflicting call gets
``RoomConflict`` and changes nothing). A cancel that arrives during a write is recorded and applied
when the writer reports its outcome (or its write deadline passes). Rooms live at most
``max_ttl_s``; terminal rooms stay as tombstones for ``tombstone_ttl_s`` and at most
``max_tombstones``; live rooms are capped at ``max_live_rooms``.

The rooms and their bookkeeping (tombstones the garbage collector does not track, counts,
deadlines) are the ``RoomStore``'s (``handshake.room_store``); the table holds its lock around
each call.

The table is used in-process by the encode worker and over REST (``handshake.app``) by everyone
else; waiters are woken across threads and event loops.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Iterable

import msgspec

from epdserve.wire.offers import drawn_room_id
from epdserve.wire.rooms import (
    MAX_ROOM_ID,
    BeginWrite,
    CommitBody,
    FailBody,
    Registration,
    RoomState,
    RoomView,
)
from handshake.room_store import (
    MINTED_VERSION,
    Room,
    RoomConflict,
    RoomError,
    RoomLimits,
    RoomNotFound,
    RoomsFull,
    RoomStatus,
    RoomStore,
    Waiter,
)

__all__ = [
    "MINTED_VERSION",
    "Answer",
    "RoomConflict",
    "RoomError",
    "RoomLimits",
    "RoomNotFound",
    "RoomStatus",
    "RoomTable",
    "RoomsFull",
]


class Answer(enum.Enum):
    """What a batch room call answers for each room it did not refuse."""

    VIEW = "view"  # its view, a model (this process's own callers: ``handshake.access``)
    VIEW_JSON = "view_json"  # its view's JSON (``handshake.answers``): the REST API's answer
    # its ``RoomStatus`` and its view's JSON: a REST registration's, which long-polls past the
    # version or answers the view
    STATUS_AND_VIEW_JSON = "status_and_view_json"
    # its view's JSON (``handshake.answers``) without the registration and the commit (a writer
    # has them): the room stream's answer to a writer
    WRITER_VIEW_JSON = "writer_view_json"
    STATUS = "status"  # a ``RoomStatus``: no view built (this process's own writer)


class RoomTable:
    def __init__(
        self, limits: RoomLimits = RoomLimits(), clock: Callable[[], float] = time.monotonic
    ):
        self.limits = limits
        self._store = RoomStore(limits, clock)
        self._lock = self._store.lock
        self.waiters = 0

    # ---- queries ---------------------------------------------------------------------------

    def counts(self) -> dict[RoomState, int]:
        with self._lock:
            return {state: self._store.counts[state] for state in RoomState}

    def entered(self) -> dict[RoomState, int]:
        """How many times a room entered each state (minting enters PENDING)."""
        with self._lock:
            return {state: self._store.entered[state] for state in RoomState}

    @property
    def live_rooms(self) -> int:
        with self._lock:
            return len(self._store.rooms)

    def full(self) -> bool:
        """True while no room can be minted (rooms past their deadline are expired first)."""
        with self._lock:
            self._store.sweep()
            return len(self._store.rooms) >= self.limits.max_live_rooms

    def view(self, room_id: int) -> RoomView:
        with self._lock:
            return self._store.view(self._store.get(room_id))

    def status(self, room_id: int) -> RoomStatus:
        with self._lock:
            return self._store.status(self._store.get(room_id))

    # ---- transitions -----------------------------------------------------------------------

    def mint(self, count: int, ttl_s: float) -> list[int]:
        """``count`` new rooms with unique random ids."""
        deadline = self._store.deadline(ttl_s)
        with self._lock:
            self._store.make_room_for(count)
            minted = []
            while len(minted) < count:
                room_id = drawn_room_id()
                if not self._store.known(room_id):  # never reused
                    self._store.add(room_id, deadline)
                    minted.append(room_id)
            return minted

    def open(self, room_id: int, ttl_s: float) -> None:
        """A room with the id its sender chose (an encode worker's intake opens the room a
        dispatcher named, so that minting costs no call of its own). ``RoomConflict`` when the id
        is or was in use here: ids are never reused."""
        deadline = self._store.deadline(ttl_s)
        with self._lock:
            self._open(room_id, deadline)

    def open_all(self, room_ids: list[int], ttl_s: float) -> list[msgspec.Raw | RoomError]:
        """``open`` for each, in one lock: each new room's view's JSON (the room stream's answer:
        ``handshake.answers``), or why it was not opened."""
        try:
            deadline = self._store.deadline(ttl_s)
        except RoomError as exc:
            return [exc] * len(room_ids)
        return self._each(
            lambda room_id: self._open(room_id, deadline), room_ids, self._store.view_json
        )

    def _open(self, room_id: int, deadline: float) -> Room:
        if not 1 <= room_id <= MAX_ROOM_ID:
            raise RoomError(f"room id {room_id} is outside [1, {MAX_ROOM_ID}]")
        if self._store.known(room_id):
            raise RoomConflict(f"room {room_id} exists already")
        self._store.make_room_for(1)
        self._store.add(room_id, deadline)
        return self._store.rooms[room_id]

    def discard(self, room_id: int) -> None:
        """Forget a room ``open`` made that nobody has touched since (still PENDING at its first
        version), leaving no tombstone: its opener refused the item after all, and the id was
        never handed out. ``RoomConflict`` for any other room."""
        with self._lock:
            room = self._store.rooms.get(room_id)
            untouched = room is not None and room.version == MINTED_VERSION
            if not untouched or room.state is not RoomState.PENDING:
                raise RoomConflict(f"room {room_id} is not an untouched pending room")
            self._store.remove_untouched(room_id)

    def register(self, registration: Registration) -> RoomView:
        with self._lock:
            return self._store.view(self._register(registration))

    def register_all(
        self, registrations: list[Registration], answer: Answer | None = None
    ) -> list[RoomView | RoomStatus | msgspec.Raw | tuple | RoomError | None]:
        """``register`` for each, in one lock: each room's ``answer`` (None: nothing, as the room
        stream answers a registration only when it is refused), or why it was refused."""
        return self._each(self._register, registrations, self._answer(answer))

    def _register(self, registration: Registration) -> Room:
        """The room, registered (or a retry of its registration)."""
        room = self._store.get(registration.room)
        if room.registration is not None:
            if room.registration != registration:
                raise RoomConflict("room already has a different receiver registration")
        elif room.state is RoomState.PENDING:
            room.take_registration(registration)
            if (
                registration.deadline_s is not None
                and self._store.clock() + registration.deadline_s < room.deadline
            ):
                room.deadline = self._store.clock() + registration.deadline_s
                self._store.schedule(room.deadline, room.room_id)
            self._store.move(room, RoomState.REGISTERED)
        else:  # ended before any receiver came: refused, with why
            raise RoomConflict(
                f"room {room.room_id} ended {room.state.value} before this receiver "
                f"registered: {room.reason or 'no reason given'}"
            )
        return room

    def begin_write(self, write: BeginWrite) -> RoomView:
        with self._lock:
            return self._store.view(self._begin_write(write))

    def begin_writes(
        self, writes: list[BeginWrite], answer: Answer = Answer.VIEW
    ) -> list[RoomView | RoomStatus | RoomError]:
        """``begin_write`` for each, in one lock: each room's ``answer``, or why it was
        refused."""
        return self._each(self._begin_write, writes, self._answer(answer))

    def commit_all(
        self, commits: list[CommitBody], answer: Answer = Answer.VIEW
    ) -> list[RoomView | RoomStatus | RoomError]:
        """``commit`` for each, in one lock (the rooms that end go out in one stream frame):
        each room's ``answer``, or why it was refused."""
        return self._each(self._commit, commits, self._answer(answer))

    def _answer(
        self, answer: Answer | None
    ) -> Callable[[Room], RoomView | RoomStatus | msgspec.Raw | tuple | None]:
        if answer is None:
            return lambda room: None
        if answer is Answer.STATUS:
            return self._store.status
        if answer is Answer.VIEW_JSON:
            return self._store.view_json
        if answer is Answer.STATUS_AND_VIEW_JSON:
            return lambda room: (self._store.status(room), self._store.view_json(room))
        if answer is Answer.WRITER_VIEW_JSON:
            return lambda room: self._store.view_json(room, False, False)
        return self._store.view

    def _each(self, call, bodies: list, answer: Callable[[Room], object]) -> list:
        """``call`` for each body, in one lock: ``answer(room)``, or why it was refused."""
        with self._lock:
            answers = []
            for body in bodies:
                try:
                    answers.append(answer(call(body)))
                except RoomError as exc:
                    answers.append(exc)
            return answers

    def _begin_write(self, write: BeginWrite) -> Room:
        room = self._store.get(write.room)
        if room.state is RoomState.PENDING:
            raise RoomConflict("no receiver has registered this room yet")
        if room.registration is not None and room.registration.generation != write.generation:
            raise RoomConflict(
                f"stale generation {write.generation}; the slot holds "
                f"{room.registration.generation}"
            )
        if room.state is RoomState.REGISTERED:
            room.transport, room.writer = write.transport, write.writer
            room.write_deadline = min(room.deadline, self._store.clock() + write.write_timeout_s)
            self._store.schedule(room.write_deadline, room.room_id)
            self._store.move(room, RoomState.WRITING)
        elif room.state is RoomState.WRITING:
            if room.writer != write.writer:
                raise RoomConflict(
                    f"another writer ({room.writer or 'unnamed'}) is writing this room"
                )
            if room.transport != write.transport:
                raise RoomConflict(f"write already started over {room.transport}")
        return room

    def commit(self, commit: CommitBody) -> RoomView:
        with self._lock:
            return self._store.view(self._commit(commit))

    def _commit(self, commit: CommitBody) -> Room:
        room = self._store.get(commit.room)
        if room.state.terminal:
            if room.state is RoomState.SUCCESS and room.commit != commit:
                raise RoomConflict("room already committed with different content")
            return room
        if room.registration is None:
            raise RoomConflict("no receiver has registered this room yet")
        registration = room.registration
        if commit.generation != registration.generation:
            raise RoomConflict(
                f"stale generation {commit.generation}; the slot holds {registration.generation}"
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
        if commit.writer is not None and room.writer is not None and commit.writer != room.writer:
            raise RoomConflict(
                f"commit by {commit.writer}, but {room.writer} began this room's write"
            )
        if commit.transport != room.transport:
            raise RoomConflict(
                f"commit over {commit.transport} but the write began over {room.transport}"
            )
        room.take_commit(commit)
        room.transport = commit.transport
        room.writer_settled = True
        if room.cancel_requested:
            self._store.move(room, RoomState.CANCELLED)
        else:
            self._store.move(room, RoomState.SUCCESS)
        return room

    def fail(self, room_id: int, reason: str, settled: bool, writer: str | None = None) -> RoomView:
        with self._lock:
            return self._store.view(self._fail(room_id, reason, settled, writer))

    def fail_all(
        self, failures: list[FailBody], answer: Answer = Answer.VIEW
    ) -> list[RoomView | RoomStatus | msgspec.Raw | RoomError]:
        """``fail`` for each, in one lock: each room's ``answer``, or why it was refused."""
        return self._each(
            lambda f: self._fail(f.room, f.reason, f.settled, f.writer),
            failures,
            self._answer(answer),
        )

    def _fail(self, room_id: int, reason: str, settled: bool, writer: str | None) -> Room:
        room = self._store.get(room_id)
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
            self._store.move(
                room, RoomState.CANCELLED if room.cancel_requested else RoomState.FAILED
            )
        return room

    def cancel(self, room_id: int, reason: str) -> RoomView:
        with self._lock:
            return self._store.view(self._cancel(room_id, reason))

    def cancel_all(
        self, room_ids: list[int], reason: str, answer: Answer | None = Answer.VIEW
    ) -> list[RoomView | RoomStatus | msgspec.Raw | RoomError | None]:
        """``cancel`` for each, in one lock: each room's ``answer`` (None: nothing), or why it
        was refused."""
        return self._each(
            lambda room_id: self._cancel(room_id, reason), room_ids, self._answer(answer)
        )

    def _cancel(self, room_id: int, reason: str) -> Room:
        room = self._store.get(room_id)
        if room.state is RoomState.WRITING:
            if not room.cancel_requested:
                room.cancel_requested = True
                room.reason = reason
                self._store.touch(room)  # wake the writer so it can stop early
        elif not room.state.terminal:
            room.reason = reason
            room.writer_settled = True  # no write has begun
            self._store.move(room, RoomState.CANCELLED)
        return room

    # ---- waiting ---------------------------------------------------------------------------

    def listen(self, room_id: int, listener) -> bool:
        """Attach ``listener`` to a live room: ``wake()`` is called once, from whichever thread
        changes the room (``listener.until_ended``: ends it), with the table's lock held. False
        when the room has ended or is unknown, or has what the listener waits for already
        (``listener.has_news(state, staged)``): the caller reads its view now."""
        with self._lock:
            room = self._store.rooms.get(room_id)
            if room is None:
                return False
            self._store.expire_if_due(room, self._store.clock())
            return self._attach(room, listener)

    @staticmethod
    def _attach(room: Room, listener) -> bool:
        """``listen``'s attachment, the lock held and the room expired if due."""
        if room.state.terminal or listener.has_news(room.state, room.staged):
            return False
        room.waiters.append(listener)
        return True

    def ended(self, room_ids: list[int]) -> dict[int, RoomState]:
        """Those of ``room_ids`` that are rooms of this table and ended without rows (cancelled,
        failed, expired: their items need no more work), with how, in one lock."""
        with self._lock:
            store, gone = self._store, {}
            for room_id in room_ids:
                room = store.rooms.get(room_id)
                if room is not None:
                    store.expire_if_due(room, store.clock())
                    if room.state.terminal and room.state is not RoomState.SUCCESS:
                        gone[room_id] = room.state
                elif room_id in store.tombstones:
                    state = store.get(room_id).state
                    if state is not RoomState.SUCCESS:
                        gone[room_id] = state
            return gone

    def mark_staged(self, room_id: int) -> int | None:
        """The writer holds the rows of a room no receiver has registered yet: it says so once
        (waking who waits for it). The room's version now, or None when it is not PENDING (or
        not here)."""
        with self._lock:
            room = self._store.rooms.get(room_id)
            if room is None or room.state is not RoomState.PENDING:
                return None
            self._stage(room)
            return room.version

    def _stage(self, room: Room) -> None:
        """``mark_staged`` of a PENDING room, the lock held."""
        if not room.staged:
            room.staged = True
            self._store.touch(room)

    def arrivals(self, listeners: dict[int, object | None]) -> list[RoomStatus | RoomError | None]:
        """A writer holds the rows of each room in ``listeners``: per room, in one lock,
        ``mark_staged``, then ``listen`` with its listener (None: none), then ``status``. Each
        room's answer, in order: None where its listener now listens, else its status, or why
        there is none."""
        answers: list[RoomStatus | RoomError | None] = []
        with self._lock:
            store, now = self._store, self._store.clock()
            for room_id, listener in listeners.items():
                room = store.rooms.get(room_id)
                if room is not None:
                    store.expire_if_due(room, now)
                    if room.state is RoomState.PENDING:
                        self._stage(room)
                        if listener is not None and self._attach(room, listener):
                            answers.append(None)
                            continue
                    answers.append(store.status(room))
                    continue
                try:
                    answers.append(store.status(store.get(room_id)))
                except RoomError as exc:
                    answers.append(exc)
        return answers

    def stop_listening(self, listeners: dict[int, object]) -> None:
        """Detach each room's listener (rooms that ended have dropped theirs already)."""
        with self._lock:
            for room_id, listener in listeners.items():
                room = self._store.rooms.get(room_id)
                if room is not None and listener in room.waiters:
                    room.waiters.remove(listener)

    def views_json(
        self, room_ids: list[int], with_registration: bool = True
    ) -> list[msgspec.Raw | RoomError]:
        """Each room's view's JSON (``handshake.answers``: the room stream pushes these; without
        the registration to the receiver that sent it), or why there is none, in one lock."""
        return self._views(
            [(room_id, 0) for room_id in room_ids],  # (each in its place, a repeat included)
            False,
            lambda room: self._store.view_json(room, with_registration),
        )

    async def watch(
        self,
        versions: dict[int, int],
        wait_s: float,
        until_ended: bool = False,
        changed_only: bool = False,
        answer: Answer = Answer.VIEW,
    ) -> list[RoomView | RoomStatus | msgspec.Raw | RoomError | None]:
        """The rooms' ``answer`` (their views), in ``versions``' order, returned as soon as any is
        past its version (``until_ended``: as soon as any has ended), or after ``wait_s``.
        ``changed_only``: None for each room still at its version (no view built for it)."""
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
        return self._views(versions.items(), changed_only, self._answer(answer))

    def _arm(self, versions: dict[int, int], loop, until_ended: bool) -> Waiter | None:
        """Register a waiter on every room, unless one already has news (ended or unknown, or,
        unless ``until_ended``, changed)."""
        with self._lock:
            rooms = []
            for room_id, after in versions.items():
                room = self._store.rooms.get(room_id)
                if room is None:  # terminal (it will not change again) or unknown: news either way
                    return None
                self._store.expire_if_due(room, self._store.clock())
                if room.state.terminal or (room.version > after and not until_ended):
                    return None
                rooms.append(room)
            waiter = Waiter(loop, until_ended)
            for room in rooms:
                room.waiters.append(waiter)
            self.waiters += 1
            return waiter

    def _disarm(self, waiter: Waiter, versions: dict[int, int]) -> None:
        with self._lock:
            self.waiters -= 1
            for room_id in versions:
                room = self._store.rooms.get(room_id)
                if room is not None and waiter in room.waiters:
                    room.waiters.remove(waiter)

    def _views(
        self, versions: Iterable[tuple[int, int]], changed_only: bool, view: Callable
    ) -> list[RoomView | RoomStatus | msgspec.Raw | RoomError | None]:
        """Each room's ``view`` (``versions``: rooms and the version each was seen at), or why
        there is none, in one lock; ``changed_only``: None for a room still at its version."""
        with self._lock:
            views = []
            for room_id, after in versions:
                try:
                    room = self._store.get(room_id)
                except RoomNotFound as exc:
                    views.append(exc)
                    continue
                views.append(None if changed_only and room.version <= after else view(room))
            return views

    # ---- housekeeping ----------------------------------------------------------------------

    def sweep(self) -> None:
        """Expire rooms past their deadline and drop old tombstones (called periodically)."""
        with self._lock:
            self._store.sweep()
