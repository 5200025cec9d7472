"""The one small interface every transport implements, and the offers a receiver makes.

Receiver side: ``register(region)`` once per pool, then ``offer(pool, lease)`` per room: a JSON-able
description of where the sender may write. Sender side: ``reachable(offer)`` says whether this
process can write there; ``submit(src, offer, deadline)`` starts the write and returns a
``Transfer`` to poll. Polling never blocks; ``wait`` sleeps between polls instead of spinning.
"""

from __future__ import annotations

import abc
import enum
import importlib
import logging
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
            waited = time.monotonic() - self.started
            time.sleep(min(1e-3, max(5e-5, waited / 16)))
        return self.state

    def _finish(self, state: TransferState, error: str | None = None, settled: bool = True) -> None:
        if self.state is TransferState.PENDING:
            self.state = state
            self.error = error
        self.settled = self.settled or settled


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
