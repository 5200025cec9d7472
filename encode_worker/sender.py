"""The send path: one item's staged rows -> the receiver registered in its room.

Per item: wait (bounded, long-poll, no spinning) for the room's receiver, and fail the room
when none came in time (its receiver, arriving later, learns it at once); pick the transport
from what both sides offer, in the registry's preference order (``wire.offers.TRANSPORTS``:
SHM on the same node, else Mooncake; loopback in tests); check rows x
width x dtype and capacity before any byte moves; begin the write; write; commit with the slot
generation and a checksum. Any failure fails only this room, with a reason the receiver can read.
The send-ring slot is released once the transport has settled (a write that may still read it
keeps it leased).

Waiting for a receiver holds no thread: every waiting item is a coroutine on the handshake
server's own event loop, so items whose receivers come late never hold up items whose receivers
are there (with a thread per waiting item, eight slow receivers stalled every delivery behind
them), and a registration wakes its item without a thread hand-off. Into a room of this
process's own table, the write and the room calls around it run on the loop too when they cannot
block it: an SHM copy of at most ``inline_write_bytes`` (one memcpy; the copy of a 1.8 MB item
~0.2 ms, which other requests on the loop wait for), or a Mooncake write to a peer already
reached (submitted on the loop, run by the engine's threads, its completion polled for every
item by one ``CompletionPoller`` thread). The receiver's long-poll then answers without a thread
hand-off either (each cost ~50-100 us on these machines). Other writes, and room calls to another
process's table, run on the pool of sender threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from data_plane.commit import EmbeddingLayout
from data_plane.pool import Lease, SlotPool
from data_plane.transport import (
    CompletionPoller,
    Transfer,
    TransferRefused,
    TransferState,
    Transport,
)
from handshake.client import HandshakeError
from handshake.rooms import MINTED_VERSION, RoomError, RoomNotFound
from loop_threads import LoopThread, name_os_thread
from wire.addresses import EncodeHandshake
from wire.modality import Modality
from wire.offers import TRANSPORT_NAMES
from wire.rooms import BeginWrite, CommitBody, EncodeTimings, RoomState, RoomView

log = logging.getLogger(__name__)
INLINE_WRITE_BYTES = (
    4 << 20
)  # ~0.4 ms of memcpy here: the most a write may hold up the handshake loop


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
class _Write:
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


class Sender:
    def __init__(
        self,
        ring: SlotPool,
        transports: dict[str, Transport],
        rooms_for: Callable[[EncodeHandshake], object],
        loop: LoopThread,
        receiver_wait_s: float = 30.0,
        write_timeout_s: float = 30.0,
        workers: int = 8,
        on_outcome: Callable[[Outcome], None] = lambda outcome: None,
        inline_write_bytes: int = INLINE_WRITE_BYTES,
    ):
        self.ring = ring
        self.transports = transports
        self.rooms_for = rooms_for
        self.receiver_wait_s = receiver_wait_s
        self.write_timeout_s = write_timeout_s
        self.on_outcome = on_outcome
        self.inline_write_bytes = inline_write_bytes
        # names this worker in begin_write, so a room sent to two workers is written by one only
        self.writer_id = f"{socket.gethostname()[:64]}-{os.getpid()}-{secrets.token_hex(4)}"
        self._pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="sender", initializer=name_os_thread
        )
        self._loop = loop  # the handshake server's: its owner stops it
        self._poller = CompletionPoller("sender-poller")
        self._unsettled: list[tuple[Transfer, Lease]] = []
        self._lock = threading.Lock()
        # Items submitted and not yet on the loop: one loop wake-up takes all that came meanwhile
        # (a batch's items, or items of several requests under load), not one hand-off each.
        self._inbox: list[StagedItem] = []
        self._drain_due = False  # a wake-up is scheduled and has not run yet
        self._tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self._delivering = 0  # submitted until their outcome
        self._all_delivered = threading.Condition(self._lock)
        self._closing = threading.Event()
        self.slot_freed = threading.Condition()

    def submit(self, item: StagedItem) -> None:
        """Deliver ``item`` on the loop (from any thread); its outcome goes to ``on_outcome``."""
        with self._lock:
            self._inbox.append(item)
            self._delivering += 1
            if self._drain_due:
                return
            self._drain_due = True
        try:
            self._loop.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nothing submitted from now on is delivered
            with self._lock:
                self._inbox.remove(item)
                self._delivering -= 1
                self._drain_due = False
            raise

    def _drain(self) -> None:
        with self._lock:
            items, self._inbox, self._drain_due = self._inbox, [], False
        for item in items:
            task = self._loop.loop.create_task(self._deliver_safely(item))
            self._tasks.add(task)
            task.add_done_callback(self._delivered)

    def _delivered(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        with self._all_delivered:
            self._delivering -= 1
            if not self._delivering:
                self._all_delivered.notify_all()

    def close(self, wait: bool = True) -> None:
        """Stop: items still waiting for a receiver fail at once; writes in flight finish."""
        self._closing.set()
        if wait:
            with self._all_delivered:
                self._all_delivered.wait_for(lambda: self._delivering == 0)
        self._pool.shutdown(wait=wait)
        self._poller.close()

    # ---- one item --------------------------------------------------------------------------

    async def _deliver_safely(self, item: StagedItem) -> None:
        loop = asyncio.get_running_loop()
        try:
            rooms = self.rooms_for(item.handshake)
            view = await self._wait_for_receiver(rooms, item)
            chosen = (
                self._choose(view.registration.offers)
                if view.state is RoomState.REGISTERED
                else None
            )
            if self._on_loop(rooms, item, chosen):
                outcome = await self._deliver_on_loop(item, rooms, view, chosen)
            else:
                outcome = await loop.run_in_executor(
                    self._pool, self._deliver, item, rooms, view, chosen
                )
        except RoomNotFound as exc:  # nothing to tell: the room is unknown at its endpoint, or gone
            outcome = self._finish(item, RoomState.FAILED, None, f"not delivered: {exc}")
        except (
            RoomError,
            HandshakeError,
        ) as exc:  # expected (an endpoint down): a reason, no traceback
            reason = f"room unusable: {exc}"
            outcome = await loop.run_in_executor(
                self._pool, lambda: self._fail(item, reason, settled=True)
            )
        except Exception as exc:  # never lose an item silently: fail its room
            log.exception("delivery of room %d crashed", item.room)
            reason = f"encode worker error: {type(exc).__name__}: {exc}"
            outcome = await loop.run_in_executor(
                self._pool, lambda: self._fail(item, reason, settled=True)
            )
        self.on_outcome(outcome)

    def _deliver(
        self, item: StagedItem, rooms, view: RoomView, chosen: tuple[Transport, object] | None
    ) -> Outcome:
        """On a sender thread, once the wait for the receiver is over; ``chosen``: the transport
        and offer picked from the registration."""
        write = self._start_write(item, rooms, view, chosen)
        if isinstance(write, Outcome):
            return write
        write.transfer.wait()
        return self._end_write(item, rooms, write)

    async def _deliver_on_loop(
        self, item: StagedItem, rooms, view: RoomView, chosen: tuple[Transport, object] | None
    ) -> Outcome:
        """``_deliver`` on the loop (see ``_on_loop``): the write is awaited through the
        completion poller, not slept on."""
        write = self._start_write(item, rooms, view, chosen)
        if isinstance(write, Outcome):
            return write
        try:
            state = await self._poller.completion(write.transfer)
        except Exception:  # a poll raised: the write's end is unknown, a thread finds it out
            log.exception("polling the write of room %d failed", item.room)
            state = None
        if state is None:  # the transport must probe or resubmit (it may wait): on a thread
            await asyncio.get_running_loop().run_in_executor(self._pool, write.transfer.wait)
        return self._end_write(item, rooms, write)

    def _start_write(
        self, item: StagedItem, rooms, view: RoomView, chosen: tuple[Transport, object] | None
    ) -> Outcome | _Write:
        """Check the registration against the item, begin the write in the room and submit it:
        the write in flight, or the item's outcome when it ends here."""
        if view.state is RoomState.PENDING:  # no receiver came: the room fails now, not at its TTL
            return self._fail(
                item,
                "encode worker shutting down"
                if self._closing.is_set()
                else f"no receiver registered within {self.receiver_wait_s:g} s",
                settled=True,
            )
        if view.state is RoomState.WRITING:  # a room sent to two workers: the other one has it
            return self._finish(
                item, RoomState.FAILED, None, "not written: another writer is writing this room"
            )
        if view.state is not RoomState.REGISTERED:
            return self._finish(
                item, view.state, None, view.reason or "room ended before a receiver came"
            )
        registration = view.registration
        reserved = EmbeddingLayout(registration.rows, registration.width, registration.dtype)
        if reserved != item.layout:
            return self._fail(
                item,
                f"contract mismatch: encoder has [{item.layout.rows}, {item.layout.width}] "
                f"{item.layout.dtype}, receiver reserved [{reserved.rows}, {reserved.width}] "
                f"{reserved.dtype}",
                settled=True,
            )
        if chosen is None:
            kinds = [offer.kind for offer in registration.offers]
            return self._fail(
                item,
                f"no common transport: receiver offers {kinds}, "
                f"encoder has {sorted(self.transports)}",
                settled=True,
            )
        transport, offer = chosen
        if offer.capacity < item.layout.nbytes:
            return self._fail(
                item,
                f"receiver slot holds {offer.capacity} bytes, item needs {item.layout.nbytes}",
                settled=True,
            )
        try:
            view = rooms.begin_write(
                BeginWrite(
                    room=item.room,
                    generation=registration.generation,
                    transport=transport.name,
                    write_timeout_s=self.write_timeout_s,
                    writer=self.writer_id,
                )
            )
        except RoomError as exc:  # the room is another writer's (or gone): leave it as it is
            return self._finish(item, RoomState.FAILED, None, f"not written: {exc}")
        if view.state is not RoomState.WRITING or view.cancel_requested:
            return self._finish(item, view.state, None, view.reason or "cancelled before the write")
        started = time.monotonic()
        try:
            transfer = transport.submit(
                self.ring.view(item.lease), offer, started + self.write_timeout_s
            )
        except TransferRefused as exc:
            return self._fail(item, f"{transport.name} refused the write: {exc}", settled=True)
        return _Write(transport, offer, registration.generation, transfer, started)

    def _end_write(self, item: StagedItem, rooms, write: _Write) -> Outcome:
        """Once the write is DONE or FAILED: commit it, or fail the room."""
        item.timings["transfer_s"] = time.monotonic() - write.started
        transfer, name = write.transfer, write.transport.name
        if transfer.state is not TransferState.DONE:
            self._hold_until_settled(transfer, item.lease)
            return self._fail(
                item,
                f"{name} write failed: {transfer.error}",
                settled=transfer.settled,
                release=False,
            )
        view = rooms.commit(
            CommitBody(
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
            )
        )
        return self._finish(item, view.state, name, view.reason)

    async def _wait_for_receiver(self, rooms, item: StagedItem) -> RoomView:
        waiting = time.monotonic()
        deadline = waiting + self.receiver_wait_s
        version = (
            MINTED_VERSION  # the first long-poll waits unless the room moved since it was minted
        )
        while True:
            view = await rooms.wait_async(
                item.room, version, max(0.0, min(0.5, deadline - time.monotonic()))
            )
            if (
                view.state is not RoomState.PENDING
                or time.monotonic() >= deadline
                or self._closing.is_set()
            ):
                item.timings["wait_s"] = time.monotonic() - waiting
                return view
            version = view.version

    def _on_loop(self, rooms, item: StagedItem, chosen: tuple[Transport, object] | None) -> bool:
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

    def _choose(self, offers) -> tuple[Transport, object] | None:
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

    # ---- endings ---------------------------------------------------------------------------

    def _fail(self, item: StagedItem, reason: str, settled: bool, release: bool = True) -> Outcome:
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

    def _finish(
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
    """Copy an item's rows into a send-ring lease (raises ``NoCapacity`` / ``TooLarge``)."""
    flat = rows.contiguous().reshape(-1).view(torch.uint8)
    lease = ring.lease(flat.numel())
    ring.view(lease).copy_(flat)
    return lease
