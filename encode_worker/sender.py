"""The send path: one item's staged rows -> the receiver registered in its room.

Per item: wait (bounded, no spinning) for the room's receiver, and fail the room
when none came in time (its receiver, arriving later, learns it at once); pick the transport
from what both sides offer, in the registry's preference order (``wire.offers.TRANSPORTS``:
SHM on the same node, else Mooncake; loopback in tests); check rows x
width x dtype and capacity before any byte moves; begin the write; write; commit with the slot
generation and a checksum. Any failure fails only this room, with a reason the receiver can read.
The send-ring slot is released once the transport has settled (a write that may still read it
keeps it leased).

Waiting for a receiver holds no thread, so items whose receivers come late never hold up items whose
receivers are there (with a thread per waiting item, eight slow receivers stalled every delivery
behind them): an item whose room is in this process's own table listens for the room's registration
(a listener, no task; the items of one drain share a timer and one table call), and the
registrations that arrive together wake their items into one drain; an item whose room is elsewhere
is a coroutine on the handshake server's own event loop, waiting for the registration over that
endpoint's room stream (``handshake.access.RemoteRooms``). Into a room of this process's own table,
the write and the room calls around it run on the loop when they cannot block it, the writes found
ready in one drain begun in one table call and the copied ones committed in one
(``encode_worker.in_process_delivery``): an SHM copy of at most ``inline_write_bytes`` (one memcpy;
the copy of a 1.8 MB item ~0.2 ms, which other requests on the loop wait for), or a Mooncake write
to a peer already reached (submitted on the loop, run by the engine's threads, its completion polled
for every item by one ``CompletionPoller`` thread). The receiver's long-poll then answers without a
thread hand-off either (each cost ~50-100 us on these machines). Other writes, and the begin and
commit in another process's rooms (over its room stream: the calls of one loop step share a frame),
run on the pool of sender threads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor

from encode_worker.in_process_delivery import InProcessDelivery, Registration
from encode_worker.writes import Outcome, StagedItem, Writer
from epdserve.data_plane.pool import SlotPool
from epdserve.data_plane.transport import CompletionPoller, Transport
from epdserve.loop_threads import LoopThread, name_os_thread
from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.room_client import HandshakeError
from epdserve.wire.rooms import RoomState, RoomView
from handshake.rooms import RoomError, RoomNotFound, RoomTable

log = logging.getLogger(__name__)
INLINE_WRITE_BYTES = (
    4 << 20
)  # ~0.4 ms of memcpy here: the most a write may hold up the handshake loop


class Sender:
    """Delivers each staged item into its room (see the module's docstring): the items submitted
    meanwhile taken on the loop in one drain; those whose rooms are in this process's tables
    handed to ``InProcessDelivery``, every other as a task of its own."""

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
        fingerprint: str | None = None,
    ):
        """``fingerprint``: the compact fingerprint of the model whose rows it delivers
        (``Writer``)."""
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
            fingerprint,
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
        # the items listening for their registration, by room; the loop's own
        self._waiting: dict[int, Registration] = {}
        self._delivering = 0  # submitted until their outcome
        self._all_delivered = threading.Condition(self._lock)
        self._in_process = InProcessDelivery(
            self,
            self.writer,
            loop,
            self._pool,
            self._poller,
            self._closing,
            receiver_wait_s,
            self._waiting,
        )

    def submit(self, item: StagedItem) -> None:
        """Deliver ``item`` on the loop (from any thread); its outcome goes to ``on_outcome``."""
        self.submit_all([item])

    def submit_all(self, items: list[StagedItem]) -> None:
        """Deliver ``items`` (a batch's) on the loop, with one wake-up (from any thread)."""
        try:
            self._into_drain(items, delivering=len(items))
        except RuntimeError:  # the loop is closed: nothing submitted from now on is delivered
            with self._lock:
                del self._inbox[-len(items) :]
                self._delivering -= len(items)
                self._drain_due = False
            raise

    def _into_drain(self, items: list[StagedItem], delivering: int) -> None:
        """Put ``items`` in the next drain (``delivering`` of them new), scheduling it unless it
        is due already: one wake-up of the loop for every item that comes meanwhile."""
        with self._lock:
            self._inbox.extend(items)
            self._delivering += delivering
            if self._drain_due:
                return
            self._drain_due = True
        if threading.get_ident() == self._loop.thread.ident:
            self._loop.loop.call_soon(self._drain)
        else:
            self._loop.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        """Every item submitted (or woken by its registration) since the last drain: the items
        of this process's tables to ``InProcessDelivery`` (one table call per table, those whose
        receiver is there written together); the rest go on as tasks."""
        with self._lock:
            items, self._inbox, self._drain_due = self._inbox, [], False
        by_table: dict[int, tuple[RoomTable, list]] = {}
        seen: set[int] = set()  # the rooms going to a table call (one answer per room)
        for item in items:
            waited = self._waiting.pop(item.room, None)
            if waited is not None:  # woken by its registration: it waits no more
                waited.waits.one_done()
                item.timings["wait_s"] = time.monotonic() - waited.since
            try:
                rooms = self.rooms_for(item.handshake)
                if not rooms.in_process and waited is None and self.local_table is not None:
                    # a room of this table, its item naming this worker otherwise: staged here
                    self.local_table.mark_staged(item.room)
            except Exception:  # before any room call: the task's path handles it, and says why
                log.exception("routing room %d failed; delivering it as a task", item.room)
                rooms = None
            if rooms is None or not rooms.in_process or item.room in seen:
                self.deliver_as_task(item)  # (a room twice in one drain: the second on its own)
            else:
                seen.add(item.room)
                by_table.setdefault(id(rooms.table), (rooms.table, []))[1].append(
                    (item, rooms, waited is not None)
                )
        self._in_process.deliver(list(by_table.values()))

    def redrain(self, item: StagedItem) -> None:
        """``item``'s room changed while it listened (any thread, the table's lock held): it goes
        into the next drain, with every other woken in the same loop step."""
        self._into_drain([item], delivering=0)

    def deliver_as_task(self, item: StagedItem) -> None:
        """Deliver ``item`` by a coroutine of its own (on the loop)."""
        self.run_task(self._deliver_safely(item))

    def run_task(self, delivery: Coroutine) -> None:
        """Run ``delivery``, one item's, as a task on the loop; the item counted delivered when
        it ends."""
        task = self._loop.loop.create_task(delivery)
        self._tasks.add(task)
        task.add_done_callback(self._delivered)

    def _delivered(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self.count_delivered(1)

    def count_delivered(self, count: int) -> None:
        """``count`` items submitted have their outcome."""
        with self._all_delivered:
            self._delivering -= count
            if not self._delivering:
                self._all_delivered.notify_all()

    def close(self, wait: bool = True) -> None:
        """Stop: items still waiting for a receiver fail at once; writes in flight finish."""
        self._closing.set()
        if not self._loop.loop.is_closed():  # (its owner closes it after this)
            self._loop.loop.call_soon_threadsafe(self._in_process.fail_waiting)
        if wait:
            with self._all_delivered:
                self._all_delivered.wait_for(lambda: self._delivering == 0)
        self._pool.shutdown(wait=wait)
        self._poller.close()

    def report(self, outcome: Outcome) -> None:
        """``on_outcome``, whose failure loses no other item."""
        try:
            self.on_outcome(outcome)
        except Exception:
            log.exception("reporting the outcome of room %d failed", outcome.room)

    async def _deliver_safely(self, item: StagedItem) -> None:
        loop = asyncio.get_running_loop()
        try:
            rooms = self.rooms_for(item.handshake)
            view = await self._wait_for_receiver(rooms, item)
            chosen = (
                self.writer.choose(view.registration.offers)
                if view is not None and view.state is RoomState.REGISTERED
                else None
            )
            if view is None:  # no receiver came in time (or the worker stops)
                outcome = await loop.run_in_executor(self._pool, self.writer.no_receiver, item)
            elif self.writer.fits_loop(rooms, item, chosen):
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
        self.report(outcome)

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

    async def _wait_for_receiver(self, rooms, item: StagedItem) -> RoomView | None:
        """The item's room once its receiver registered it (or it ended); None when no receiver
        came within ``receiver_wait_s``, or the worker stops (looked at every 0.5 s)."""
        waiting = time.monotonic()
        deadline = waiting + self.receiver_wait_s
        try:
            while not self._closing.is_set():
                view = await rooms.wait_registered(
                    item.room, max(0.0, min(0.5, deadline - time.monotonic()))
                )
                if view is not None or time.monotonic() >= deadline:
                    return view
            return None
        finally:
            item.timings["wait_s"] = time.monotonic() - waiting
