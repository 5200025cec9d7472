"""One item's write into the room its receiver registered in: the contract checked (rows x width
x dtype, capacity), the transport chosen from what both sides offer (in the registry's preference
order), the write begun, submitted, then committed with the slot's generation and the rows'
checksum, or the room failed with a reason the receiver can read. The send-ring slot is released
once the transport has settled (a write that may still read it keeps it leased)."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from epdserve.data_plane.commit import EmbeddingLayout
from epdserve.data_plane.pool import Lease, SlotPool
from epdserve.data_plane.transport import (
    Transfer,
    TransferRefused,
    TransferState,
    Transport,
    byte_array,
)
from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.fingerprint import say_compact_differences
from epdserve.wire.modality import Modality
from epdserve.wire.offers import TRANSPORT_NAMES
from epdserve.wire.room_client import HandshakeError
from epdserve.wire.rooms import BeginWrite, CommitBody, EncodeTimings, RoomState, RoomView
from handshake.rooms import RoomError, RoomStatus


@dataclass
class StagedItem:
    request_id: str
    handshake: EncodeHandshake
    lease: Lease  # in the send ring
    layout: EmbeddingLayout
    checksum: int | None
    timings: dict[str, float | bool]
    grid_thw: tuple[int, int, int] | None = None
    modality: Modality = Modality.IMAGE

    @property
    def room(self) -> int:
        return self.handshake.bootstrap_room


@dataclass
class Write:
    """A write begun in its room and submitted: what its commit needs."""

    transport: Transport
    offer: object
    generation: int
    transfer: Transfer
    started: float


@dataclass
class Outcome:
    room: int
    state: RoomState  # the room's end: SUCCESS, or FAILED / CANCELLED / EXPIRED
    transport: str | None
    reason: str | None
    nbytes: int
    timings: dict[
        str, float | bool
    ]  # EncodeTimings' fields: queue_s, encode_s, wait_s, transfer_s, cache_hit
    modality: Modality = Modality.IMAGE


class Writer:
    """One item's write into its room, and the send-ring slots the writes hold: check the
    receiver's registration against the item, pick the transport, begin the write, submit it,
    then commit it or fail the room; a slot is released once its write has settled (a failed
    write that may still read it keeps it). ``writer_id`` names this worker in ``begin_write``,
    so a room sent to two workers is written by one only."""

    def __init__(
        self,
        ring: SlotPool,
        transports: dict[str, Transport],
        rooms_for: Callable[[EncodeHandshake], object],
        receiver_wait_s: float,
        write_timeout_s: float,
        inline_write_bytes: int,
        closing: threading.Event,
        fingerprint: str | None = None,
    ):
        """``fingerprint``: the compact fingerprint of the model whose rows this writes: a room
        registered for another model is failed, not written; every commit carries it."""
        self.ring = ring
        self.fingerprint = fingerprint
        self.transports = transports
        self.rooms_for = rooms_for
        self.receiver_wait_s = receiver_wait_s
        self.write_timeout_s = write_timeout_s
        self.inline_write_bytes = inline_write_bytes
        self.closing = closing  # the sender's: items still waiting for a receiver fail
        self.writer_id = f"{socket.gethostname()[:64]}-{os.getpid()}-{secrets.token_hex(4)}"
        self.slot_freed = threading.Condition()  # StageAndSend waits on it when the ring is full
        self._unsettled: list[tuple[Transfer, Lease]] = []
        self._lock = threading.Lock()

    def start(
        self, item: StagedItem, rooms, view: RoomView, chosen: tuple[Transport, object] | None
    ) -> Outcome | Write:
        """Check the registration against the item, begin the write in the room and submit it:
        the write in flight, or the item's outcome when it ends here."""
        begin = self.check(item, view, chosen)
        if isinstance(begin, Outcome):
            return begin
        try:
            begun = rooms.begin_write(begin)
        except RoomError as exc:
            begun = exc
        return self.submit(item, begin, begun, chosen)

    def no_receiver(self, item: StagedItem) -> Outcome:
        """No receiver registered the item's room in time (or the worker stops): the room fails
        now, not at its TTL."""
        return self.fail(
            item,
            "encode worker shutting down"
            if self.closing.is_set()
            else f"no receiver registered within {self.receiver_wait_s:g} s",
            settled=True,
        )

    def check(
        self,
        item: StagedItem,
        view: RoomView | RoomStatus,
        chosen: tuple[Transport, object] | None,
    ) -> Outcome | BeginWrite:
        """The registration in ``view`` checked against the item: the write to begin, or the
        item's outcome when it ends here."""
        if view.state is RoomState.PENDING:
            return self.no_receiver(item)
        if view.state is RoomState.WRITING:  # a room sent to two workers: the other one has it
            return self.finish(
                item, RoomState.FAILED, None, "not written: another writer is writing this room"
            )
        if view.state is not RoomState.REGISTERED:
            return self.finish(
                item, view.state, None, view.reason or "room ended before a receiver came"
            )
        registration = view.registration
        theirs = registration.fingerprint
        if theirs is not None and self.fingerprint is not None and theirs != self.fingerprint:
            return self.fail(
                item,
                "incompatible: "
                + say_compact_differences(
                    self.fingerprint, theirs, "the encode worker", "the receiving engine"
                ),
                settled=True,
            )
        reserved = EmbeddingLayout(registration.rows, registration.width, registration.dtype)
        if reserved != item.layout:
            return self.fail(
                item,
                f"contract mismatch: encoder has [{item.layout.rows}, {item.layout.width}] "
                f"{item.layout.dtype}, receiver reserved [{reserved.rows}, {reserved.width}] "
                f"{reserved.dtype}",
                settled=True,
            )
        if chosen is None:
            kinds = [offer.kind for offer in registration.offers]
            return self.fail(
                item,
                f"no common transport: receiver offers {kinds}, "
                f"encoder has {sorted(self.transports)}",
                settled=True,
            )
        transport, offer = chosen
        if offer.capacity < item.layout.nbytes:
            return self.fail(
                item,
                f"receiver slot holds {offer.capacity} bytes, item needs {item.layout.nbytes}",
                settled=True,
            )
        return BeginWrite(
            room=item.room,
            generation=registration.generation,
            transport=transport.name,
            write_timeout_s=self.write_timeout_s,
            writer=self.writer_id,
        )

    def submit(
        self,
        item: StagedItem,
        begin: BeginWrite,
        begun: RoomView | RoomStatus | RoomError,
        chosen: tuple[Transport, object],
    ) -> Outcome | Write:
        """Once ``begin`` was asked of the room (``begun``: its answer): the write submitted, or
        the item's outcome when the room refused it."""
        if isinstance(begun, RoomError):  # the room is another writer's (or gone): left as it is
            return self.finish(item, RoomState.FAILED, None, f"not written: {begun}")
        if begun.state is not RoomState.WRITING or begun.cancel_requested:
            return self.finish(
                item, begun.state, None, begun.reason or "cancelled before the write"
            )
        transport, offer = chosen
        started = time.monotonic()
        try:
            transfer = transport.submit(
                self.ring.view(item.lease), offer, started + self.write_timeout_s
            )
        except TransferRefused as exc:
            return self.fail(item, f"{transport.name} refused the write: {exc}", settled=True)
        return Write(transport, offer, begin.generation, transfer, started)

    def end(self, item: StagedItem, rooms, write: Write) -> Outcome:
        """Once the write is DONE or FAILED: commit it, or fail the room (a room call that
        raises ``RoomError`` raises it)."""
        commit = self.commit(item, write)
        if isinstance(commit, Outcome):
            return commit
        return self.committed(item, write, rooms.commit(commit))

    def commit(self, item: StagedItem, write: Write) -> Outcome | CommitBody:
        """Once the write is DONE or FAILED: the commit to make, or (the write failed) the
        item's outcome, its room failed."""
        item.timings["transfer_s"] = time.monotonic() - write.started
        transfer, name = write.transfer, write.transport.name
        if transfer.state is not TransferState.DONE:
            self._hold_until_settled(transfer, item.lease)
            return self.fail(
                item,
                f"{name} write failed: {transfer.error}",
                settled=transfer.settled,
                release=False,
            )
        return CommitBody(
            room=item.room,
            generation=write.generation,
            transport=name,
            rows=item.layout.rows,
            width=item.layout.width,
            dtype=item.layout.dtype,
            checksum=item.checksum,
            grid_thw=item.grid_thw,
            shm_segment=getattr(write.offer, "segment", None),
            writer=self.writer_id,
            timings=EncodeTimings(**item.timings),
            fingerprint=self.fingerprint,
        )

    def committed(self, item: StagedItem, write: Write, view: RoomView | RoomStatus) -> Outcome:
        """The item's outcome once its room answered its commit with ``view``."""
        return self.finish(item, view.state, write.transport.name, view.reason)

    def fits_loop(self, rooms, item: StagedItem, chosen: tuple[Transport, object] | None) -> bool:
        """Whether the delivery cannot block the loop: room calls on this process's table and no
        write, a small one that is a memcpy inside ``submit`` (SHM), or one the transport runs on
        its own threads (Mooncake to a peer it has reached)."""
        if not rooms.in_process:
            return False
        if chosen is None:
            return True
        transport, offer = chosen
        if transport.copies_in_submit:
            return item.layout.nbytes <= self.inline_write_bytes
        return transport.submits_in_background(offer)

    def choose(self, offers) -> tuple[Transport, object] | None:
        """The first transport, in the registry's preference order, both sides have and this
        process can reach."""
        for name in TRANSPORT_NAMES:
            transport = self.transports.get(name)
            if transport is None:
                continue
            for offer in offers:
                if offer.kind == name and transport.reachable(offer):
                    return transport, offer
        return None

    def fail(self, item: StagedItem, reason: str, settled: bool, release: bool = True) -> Outcome:
        try:
            view = self.rooms_for(item.handshake).fail(item.room, reason, settled, self.writer_id)
            state = view.state
        except (RoomError, HandshakeError) as exc:
            state, reason = RoomState.FAILED, f"{reason} (and the room could not be told: {exc})"
        if release:
            self._release(item.lease)
        return Outcome(
            item.room, state, None, reason, item.layout.nbytes, item.timings, item.modality
        )

    def finish(
        self, item: StagedItem, state: RoomState, transport: str | None, reason: str | None
    ) -> Outcome:
        self._release(item.lease)
        return Outcome(
            item.room, state, transport, reason, item.layout.nbytes, item.timings, item.modality
        )

    def _release(self, lease: Lease) -> None:
        self.ring.release(lease)
        with self.slot_freed:
            self.slot_freed.notify_all()

    def _hold_until_settled(self, transfer: Transfer, lease: Lease) -> None:
        if transfer.settled:
            self._release(lease)
            return
        with self._lock:
            self._unsettled.append((transfer, lease))

    def reap(self) -> int:
        """Release ring slots whose failed writes have settled; returns how many are still held."""
        with self._lock:
            still = []
            for transfer, lease in self._unsettled:
                transfer.poll()
                if transfer.settled:
                    self._release(lease)
                else:
                    still.append((transfer, lease))
            self._unsettled = still
            return len(still)


def stage(ring: SlotPool, rows: torch.Tensor) -> Lease:
    """Copy an item's rows into a send-ring lease (raises ``NoCapacity`` / ``TooLarge``), through
    numpy (``byte_array``)."""
    source = byte_array(rows)
    lease = ring.lease(source.nbytes)
    ring.bytes_of(lease)[:] = source
    return lease
