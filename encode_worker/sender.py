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
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from data_plane.pool import SlotPool
from data_plane.transport import CompletionPoller, Transport
from encode_worker.writes import Outcome, StagedItem, Write, Writer
from handshake.rooms import MINTED_VERSION, RoomError, RoomNotFound, RoomTable
from loop_threads import LoopThread, name_os_thread
from wire.addresses import EncodeHandshake
from wire.room_client import HandshakeError
from wire.rooms import RoomState, RoomView

log = logging.getLogger(__name__)
_DONE, _WRITING, _NOT_NOW = object(), object(), object()  # what _deliver_now did with an item
INLINE_WRITE_BYTES = (
    4 << 20
)  # ~0.4 ms of memcpy here: the most a write may hold up the handshake loop


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
        local_table: RoomTable | None = None,
    ):
        self.rooms_for = rooms_for
        # this worker's own table: intake opens rooms there, whatever name the sender gave it
        self.local_table = local_table
        self.receiver_wait_s = receiver_wait_s
        self.on_outcome = on_outcome
        self._closing = threading.Event()
        self.writer = Writer(
            ring,
            transports,
            rooms_for,
            receiver_wait_s,
            write_timeout_s,
            inline_write_bytes,
            self._closing,
        )
        self.slot_freed = self.writer.slot_freed
        self.reap = self.writer.reap
        self._pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="sender", initializer=name_os_thread
        )
        self._loop = loop  # the handshake server's: its owner stops it
        self._poller = CompletionPoller("sender-poller")
        self._lock = threading.Lock()
        # Items submitted and not yet on the loop: one loop wake-up takes all that came meanwhile
        # (a batch's items, or items of several requests under load), not one hand-off each.
        self._inbox: list[StagedItem] = []
        self._drain_due = False  # a wake-up is scheduled and has not run yet
        self._tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self._delivering = 0  # submitted until their outcome
        self._all_delivered = threading.Condition(self._lock)

    def submit(self, item: StagedItem) -> None:
        """Deliver ``item`` on the loop (from any thread); its outcome goes to ``on_outcome``."""
        self.submit_all([item])

    def submit_all(self, items: list[StagedItem]) -> None:
        """Deliver ``items`` (a batch's) on the loop, with one wake-up (from any thread)."""
        with self._lock:
            self._inbox.extend(items)
            self._delivering += len(items)
            if self._drain_due:
                return
            self._drain_due = True
        try:
            self._loop.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nothing submitted from now on is delivered
            with self._lock:
                del self._inbox[-len(items) :]
                self._delivering -= len(items)
                self._drain_due = False
            raise

    def _drain(self) -> None:
        with self._lock:
            items, self._inbox, self._drain_due = self._inbox, [], False
        delivered = 0
        for item in items:
            try:
                handled = self._deliver_now(item)
            except Exception:  # before any room call: the task's path handles it, and says why
                log.exception(
                    "delivering room %d at once failed; delivering it as a task", item.room
                )
                handled = _NOT_NOW
            if handled is _DONE:
                delivered += 1
            elif handled is _NOT_NOW:
                task = self._loop.loop.create_task(self._deliver_safely(item))
                self._tasks.add(task)
                task.add_done_callback(self._delivered)
        if delivered:
            self._count_delivered(delivered)

    def _delivered(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._count_delivered(1)

    def _count_delivered(self, count: int) -> None:
        with self._all_delivered:
            self._delivering -= count
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

    def _deliver_now(self, item: StagedItem) -> object:
        """The common case, in the drain itself (no task, no wait for a receiver): a room of this
        process's table whose receiver has registered, written by a copy inside ``submit`` small
        enough for the loop (SHM: ``_DONE``), or by a transport in the background (Mooncake to a
        peer it has reached: ``_WRITING``, settled by ``_write_done`` when the completion poller
        says so). ``_NOT_NOW`` for every other item, whose room, when this table's and still
        waiting for its receiver, is marked staged first (``RoomTable.mark_staged``)."""
        if self.local_table is not None:  # a gateway may wait for this, to forward its request
            self.local_table.mark_staged(item.room)  # (only a room of this table, still PENDING)
        rooms = self.rooms_for(item.handshake)
        if not rooms.in_process:
            return _NOT_NOW
        try:
            view = rooms.table.view(item.room)
        except RoomError:  # the task's path says why
            return _NOT_NOW
        if view.state is not RoomState.REGISTERED:
            return _NOT_NOW
        chosen = self.writer.choose(view.registration.offers)
        if chosen is None or not self.writer.fits_loop(rooms, item, chosen):
            return _NOT_NOW
        item.timings["wait_s"] = 0.0
        write = self._settle(item, lambda: self.writer.start(item, rooms, view, chosen))
        if isinstance(write, Outcome):
            self._report(write)
            return _DONE
        if chosen[0].copies_in_submit:  # over inside submit
            self._report(self._settle(item, lambda: self.writer.end(item, rooms, write)))
            return _DONE
        self._poller.completion(write.transfer).add_done_callback(
            functools.partial(self._write_done, item, rooms, write)
        )
        return _WRITING

    def _write_done(self, item: StagedItem, rooms, write: Write, polled: asyncio.Future) -> None:
        """A write ``_deliver_now`` started ended (the poller says how): commit it or fail the
        room. A poll that could not tell goes on on a thread, as ``_deliver_on_loop`` does."""
        try:
            state = polled.result()
        except Exception:  # a poll raised: the write's end is unknown, a thread finds it out
            log.exception("polling the write of room %d failed", item.room)
            state = None
        if state is None:
            task = self._loop.loop.create_task(self._end_on_thread(item, rooms, write))
            self._tasks.add(task)
            task.add_done_callback(self._delivered)
            return
        try:
            self._report(self._settle(item, lambda: self.writer.end(item, rooms, write)))
        finally:
            self._count_delivered(1)

    async def _end_on_thread(self, item: StagedItem, rooms, write: Write) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, write.transfer.wait)
        self._report(self._settle(item, lambda: self.writer.end(item, rooms, write)))

    def _report(self, outcome: Outcome) -> None:
        """``on_outcome``, whose failure loses no other item."""
        try:
            self.on_outcome(outcome)
        except Exception:
            log.exception("reporting the outcome of room %d failed", outcome.room)

    def _settle(self, item: StagedItem, step) -> Outcome | Write:
        """``step()`` (a room call of this process's table, or a write's start or end), or the
        item's outcome when it raised: its room failed with why."""
        try:
            return step()
        except RoomNotFound as exc:
            return self.writer.finish(item, RoomState.FAILED, None, f"not delivered: {exc}")
        except RoomError as exc:  # in-process: failing the room does not wait
            return self.writer.fail(item, f"room unusable: {exc}", settled=True)
        except Exception as exc:  # never lose an item silently: fail its room
            log.exception("delivery of room %d crashed", item.room)
            return self.writer.fail(
                item, f"encode worker error: {type(exc).__name__}: {exc}", settled=True
            )

    async def _deliver_safely(self, item: StagedItem) -> None:
        loop = asyncio.get_running_loop()
        try:
            rooms = self.rooms_for(item.handshake)
            view = await self._wait_for_receiver(rooms, item)
            chosen = (
                self.writer.choose(view.registration.offers)
                if view.state is RoomState.REGISTERED
                else None
            )
            if self.writer.fits_loop(rooms, item, chosen):
                outcome = await self._deliver_on_loop(item, rooms, view, chosen)
            else:
                outcome = await loop.run_in_executor(
                    self._pool, self._deliver, item, rooms, view, chosen
                )
        except RoomNotFound as exc:  # nothing to tell: the room is unknown at its endpoint, or gone
            outcome = self.writer.finish(item, RoomState.FAILED, None, f"not delivered: {exc}")
        except (
            RoomError,
            HandshakeError,
        ) as exc:  # expected (an endpoint down): a reason, no traceback
            reason = f"room unusable: {exc}"
            outcome = await loop.run_in_executor(
                self._pool, lambda: self.writer.fail(item, reason, settled=True)
            )
        except Exception as exc:  # never lose an item silently: fail its room
            log.exception("delivery of room %d crashed", item.room)
            reason = f"encode worker error: {type(exc).__name__}: {exc}"
            outcome = await loop.run_in_executor(
                self._pool, lambda: self.writer.fail(item, reason, settled=True)
            )
        self._report(outcome)

    def _deliver(
        self, item: StagedItem, rooms, view: RoomView, chosen: tuple[Transport, object] | None
    ) -> Outcome:
        """On a sender thread, once the wait for the receiver is over; ``chosen``: the transport
        and offer picked from the registration."""
        write = self.writer.start(item, rooms, view, chosen)
        if isinstance(write, Outcome):
            return write
        write.transfer.wait()
        return self.writer.end(item, rooms, write)

    async def _deliver_on_loop(
        self, item: StagedItem, rooms, view: RoomView, chosen: tuple[Transport, object] | None
    ) -> Outcome:
        """``_deliver`` on the loop (see ``_on_loop``): the write is awaited through the
        completion poller, not slept on."""
        write = self.writer.start(item, rooms, view, chosen)
        if isinstance(write, Outcome):
            return write
        try:
            state = await self._poller.completion(write.transfer)
        except Exception:  # a poll raised: the write's end is unknown, a thread finds it out
            log.exception("polling the write of room %d failed", item.room)
            state = None
        if state is None:  # the transport must probe or resubmit (it may wait): on a thread
            await asyncio.get_running_loop().run_in_executor(self._pool, write.transfer.wait)
        return self.writer.end(item, rooms, write)

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
