"""The room state machine's steps: each applies one call to one room of a ``RoomStore`` (whose lock
its caller, the ``RoomTable``, holds) and returns the room, or raises the ``RoomError`` why it
refused, changing nothing.

States move forward only: PENDING -> REGISTERED -> WRITING -> SUCCESS, and any live state ->
FAILED / CANCELLED / EXPIRED. No step is skipped: a commit needs a begun write (the one writer
that began it, when either names itself), a registration a room that has not ended. Terminal states
are sticky; every step is idempotent (a retry gets the same room, a conflicting call gets
``RoomConflict`` and changes nothing). A cancel that arrives during a write is recorded and applied
when the writer reports its outcome (or its write deadline passes)."""

from __future__ import annotations

from epdserve.wire.offers import drawn_room_id
from epdserve.wire.rooms import MAX_ROOM_ID, BeginWrite, CommitBody, Registration, RoomState
from handshake.room_store import MINTED_VERSION, Room, RoomConflict, RoomError, RoomStore


def mint(store: RoomStore, count: int, deadline: float) -> list[int]:
    """``count`` new PENDING rooms with unique random ids (never reused)."""
    store.make_room_for(count)
    minted = []
    while len(minted) < count:
        room_id = drawn_room_id()
        if not store.known(room_id):
            store.add(room_id, deadline)
            minted.append(room_id)
    return minted


def open_room(store: RoomStore, room_id: int, deadline: float) -> Room:
    """A new PENDING room with the id its sender chose; ids are never reused."""
    if not 1 <= room_id <= MAX_ROOM_ID:
        raise RoomError(f"room id {room_id} is outside [1, {MAX_ROOM_ID}]")
    if store.known(room_id):
        raise RoomConflict(f"room {room_id} exists already")
    store.make_room_for(1)
    store.add(room_id, deadline)
    return store.rooms[room_id]


def discard(store: RoomStore, room_id: int) -> None:
    """Forget a room nobody has touched since it was opened (PENDING at its first version), leaving
    no tombstone."""
    room = store.rooms.get(room_id)
    untouched = room is not None and room.version == MINTED_VERSION
    if not untouched or room.state is not RoomState.PENDING:
        raise RoomConflict(f"room {room_id} is not an untouched pending room")
    store.remove_untouched(room_id)


def register(store: RoomStore, registration: Registration) -> Room:
    """The room, registered (or a retry of its registration)."""
    room = store.get(registration.room)
    if room.registration is not None:
        if room.registration != registration:
            raise RoomConflict("room already has a different receiver registration")
    elif room.state is RoomState.PENDING:
        room.take_registration(registration)
        if (
            registration.deadline_s is not None
            and store.clock() + registration.deadline_s < room.deadline
        ):
            room.deadline = store.clock() + registration.deadline_s
            store.schedule(room.deadline, room.room_id)
        store.move(room, RoomState.REGISTERED)
    else:  # ended before any receiver came: refused, with why
        raise RoomConflict(
            f"room {room.room_id} ended {room.state.value} before this receiver "
            f"registered: {room.reason or 'no reason given'}"
        )
    return room


def begin_write(store: RoomStore, write: BeginWrite) -> Room:
    """REGISTERED -> WRITING (or a retry by the same writer); a room that ended stays as it is."""
    room = store.get(write.room)
    if room.state is RoomState.PENDING:
        raise RoomConflict("no receiver has registered this room yet")
    if room.registration is not None and room.registration.generation != write.generation:
        raise RoomConflict(
            f"stale generation {write.generation}; the slot holds {room.registration.generation}"
        )
    if room.state is RoomState.REGISTERED:
        room.transport, room.writer = write.transport, write.writer
        room.write_deadline = min(room.deadline, store.clock() + write.write_timeout_s)
        store.schedule(room.write_deadline, room.room_id)
        store.move(room, RoomState.WRITING)
    elif room.state is RoomState.WRITING:
        if room.writer != write.writer:
            raise RoomConflict(f"another writer ({room.writer or 'unnamed'}) is writing this room")
        if room.transport != write.transport:
            raise RoomConflict(f"write already started over {room.transport}")
    return room


def commit(store: RoomStore, commit: CommitBody) -> Room:
    """WRITING -> SUCCESS (CANCELLED when a cancel came during the write), for a commit that
    matches the registration and the begun write; a retry of the same commit is answered again."""
    room = store.get(commit.room)
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
        raise RoomConflict(f"commit by {commit.writer}, but {room.writer} began this room's write")
    if commit.transport != room.transport:
        raise RoomConflict(
            f"commit over {commit.transport} but the write began over {room.transport}"
        )
    room.take_commit(commit)
    room.transport = commit.transport
    room.writer_settled = True
    store.move(room, RoomState.CANCELLED if room.cancel_requested else RoomState.SUCCESS)
    return room


def fail(store: RoomStore, room_id: int, reason: str, settled: bool, writer: str | None) -> Room:
    """A live room -> FAILED (CANCELLED when a cancel came during the write), with ``reason``;
    ``settled``: no byte of its write can still land. Another writer than the one writing it is
    refused."""
    room = store.get(room_id)
    if (
        room.state is RoomState.WRITING
        and writer is not None
        and room.writer is not None
        and writer != room.writer
    ):
        raise RoomConflict(f"{writer} cannot fail a room {room.writer} is writing")
    if not room.state.terminal:
        room.reason = reason if not room.cancel_requested else f"{room.reason}; writer: {reason}"
        room.writer_settled = settled or room.state is not RoomState.WRITING
        store.move(room, RoomState.CANCELLED if room.cancel_requested else RoomState.FAILED)
    return room


def cancel(store: RoomStore, room_id: int, reason: str) -> Room:
    """A live room -> CANCELLED; one being written stays WRITING, its cancel requested (its writer
    is woken to stop early), until the writer's outcome."""
    room = store.get(room_id)
    if room.state is RoomState.WRITING:
        if not room.cancel_requested:
            room.cancel_requested = True
            room.reason = reason
            store.touch(room)
    elif not room.state.terminal:
        room.reason = reason
        room.writer_settled = True  # no write has begun
        store.move(room, RoomState.CANCELLED)
    return room
