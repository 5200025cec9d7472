"""The sender's items whose rooms are in a room table of this process, a drain at a time.

The items of one drain are looked at in one table call (``RoomTable.arrivals``: a room still
waiting for its receiver is marked staged, a gateway may wait for this). An item whose room is
registered and whose write may run on the handshake loop (an SHM copy of at most
``inline_write_bytes``, or a Mooncake write to a peer already reached) is written in the drain:
the drain's writes begun in one table call, copied or submitted, and the copied ones committed in
one table call (their rooms' ends go out to the receiver in one stream frame); a submitted write's
completion is polled by the ``CompletionPoller`` thread, then committed on the loop. An item whose
room still waits for its receiver listens for the registration (a listener, no task; the items of
one drain share a timer), and the registrations that arrive together wake their items into one
drain. Every other item goes on as a task of the ``Sender`` (``deliver_as_task``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from encode_worker.writes import Outcome, StagedItem, Write, Writer
from epdserve.data_plane.transport import CompletionPoller
from epdserve.loop_threads import LoopThread
from epdserve.wire.rooms import RoomState
from handshake.rooms import RoomError, RoomNotFound, RoomStatus, RoomTable

if TYPE_CHECKING:
    from encode_worker.sender import Sender

log = logging.getLogger(__name__)


def _unless_crashed(answer: RoomStatus | Exception) -> RoomStatus | RoomError:
    """A batch room call's answer for one room; raised when the call itself crashed."""
    if isinstance(answer, Exception) and not isinstance(answer, RoomError):
        raise answer
    return answer


class Waits:
    """The items that began to wait for their receivers in one drain: one timer for them all
    (``receiver_wait_s``), cancelled once none of them waits."""

    __slots__ = ("timer", "waiting", "left")

    def __init__(self):
        self.timer: asyncio.TimerHandle | None = None
        self.waiting: list[Registration] = []
        self.left = 0  # of them, those still waiting

    def one_done(self) -> None:
        self.left -= 1
        if not self.left:
            self.waiting.clear()
            if self.timer is not None:
                self.timer.cancel()


class Registration:
    """An item waiting, in this process's table, for its room's receiver: woken once by the
    room's first change (a registration, or its end), from whichever thread made it, the table's
    lock held."""

    __slots__ = ("sender", "item", "table", "since", "waits", "woken")
    until_ended = False

    def __init__(self, sender: Sender, item: StagedItem, table: RoomTable, waits: Waits):
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
        self.sender.redrain(self.item)


class InProcessDelivery:
    """Delivers a drain's items whose rooms are in this process's tables (see the module's
    docstring), on the handshake server's loop; each item's outcome goes to ``sender.report``
    and is counted by ``sender.count_delivered``."""

    def __init__(
        self,
        sender: Sender,
        writer: Writer,
        loop: LoopThread,
        pool: ThreadPoolExecutor,
        poller: CompletionPoller,
        closing: threading.Event,
        receiver_wait_s: float,
        waiting: dict[int, Registration],
    ):
        """``waiting``: the items listening for their registration, by room (the loop's own);
        the sender's drain takes out those woken."""
        self.sender = sender
        self.writer = writer
        self._loop = loop
        self._pool = pool
        self._poller = poller
        self._closing = closing
        self.receiver_wait_s = receiver_wait_s
        self._waiting = waiting

    def deliver(self, by_table: list[tuple[RoomTable, list]]) -> None:
        """One drain's items ``(item, rooms, woken)``, grouped by table: each group looked at
        in one table call (``_route``), the items ready written together (``_write_now``), those
        still waiting on one timer."""
        waits, ready = Waits(), []
        for table, arrived in by_table:
            ready += self._route(table, arrived, waits)
        if waits.left:
            waits.timer = self._loop.loop.call_later(
                self.receiver_wait_s, self._no_registrations, waits
            )
        if ready:
            self._write_now(ready)

    def _route(self, table: RoomTable, arrived: list, waits: Waits) -> list:
        """The items ``(item, rooms, woken)`` whose rooms are ``table``'s, in one table call
        (``RoomTable.arrivals``: a room still waiting for its receiver is marked staged first; a
        gateway may wait for this, to forward its request). The common cases stay in the drain
        (no task): an item whose room is registered, to be written by a copy inside ``submit``
        small enough for the loop (SHM) or by a transport in the background (Mooncake to a peer
        it has reached), is returned as ``(item, rooms, status, chosen)``; an item that came for
        the first time to a room still waiting listens for its registration (``Registration``,
        in ``waits``: its timer is the drain's); every other item goes on as a task."""
        listeners: dict[int, Registration | None] = {}
        for item, _, woken in arrived:
            if woken or self._closing.is_set():  # (closing: the task's path fails it at once)
                listeners[item.room] = None
            else:  # waiting before it listens: a wake from another thread finds it
                listeners[item.room] = self._waiting[item.room] = Registration(
                    self.sender, item, table, waits
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
                self.sender.deliver_as_task(item)
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
                self.sender.deliver_as_task(item)

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

    def _no_registrations(self, waits: Waits) -> None:
        """``receiver_wait_s`` after a drain: its items that still wait fail (their rooms with
        them), unless their change came first (then they are in the drain's inbox already)."""
        self._no_registration([one for one in waits.waiting if not one.woken])

    def fail_waiting(self) -> None:
        """The worker stops: every item still listening fails (on the loop)."""
        self._no_registration([w for w in self._waiting.values() if not w.woken])

    def _no_registration(self, waiting: list[Registration]) -> None:
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
                self.sender.report(self._settle(item, lambda: self.writer.no_receiver(item)))
            except Exception:  # (its room's failure raised too): the others still end
                log.exception("failing room %d, which no receiver registered, crashed", item.room)
            finally:
                self.sender.count_delivered(1)

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
                self.sender.report(self._settle(item, lambda: self._committed(item, write, answer)))
            self.sender.count_delivered(len(commits))

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
        room. A poll that could not tell goes on on a thread, as ``Sender._deliver_on_loop``
        does."""
        try:
            state = polled.result()
        except Exception:  # a poll raised: the write's end is unknown, a thread finds it out
            log.exception("polling the write of room %d failed", item.room)
            state = None
        if state is None:
            self.sender.run_task(self._end_on_thread(item, rooms, write))
            return
        try:
            self.sender.report(self._settle(item, lambda: self.writer.end(item, rooms, write)))
        finally:
            self.sender.count_delivered(1)

    async def _end_on_thread(self, item: StagedItem, rooms, write: Write) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, write.transfer.wait)
        self.sender.report(self._settle(item, lambda: self.writer.end(item, rooms, write)))

    def _ended(self, outcome: Outcome) -> None:
        """An item ``_write_now`` ended: reported and counted."""
        self.sender.report(outcome)
        self.sender.count_delivered(1)

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
