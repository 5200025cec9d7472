"""The one small interface every transport implements, and the offers a receiver makes.

Receiver side: ``register(region)`` once per pool, then ``offer(pool, lease)`` per room: a JSON-able
description of where the sender may write. Sender side: ``reachable(offer)`` says whether this
process can write there; ``submit(src, offer, deadline)`` starts the write and returns a
``Transfer`` to poll. Polling never blocks; ``wait`` sleeps between polls instead of spinning, and
a ``CompletionPoller`` does the same for every write an event loop awaits, on one thread.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import importlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from epdserve.data_plane.pool import Lease, MemoryRegion, SlotPool
from epdserve.loop_threads import named_thread
from epdserve.wire.offers import Offer, transport_spec


class TransportUnavailable(RuntimeError):
    """A transport that cannot start in this process (its package, a library or its engine is
    missing); a process offered others goes on without it (``build_transports(optional=True)``)."""


class TransferRefused(ValueError):
    """The write was refused before any byte moved (too large, unreachable, bad source)."""


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Transfer(abc.ABC):
    """One write in flight.

    ``state`` is final once DONE or FAILED. ``settled`` says the transport will touch neither the
    source nor the destination again: a FAILED transfer may be unsettled (its bytes may still
    land), so its source slot stays leased and its destination slot must be quarantined.
    """

    def __init__(self, nbytes: int, deadline: float):
        self.nbytes = nbytes
        self.deadline = deadline
        self.started = time.monotonic()
        self.state = TransferState.PENDING
        self.settled = False
        self.error: str | None = None

    @abc.abstractmethod
    def poll(self) -> TransferState:
        """Advance without blocking and return the state."""

    def wait(self) -> TransferState:
        """Sleep-poll until DONE or FAILED (bounded by the deadline), never spinning: the sleep
        grows with the time already waited (50 us to 1 ms), so overshoot stays under ~6 %."""
        while self.poll() is TransferState.PENDING:
            time.sleep(self.poll_interval(time.monotonic()))
        return self.state

    def poll_quick(self) -> TransferState | None:
        """``poll`` without any call that may wait (a probe of the peer, a resubmit): None when
        only ``poll`` on a thread can take the write further."""
        return self.poll()

    def poll_interval(self, now: float) -> float:
        """How long to sleep before the next poll: 1/16 of the time waited, 50 us to 1 ms."""
        return min(1e-3, max(5e-5, (now - self.started) / 16))

    def _finish(self, state: TransferState, error: str | None = None, settled: bool = True) -> None:
        if self.state is TransferState.PENDING:
            self.state = state
            self.error = error
        self.settled = self.settled or settled


class CompletionPoller:
    """One thread that polls every write an event loop awaits, each on ``Transfer.wait``'s
    schedule, and resolves each one's future on its loop: with the final state once DONE or
    FAILED, or with None when only a thread can take the write further (``poll_quick``: the
    transport must probe its peer or resubmit, which may wait), or when the poller closed. An
    item's write then costs its loop one wake-up, not a thread of its own sleep-polling and two
    hand-offs; the thread sleeps on a condition while nothing is in flight, and never makes a call
    that may wait. A poll that raises resolves its future with the exception.
    """

    def __init__(self, name: str = "transfer-poller"):
        self._pending: list[_Awaited] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread = named_thread(self._run, name)
        self._thread.start()

    def completion(self, transfer: Transfer) -> asyncio.Future:
        """On an event loop: a future resolved with ``transfer``'s final state, or None when the
        caller must go on with ``transfer.wait()`` on a thread of its own; a poll that raised
        (now or later) is the future's exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        try:
            state = transfer.poll_quick()
        except Exception as exc:  # the awaiter's to handle, with its item, as a later poll's
            future.set_exception(exc)
            return future
        if state is not TransferState.PENDING:
            future.set_result(state)
            return future
        with self._wake:
            if self._closed:
                future.set_result(None)
                return future
            self._pending.append(_Awaited(transfer, loop, future))
            self._wake.notify()
        return future

    def close(self) -> None:
        """Stop polling: writes still awaited resolve with None (a thread of theirs goes on)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _run(self) -> None:
        try:
            while self._round():
                pass
        finally:  # closed, or this thread failed: nothing awaited is left waiting
            with self._wake:
                self._closed = True
                left, self._pending = self._pending, []
            for awaited in left:
                awaited.outcome = (_set_result, None)
            _settle_on_their_loops(left)

    def _round(self) -> bool:
        """Poll the writes that are due; False once closed."""
        with self._wake:
            while not self._pending and not self._closed:
                self._wake.wait()
            if self._closed:
                return False
            pending = list(self._pending)
        now = time.monotonic()
        ended = []
        for awaited in pending:
            if awaited.due > now:
                continue
            try:
                state = awaited.transfer.poll_quick()
            except Exception as exc:  # the awaiter's to handle, with its item
                awaited.outcome = (_set_exception, exc)
                ended.append(awaited)
                continue
            if state is TransferState.PENDING:
                awaited.due = now + awaited.transfer.poll_interval(now)
            else:
                awaited.outcome = (_set_result, state)
                ended.append(awaited)
        _settle_on_their_loops(ended)  # one wake-up per loop for every write that ended
        with self._wake:
            if ended:
                gone = set(map(id, ended))
                self._pending = [a for a in self._pending if id(a) not in gone]
            due = min((a.due for a in self._pending), default=None)
        if due is not None:
            time.sleep(max(0.0, due - time.monotonic()))
        return True


class _Awaited:
    """A write awaited on an event loop, and when the poller looks at it next."""

    def __init__(self, transfer: Transfer, loop: asyncio.AbstractEventLoop, future):
        self.transfer, self.loop, self.future = transfer, loop, future
        self.due = 0.0
        self.outcome: tuple | None = None  # (setter, value) once the write has ended


def _settle_on_their_loops(ended: list[_Awaited]) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list[_Awaited]] = {}
    for awaited in ended:
        by_loop.setdefault(awaited.loop, []).append(awaited)
    for loop, settled in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle_all, settled)
        except RuntimeError:
            if not loop.is_closed():
                raise  # a closed loop has no awaiter left; anything else is a fault


def _settle_all(settled: list[_Awaited]) -> None:
    for awaited in settled:
        setter, value = awaited.outcome
        setter(awaited.future, value)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():  # its awaiter may have been cancelled
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def as_bytes(src: torch.Tensor) -> torch.Tensor:
    """A contiguous ``src`` as flat uint8 (itself when it already is)."""
    return src if src.dtype == torch.uint8 and src.dim() == 1 else src.reshape(-1).view(torch.uint8)


def byte_array(src: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a flat numpy array: the same memory, copied first only when
    ``src`` is not contiguous. At most one torch call that drops the GIL (a copy or checksum
    through numpy takes it once): each one drops it and takes it back, and while another thread
    holds it (a tower's Python) taking it back is a thread switch (py-spy --native of the worker's
    stage thread under ``epd-bench cost``)."""
    src = src.contiguous()  # (itself, without dropping the GIL, when contiguous already)
    flat = src if src.dtype == torch.uint8 else src.view(torch.uint8)
    return flat.numpy().reshape(-1)


class CompletedTransfer(Transfer):
    """A write that finished (or failed cleanly) inside ``submit``."""

    def __init__(self, nbytes: int, deadline: float, error: str | None = None):
        super().__init__(nbytes, deadline)
        self._finish(TransferState.FAILED if error else TransferState.DONE, error)

    def poll(self) -> TransferState:
        return self.state


class Transport(abc.ABC):
    name: str
    # True when ``submit`` finishes the write itself, as one memcpy that cannot wait on a peer
    # (SHM): a small one may then run on an event loop
    copies_in_submit: bool = False

    @classmethod
    def from_config(cls, config: object | None = None) -> Transport:
        """This process's instance, from the transport's own settings object (None: its defaults);
        ``build_transports`` calls it."""
        return cls()

    @abc.abstractmethod
    def register(self, region: MemoryRegion) -> None:
        """Make a region a valid source or destination (once per region, never per tensor)."""

    def unregister(self, region: MemoryRegion) -> None:
        """Forget a region before its memory is freed (a freed, still-registered range would make
        the next allocation at that address overlap)."""

    @abc.abstractmethod
    def offer(self, pool: SlotPool, lease: Lease) -> Offer:
        """Describe a receive lease so a sender can write into it."""

    @abc.abstractmethod
    def reachable(self, offer: Offer) -> bool:
        """Whether this process can write into ``offer`` with this transport."""

    def submits_in_background(self, offer: Offer) -> bool:
        """True when ``submit`` to ``offer`` only hands the write to the transport's own threads
        and returns at once (it can run on an event loop, the write awaited through a
        ``CompletionPoller``)."""
        return False

    def submit(self, src: torch.Tensor, offer: Offer, deadline: float) -> Transfer:
        """Start writing ``src`` (contiguous bytes) to ``offer``; refuse before moving any byte."""
        if offer.kind != self.name:
            raise TransferRefused(f"{self.name} transport cannot write to a {offer.kind} offer")
        if not src.is_contiguous():
            raise TransferRefused("source tensor must be contiguous")
        nbytes = src.numel() * src.element_size()
        if nbytes == 0 or nbytes > offer.capacity:
            raise TransferRefused(
                f"{nbytes} bytes do not fit the receiver's {offer.capacity}-byte slot"
            )
        if not self.reachable(offer):
            raise TransferRefused(f"{self.name} offer is not reachable from this process")
        return self._submit(src, nbytes, offer, deadline)

    @abc.abstractmethod
    def _submit(self, src: torch.Tensor, nbytes: int, offer: Offer, deadline: float) -> Transfer:
        """``src``: contiguous, any shape and dtype, ``nbytes`` long, checked to fit ``offer``."""

    def close(self) -> None:
        """Release what the transport holds (engines, mappings)."""


def build_transports(
    names: Sequence[str], configs: Mapping[str, object] | None = None, optional: bool = False
) -> dict[str, Transport]:
    """This process's transports by name (``wire.offers.TRANSPORTS``), each built by its
    registered class from ``configs[name]`` (absent: its defaults). With ``optional``, a transport
    unavailable here (``TransportUnavailable``) leaves the others in service (logged) instead of
    failing, unless it was the only one asked for."""
    made: dict[str, Transport] = {}
    for name in names:
        module, _, class_name = transport_spec(name).implementation.partition(":")
        transport_class = getattr(importlib.import_module(module), class_name)
        try:
            made[name] = transport_class.from_config((configs or {}).get(name))
        except TransportUnavailable as exc:
            if not optional or len(names) == 1:
                raise
            logging.getLogger(__name__).warning(
                "%s unavailable, using %s only: %s",
                name.capitalize(),
                ",".join(n for n in names if n != name),
                exc,
            )
    return made
