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

import torch

from data_plane.offers import Offer, TransportUnavailable, transport_spec
from data_plane.pool import Lease, MemoryRegion, SlotPool


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

    def poll_interval(self, now: float) -> float:
        """How long to sleep before the next poll: 1/16 of the time waited, 50 us to 1 ms."""
        return min(1e-3, max(5e-5, (now - self.started) / 16))

    def _finish(self, state: TransferState, error: str | None = None, settled: bool = True) -> None:
        if self.state is TransferState.PENDING:
            self.state = state
            self.error = error
        self.settled = self.settled or settled


class CompletionPoller:
    """One thread that polls every write an event loop awaits, on ``Transfer.wait``'s schedule
    (the soonest poll any of them is due), and resolves each one's future on its loop when it is
    DONE or FAILED. An item's write then costs its loop one wake-up, not a thread of its own
    sleep-polling and two hand-offs; the thread sleeps on a condition while nothing is in flight.
    """

    def __init__(self, name: str = "transfer-poller"):
        self._pending: list[tuple[Transfer, asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def completion(self, transfer: Transfer) -> asyncio.Future:
        """On an event loop: a future resolved with ``transfer``'s final state."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if transfer.poll() is not TransferState.PENDING:
            future.set_result(transfer.state)
            return future
        with self._wake:
            if self._closed:
                raise RuntimeError("the completion poller is closed")
            self._pending.append((transfer, loop, future))
            self._wake.notify()
        return future

    def close(self) -> None:
        """Stop polling: writes still awaited resolve with their state at that moment."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _run(self) -> None:
        from loop_threads import name_os_thread

        name_os_thread()
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    pending, self._pending = self._pending, []
                    for transfer, loop, future in pending:
                        loop.call_soon_threadsafe(_resolve, future, transfer.state)
                    return
                pending = list(self._pending)
            now = time.monotonic()
            finished, still = [], []
            for entry in pending:
                (still if entry[0].poll() is TransferState.PENDING else finished).append(entry)
            if finished:
                ended = {id(future) for _, _, future in finished}
                with self._wake:
                    self._pending = [e for e in self._pending if id(e[2]) not in ended]
                for transfer, loop, future in finished:
                    loop.call_soon_threadsafe(_resolve, future, transfer.state)
            if still:
                time.sleep(min(transfer.poll_interval(now) for transfer, _, _ in still))


def _resolve(future: asyncio.Future, state: TransferState) -> None:
    if not future.done():  # its awaiter may have been cancelled
        future.set_result(state)


def as_bytes(src: torch.Tensor) -> torch.Tensor:
    """A contiguous ``src`` as flat uint8 (itself when it already is)."""
    return src if src.dtype == torch.uint8 and src.dim() == 1 else src.reshape(-1).view(torch.uint8)


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
    """This process's transports by name (``data_plane.offers.TRANSPORTS``), each built by its
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
