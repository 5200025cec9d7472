"""The room table: one state machine per item (its steps: ``handshake.transitions``), bounded,
thread-safe, with long-poll waiters.

Every call holds the table's lock; a batch call (``register_all``, ``begin_writes``, ...) applies
its step to each of its rooms in one lock. A batch call answers each room with the room as the call
left it (``RoomStatus``: the REST routes and the room stream send its view's JSON, this process's
own writer reads its fields) or with the ``RoomError`` why it refused it; a call for one room
answers its ``RoomView``, or raises. Rooms live at most ``max_ttl_s``; terminal rooms stay as
tombstones for ``tombstone_ttl_s`` and at most ``max_tombstones``; live rooms are capped at
``max_live_rooms``. The rooms and their bookkeeping (tombstones the garbage collector does not
track, counts, deadlines) are the ``RoomStore``'s (``handshake.room_store``).

The table is used in-process by the encode worker and over REST (``handshake.app``) and the room
stream (``handshake.stream``) by everyone else; waiters are woken across threads and event loops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from epdserve.wire.rooms import BeginWrite, CommitBody, FailBody, Registration, RoomState, RoomView
from handshake import transitions
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
    "RoomConflict",
    "RoomError",
    "RoomLimits",
    "RoomNotFound",
    "RoomStatus",
    "RoomTable",
    "RoomsFull",
]

Body = TypeVar("Body")
Step = Callable[[RoomStore, Body], Room]  # a transition, applied to one room of a store


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
        return self.status(room_id).view()

    def status(self, room_id: int) -> RoomStatus:
        with self._lock:
            return self._store.status(self._store.get(room_id))

    def statuses(self, room_ids: list[int]) -> list[RoomStatus | RoomError]:
        """Each room as it is now (the room stream pushes their views), or why there is none, in
        one lock; a room asked for twice is answered twice, in its places."""
        return self._statuses([(room_id, 0) for room_id in room_ids], False)

    # ---- transitions -----------------------------------------------------------------------

    def mint(self, count: int, ttl_s: float) -> list[int]:
        """``count`` new rooms with unique random ids."""
        deadline = self._store.deadline(ttl_s)
        with self._lock:
            return transitions.mint(self._store, count, deadline)

    def open(self, room_id: int, ttl_s: float) -> None:
        """A room with the id its sender chose (an encode worker's intake opens the room a
        dispatcher named, so that minting costs no call of its own). ``RoomConflict`` when the id
        is or was in use here: ids are never reused."""
        deadline = self._store.deadline(ttl_s)
        with self._lock:
            transitions.open_room(self._store, room_id, deadline)

    def open_all(self, room_ids: list[int], ttl_s: float) -> list[RoomStatus | RoomError]:
        """``open`` for each, in one lock."""
        try:
            deadline = self._store.deadline(ttl_s)
        except RoomError as exc:
            return [exc] * len(room_ids)
        return self._each(
            lambda store, room_id: transitions.open_room(store, room_id, deadline), room_ids
        )

    def discard(self, room_id: int) -> None:
        """Forget a room ``open`` made that nobody has touched since (still PENDING at its first
        version), leaving no tombstone: its opener refused the item after all, and the id was
        never handed out. ``RoomConflict`` for any other room."""
        with self._lock:
            transitions.discard(self._store, room_id)

    def register(self, registration: Registration) -> RoomView:
        return self._one(transitions.register, registration).view()

    def begin_write(self, write: BeginWrite) -> RoomView:
        return self._one(transitions.begin_write, write).view()

    def commit(self, commit: CommitBody) -> RoomView:
        return self._one(transitions.commit, commit).view()

    def fail(self, room_id: int, reason: str, settled: bool, writer: str | None = None) -> RoomView:
        return self._one(
            lambda store, room: transitions.fail(store, room, reason, settled, writer), room_id
        ).view()

    def cancel(self, room_id: int, reason: str) -> RoomView:
        return self._one(
            lambda store, room: transitions.cancel(store, room, reason), room_id
        ).view()

    def register_all(self, registrations: list[Registration]) -> list[RoomStatus | RoomError]:
        """``register`` for each, in one lock."""
        return self._each(transitions.register, registrations)

    def begin_writes(self, writes: list[BeginWrite]) -> list[RoomStatus | RoomError]:
        """``begin_write`` for each, in one lock."""
        return self._each(transitions.begin_write, writes)

    def commit_all(self, commits: list[CommitBody]) -> list[RoomStatus | RoomError]:
        """``commit`` for each, in one lock (the rooms that end go out in one stream frame)."""
        return self._each(transitions.commit, commits)

    def fail_all(self, failures: list[FailBody]) -> list[RoomStatus | RoomError]:
        """``fail`` for each, in one lock."""
        return self._each(
            lambda store, f: transitions.fail(store, f.room, f.reason, f.settled, f.writer),
            failures,
        )

    def cancel_all(self, room_ids: list[int], reason: str) -> list[RoomStatus | RoomError]:
        """``cancel`` for each, in one lock."""
        return self._each(lambda store, room: transitions.cancel(store, room, reason), room_ids)

    def _one(self, step: Step[Body], body: Body) -> RoomStatus:
        """``step`` applied to one room: the room as it left it (or the step's ``RoomError``)."""
        with self._lock:
            return self._store.status(step(self._store, body))

    def _each(self, step: Step[Body], bodies: list[Body]) -> list[RoomStatus | RoomError]:
        """``step`` applied to each body's room, in one lock: the room as it left it, or why it
        was refused."""
        with self._lock:
            store, answers = self._store, []
            for body in bodies:
                try:
                    answers.append(store.status(step(store, body)))
                except RoomError as exc:
                    answers.append(exc)
            return answers

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
            store = self._store
            states = {room: store.get(room).state for room in room_ids if store.known(room)}
        return {
            room: state
            for room, state in states.items()
            if state.terminal and state is not RoomState.SUCCESS
        }

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

    async def watch(
        self,
        versions: dict[int, int],
        wait_s: float,
        until_ended: bool = False,
        changed_only: bool = False,
    ) -> list[RoomStatus | RoomError | None]:
        """The rooms (``statuses``), in ``versions``' order, as soon as any is past its version
        (``until_ended``: as soon as any has ended), or after ``wait_s``. ``changed_only``: None
        for each room still at its version."""
        waiter = (
            self._arm(versions, asyncio.get_running_loop(), until_ended) if wait_s > 0 else None
        )
        if waiter is not None:
            # one future and its timer, no wait_for/shield tasks
            timer = waiter.loop.call_later(wait_s, waiter._resolve)
            try:
                await waiter.future
            finally:
                timer.cancel()
                self._disarm(waiter, versions)
        return self._statuses(versions.items(), changed_only)

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

    def _statuses(
        self, versions: Iterable[tuple[int, int]], changed_only: bool
    ) -> list[RoomStatus | RoomError | None]:
        """Each room (``versions``: rooms and the version each was seen at), or why there is
        none, in one lock; ``changed_only``: None for a room still at its version."""
        with self._lock:
            store, answers = self._store, []
            for room_id, after in versions:
                try:
                    room = store.get(room_id)
                except RoomNotFound as exc:
                    answers.append(exc)
                    continue
                answers.append(
                    None if changed_only and room.version <= after else store.status(room)
                )
            return answers

    # ---- housekeeping ----------------------------------------------------------------------

    def sweep(self) -> None:
        """Expire rooms past their deadline and drop old tombstones (called periodically)."""
        with self._lock:
            self._store.sweep()
