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
ready in one drain begun in one table call and the copied ones committed in one: an SHM copy of at
most ``inline_write_bytes`` (one memcpy; the copy of a 1.8 MB item ~0.2 ms, which other requests on
the loop wait for), or a Mooncake write to a peer already reached (submitted on the loop, run by the
engine's threads, its completion polled for every item by one ``CompletionPoller`` thread). The
receiver's long-poll then answers without a thread hand-off either (each cost ~50-100 us on these
machines). Other writes, and the begin and commit in another process's rooms (over its room stream:
the calls of one loop step share a frame), run on the pool of sender threads.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from encode_worker.writes import Outcome, StagedItem, Write, Writer
from epdserve.data_plane.pool import SlotPool
from epdserve.data_plane.transport import CompletionPoller, Transport
from epdserve.loop_threads import LoopThread, name_os_thread
from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.room_client import HandshakeError
from epdserve.wire.rooms import RoomState, RoomView
from handshake.rooms import RoomError, RoomNotFound, RoomStatus, RoomTable

log = logging.getLogger(__name__)
INLINE_WRITE_BYTES = (
    4 << 20
)  # ~0.4 ms of memcpy here: the most a write may hold up the handshake loop


def _unless_crashed(answer: RoomStatus | Exception) -> RoomStatus | RoomError:
    """A batch room call's answer for one room; raised when the call itself crashed."""
    if isinstance(answer, Exception) and not isinstance(answer, RoomError):
        raise answer
    return answer


class _Waits:
    """The items that began to wait for their receivers in one drain: one timer for them all
    (``receiver_wait_s``), cancelled once none of them waits."""

    __slots__ = ("timer", "waiting", "left")

    def __init__(self):
        self.timer: asyncio.TimerHandle | None = None
        self.waiting: list[_Registration] = []
        self.left = 0  # of them, those still waiting

    def one_done(self) -> None:
        self.left -= 1
        if not self.left:
            self.waiting.clear()
            if self.timer is not None:
                self.timer.cancel()


class _Registration:
    """An item waiting, in this process's table, for its room's receiver: woken once by the
    room's first change (a registration, or its end), from whichever thread made it, the table's
    lock held."""

    __slots__ = ("sender", "item", "table", "since", "waits", "woken")
    until_ended = False

    def __init__(self, sender: Sender, item: StagedItem, table: RoomTable, waits: _Waits):
        self.sender = sender
        self.item = item
        self.table = table
        self.since = time.monotonic()
        self.waits = waits
        self.woken = False

    @staticmethod
    def has_news(state: RoomState, staged: bool) -> bool:
        return state is not RoomState.PENDING

    def wake(self) -> None:
        self.woken = True
        self.sender._registered(self)


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
        self._waiting: dict[int, _Registration] = {}  # by room; the loop's own
        self._delivering = 0  # submitted until their outcome
        self._all_delivered = threading.Condition(self._lock)

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
        of this process's table looked at in one table call per table (``_route``), those whose
        receiver is there written together (``_write_now``); the rest go on as tasks."""
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
                self._as_task(item)  # (a room twice in one drain: the second on its own)
            else:
                seen.add(item.room)
                by_table.setdefault(id(rooms.table), (rooms.table, []))[1].append(
                    (item, rooms, waited is not None)
                )
        waits, ready = _Waits(), []
        for table, arrived in by_table.values():
            ready += self._route(table, arrived, waits)
        if waits.left:
            waits.timer = self._loop.loop.call_later(
                self.receiver_wait_s, self._no_registrations, waits
            )
        if ready:
            self._write_now(ready)

    def _as_task(self, item: StagedItem) -> None:
        task = self._loop.loop.create_task(self._deliver_safely(item))
        self._tasks.add(task)
        task.add_done_callback(self._delivered)

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
        if not self._loop.loop.is_closed():  # (its owner closes it after this)
            self._loop.loop.call_soon_threadsafe(self._fail_waiting)
        if wait:
            with self._all_delivered:
                self._all_delivered.wait_for(lambda: self._delivering == 0)
        self._pool.shutdown(wait=wait)
        self._poller.close()

    # ---- items into this process's table ---------------------------------------------------

    def _route(self, table: RoomTable, arrived: list, waits: _Waits) -> list:
        """The items ``(item, rooms, woken)`` whose rooms are ``table``'s, in one table call
        (``RoomTable.arrivals``: a room still waiting for its receiver is marked staged first; a
        gateway may wait for this, to forward its request). The common cases stay in the drain
        (no task): an item whose room is registered, to be written by a copy inside ``submit``
        small enough for the loop (SHM) or by a transport in the background (Mooncake to a peer
        it has reached), is returned as ``(item, rooms, status, chosen)``; an item that came for
        the first time to a room still waiting listens for its registration (``_Registration``,
        in ``waits``: its timer is the drain's); every other item goes on as a task."""
        listeners: dict[int, _Registration | None] = {}
        for item, _, woken in arrived:
            if woken or self._closing.is_set():  # (closing: the task's path fails it at once)
                listeners[item.room] = None
            else:  # waiting before it listens: a wake from another thread finds it
                listeners[item.room] = self._waiting[item.room] = _Registration(
                    self, item, table, waits
                )
        try:
            answers = table.arrivals(listeners)
        except Exception:
            log.exception("looking at %d rooms failed; delivering them as tasks", len(arrived))
            self._unlisten(table, arrived, listeners)
            return []
        ready = []
        for (item, rooms, _), answer in zip(arrived, answers):
            if answer is None:  # listening
                waits.waiting.append(listeners[item.room])
                waits.left += 1
                continue
            if listeners[item.room] is not None:  # it did not listen
                del self._waiting[item.room]
            chosen = self._ready(item, rooms, answer)
            if chosen is None:
                self._as_task(item)
            else:
                item.timings.setdefault("wait_s", 0.0)
                ready.append((item, rooms, answer, chosen))
        return ready

    def _unlisten(self, table: RoomTable, arrived: list, listeners: dict) -> None:
        """After a crashed ``arrivals``: no item of it listens, and each goes on as a task, but
        one woken meanwhile (it is in the next drain already)."""
        table.stop_listening({room: one for room, one in listeners.items() if one is not None})
        for item, _, _ in arrived:
            one = listeners[item.room]
            if one is not None:
                del self._waiting[item.room]
            if one is None or not one.woken:
                self._as_task(item)

    def _ready(self, item: StagedItem, rooms, status: RoomStatus | RoomError):
        """The transport and offer to write ``item`` with in the drain, or None: its room is not
        registered (or unknown: the task's path says why), or its write cannot run there."""
        if isinstance(status, RoomError) or status.state is not RoomState.REGISTERED:
            return None
        try:
            chosen = self.writer.choose(status.registration.offers)
            if chosen is None or not self.writer.fits_loop(rooms, item, chosen):
                return None
        except Exception:  # the task's path handles it, and says why
            log.exception("routing room %d failed; delivering it as a task", item.room)
            return None
        return chosen

    def _registered(self, waiting: _Registration) -> None:
        """``waiting``'s room changed (any thread, the table's lock held): its item goes into the
        next drain, with every other woken in the same loop step."""
        self._into_drain([waiting.item], delivering=0)

    def _no_registrations(self, waits: _Waits) -> None:
        """``receiver_wait_s`` after a drain: its items that still wait fail (their rooms with
        them), unless their change came first (then they are in the drain's inbox already)."""
        self._no_registration([one for one in waits.waiting if not one.woken])

    def _fail_waiting(self) -> None:
        self._no_registration([w for w in self._waiting.values() if not w.woken])

    def _no_registration(self, waiting: list[_Registration]) -> None:
        """No receiver came in time for these items (or the worker stops): they stop listening
        and their rooms fail, unless their change comes first (then it is in the drain's inbox
        already)."""
        by_table: dict[int, tuple[RoomTable, dict]] = {}
        for one in waiting:
            by_table.setdefault(id(one.table), (one.table, {}))[1][one.item.room] = one
        for table, listeners in by_table.values():
            table.stop_listening(listeners)
        for one in waiting:
            if one.woken or self._waiting.get(one.item.room) is not one:
                continue
            del self._waiting[one.item.room]
            one.waits.one_done()  # (a no-op on a timer that fired)
            item = one.item
            item.timings["wait_s"] = time.monotonic() - one.since
            try:
                self._report(self._settle(item, lambda: self.writer.no_receiver(item)))
            except Exception:  # (its room's failure raised too): the others still end
                log.exception("failing room %d, which no receiver registered, crashed", item.room)
            finally:
                self._count_delivered(1)

    def _write_now(self, ready: list) -> None:
        """Write the items ``_route`` found ready: their writes begun in one table call, copied
        or submitted, and the copied ones committed in one table call (their rooms' ends go out
        to the receiver in one stream frame)."""
        begins = []
        for item, rooms, status, chosen in ready:
            begin = self._settle(item, lambda: self.writer.check(item, status, chosen))
            if isinstance(begin, Outcome):
                self._ended(begin)
            else:
                begins.append((item, rooms, begin, chosen))
        if not begins:
            return
        table = begins[0][1].table  # every room here is this process's own table's
        begun = self._table_call(table.begin_writes, [begin for _, _, begin, _ in begins])
        commits = []
        for (item, rooms, begin, chosen), answer in zip(begins, begun):
            write = self._settle(
                item, lambda: self.writer.submit(item, begin, _unless_crashed(answer), chosen)
            )
            if isinstance(write, Outcome):
                self._ended(write)
            elif write.transport.copies_in_submit:  # over inside submit
                commit = self._settle(item, lambda: self.writer.commit(item, write))
                if isinstance(commit, Outcome):
                    self._ended(commit)
                else:
                    commits.append((item, write, commit))
            else:
                self._poller.completion(write.transfer).add_done_callback(
                    functools.partial(self._write_done, item, rooms, write)
                )
        if commits:
            answers = self._table_call(table.commit_all, [commit for _, _, commit in commits])
            for (item, write, _), answer in zip(commits, answers):
                self._report(self._settle(item, lambda: self._committed(item, write, answer)))
            self._count_delivered(len(commits))

    def _committed(self, item: StagedItem, write: Write, answer: RoomStatus | Exception) -> Outcome:
        if isinstance(answer, Exception):
            raise answer
        return self.writer.committed(item, write, answer)

    @staticmethod
    def _table_call(call, bodies: list) -> list:
        """A batch call on this process's table, each room answered as a ``RoomStatus``; its
        crash becomes each body's error."""
        try:
            return call(bodies)
        except Exception as exc:
            log.exception("a batch room call crashed")
            return [exc] * len(bodies)

    def _write_done(self, item: StagedItem, rooms, write: Write, polled: asyncio.Future) -> None:
        """A write ``_write_now`` started ended (the poller says how): commit it or fail the
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

    def _ended(self, outcome: Outcome) -> None:
        """An item ``_write_now`` ended: reported and counted."""
        self._report(outcome)
        self._count_delivered(1)

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
