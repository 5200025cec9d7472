"""A request's receive job as the engine sees it (``ReceiveJob``, its items' ``ItemOutcome``s), and
each item the receiver waits for (``PendingItem``: its reserved slot and its room)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import torch

from epdserve.data_plane.commit import EmbeddingLayout
from epdserve.data_plane.pool import Lease, SlotPool
from epdserve.multimodal.items import MultimodalDataItem, MultimodalInputs
from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.rooms import EncodeTimings
from epdserve.wire.states import ItemState, JobState


@dataclass
class ItemOutcome:
    index: int
    state: ItemState = ItemState.PENDING
    transport: str | None = None
    reason: str | None = None
    seconds: float = 0.0  # job start -> published (or failed)
    fallback: bool = False
    encoder: EncodeTimings | None = (
        None  # where the time went on the encode worker, from its commit
    )


@dataclass
class PendingItem:
    """An item whose rows the receiver waits for: its slot in the pool and its room."""

    index: int
    item: MultimodalDataItem
    handshake: EncodeHandshake
    layout: EmbeddingLayout
    lease: Lease
    deadline: float
    version: int = 0  # of its room, as the last answer gave it


class ReceiveJob:
    """One request's items, as the engine sees them while the receiver fills them.

    Ownership: the job owns its future, its cancelled flag and the zero-copy leases it holds; the
    receiver changes them only through ``hold``, ``mark_cancelled``, ``settle_if_done`` and
    ``ended``. ``outcomes`` is written by the receiver's loop thread alone while the job runs (an
    item's outcome, once settled, never changes); the engine's threads read it, and call ``poll``,
    ``wait``, ``cancel``, ``abort`` and ``release``. ``_held`` and ``_released`` are guarded by
    ``_lock`` (the loop adds to ``_held``; ``release``, from any thread, empties it); ``_cancelled``
    is set once, from any thread, under the same lock. ``cancel`` and ``abort`` are the
    receiver's (they schedule work on its loop); ``pool`` is where held slots go back.
    """

    def __init__(
        self,
        request_id: str,
        inputs: MultimodalInputs,
        pool: SlotPool,
        cancel: Callable[[ReceiveJob, str], None],
        abort: Callable[[ReceiveJob, str], None],
    ):
        self.request_id = request_id
        self.inputs = inputs
        self.outcomes = [ItemOutcome(i) for i in range(len(inputs.mm_items))]
        self._pool = pool
        self._cancel = cancel
        self._abort = abort
        self._future = Future()  # done as soon as every item is settled (or the job's task crashed)
        self._cancelled = threading.Event()
        self._held: list[
            tuple[MultimodalDataItem, Lease]
        ] = []  # zero-copy slots behind published views
        self._lock = threading.Lock()
        self._released = False
        self.started = time.monotonic()

    def poll(self) -> JobState:
        """Non-blocking: PENDING until every item is DONE (or skipped), or FAILED."""
        if not self._future.done():
            return JobState.PENDING
        return (
            JobState.FAILED
            if any(o.state == ItemState.FAILED for o in self.outcomes)
            else JobState.DONE
        )

    def wait(self, timeout: float | None = None) -> JobState:
        try:
            self._future.result(timeout)
        except TimeoutError:
            return JobState.PENDING
        return self.poll()

    @property
    def future(self) -> Future:
        """Completes when the job ends (``asyncio.wrap_future`` it to await from a loop)."""
        return self._future

    @property
    def reasons(self) -> dict[int, str]:
        return {o.index: o.reason for o in self.outcomes if o.state == ItemState.FAILED}

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel`` (or ``abort``) was asked: no item falls back to the local tower
        then."""
        return self._cancelled.is_set()

    def mark_cancelled(self) -> bool:
        """Set the cancelled flag (any thread); True for the one call that set it."""
        with self._lock:
            first = not self._cancelled.is_set()
            self._cancelled.set()
        return first

    def hold(self, item: MultimodalDataItem, lease: Lease) -> bool:
        """Zero-copy, on the receiver's loop: keep ``lease`` (the slot behind ``item``'s rows) until
        ``release``. False when the engine already released the job: nobody will read the rows,
        and the caller frees the lease."""
        with self._lock:
            if self._released:
                return False
            self._held.append((item, lease))
        return True

    def release(self) -> None:
        """Zero-copy mode: the engine is done with the items' ``encoded`` views; free their slots
        (and clear ``encoded``, so nothing reads a slot its next tenant writes). Idempotent."""
        with self._lock:
            held, self._held, self._released = self._held, [], True
        for item, lease in held:
            item.encoded = item.encoded_deepstack = None
            self._pool.release(lease)

    def settle_if_done(self) -> None:
        """On the receiver's loop, after an item's outcome is final: the job ends with its last
        item, not when its coroutines have unwound (that took ~80 us more here)."""
        if all(outcome.state != ItemState.PENDING for outcome in self.outcomes):
            self.ended()

    def ended(self, task: Future | None = None) -> None:
        """End the job (its future completes); a second call changes nothing. As the done-callback
        of the job's task (``task`` given), a task that crashed or was cancelled ends the job with
        that error."""
        error = None
        if task is not None:
            error = (
                RuntimeError("the receive job's task was cancelled")
                if task.cancelled()
                else task.exception()
            )
        try:
            if error is not None:
                self._future.set_exception(error)
            else:
                self._future.set_result(None)
        except InvalidStateError:  # already ended: its first end stands
            return

    def cancel(self, reason: str = "request cancelled by the engine") -> None:
        """Cancel the job's rooms now, so encode workers stop; items not yet received fail.
        A room being written stays WRITING until its writer's outcome (then CANCELLED)."""
        self._cancel(self, reason)

    def abort(self, reason: str) -> None:
        """``cancel``, and fail every item not yet settled now with ``reason`` (for a caller that
        stops waiting: a request's timeout). The job ends at once; the slots of those items are
        still released, or quarantined, when their rooms end."""
        self._abort(self, reason)


def set_encoded(item: MultimodalDataItem, rows: torch.Tensor, deepstack_width: int) -> None:
    """``item.encoded`` (and ``encoded_deepstack``: the last ``deepstack_width`` columns) from wire
    rows."""
    if deepstack_width:
        item.encoded = rows[:, : rows.shape[1] - deepstack_width]
        item.encoded_deepstack = rows[:, rows.shape[1] - deepstack_width :]
    else:
        item.encoded = rows
