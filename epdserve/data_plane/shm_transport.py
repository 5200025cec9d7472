"""Same-node transport: the sender maps the receiver's pool segment and copies into the slot.

One copy, into memory the receiver pre-faulted; the receiver then uses the slot as a tensor. Only
offered when both processes see the same ``/dev/shm`` (``namespace_id``).
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time

import torch

from epdserve.data_plane.pool import Lease, MemoryRegion, SlotPool
from epdserve.data_plane.shm import (
    POOL_PREFIX,
    SHM_DIR,
    ShmError,
    ShmSegment,
    is_pool_name,
    namespace_id,
)
from epdserve.data_plane.transport import (
    CompletedTransfer,
    Transfer,
    TransferRefused,
    Transport,
    byte_array,
)
from epdserve.wire.offers import ShmOffer

# How often a mapped receiver pool's name is checked (a stat): a write within this of its receiver
# going lands in the dead pool, which nobody reads (its room fails with the receiver).
NAME_CHECK_S = 0.1
OFFER_CACHE = 4096  # slot offers made once (a pool's slots recur; an offer is frozen)


class ShmTransport(Transport):
    name = "shm"
    copies_in_submit = True

    def __init__(self, max_attached: int = 64):
        # name -> (segment, its inode, when the name was last seen to be that inode)
        self._attached: collections.OrderedDict[str, tuple[ShmSegment, int, float]] = (
            collections.OrderedDict()
        )
        self._max_attached = max_attached
        self._lock = threading.Lock()

    def register(self, region: MemoryRegion) -> None:
        if region.shm is None:
            raise TransferRefused("the SHM transport needs a pool backed by a /dev/shm segment")

    def offer(self, pool: SlotPool, lease: Lease) -> ShmOffer:
        if pool.region.shm is None:
            raise TransferRefused("pool is not backed by /dev/shm")
        return _slot_offer(pool.region.shm.name, lease.offset, lease.nbytes)

    def reachable(self, offer: ShmOffer) -> bool:
        return offer.namespace == namespace_id()

    def _segment(self, name: str) -> ShmSegment:
        """The receiver's segment, mapped once. A mapping whose name is gone (the receiver closed
        its pool or died, and its segment was unlinked; checked at most every ``NAME_CHECK_S``) is
        dropped and the write refused: writing
        into it would reach no one and keep the dead pool's memory alive. Only a receive pool is
        ever mapped: an offer naming any other segment of ours (an intake or handoff handle) is
        refused on the name alone."""
        if not is_pool_name(name):
            raise TransferRefused(
                f"the receiver's offer names SHM segment {name}, which is not a receive pool "
                f"({POOL_PREFIX}*)"
            )
        with self._lock:
            entry = self._attached.get(name)
            if entry is not None:
                segment, inode, checked = entry
                now = time.monotonic()
                if now - checked < NAME_CHECK_S:
                    return segment
                if _inode(name) == inode:
                    self._attached[name] = (segment, inode, now)
                    self._attached.move_to_end(name)
                    return segment
                del self._attached[name]
                segment.close()
                raise TransferRefused(
                    f"the receiver's segment {name} is gone "
                    "(its pool was closed or its process ended)"
                )
        self._drop_gone()
        try:
            segment = ShmSegment.attach(name)
        except (ShmError, ValueError) as exc:
            raise TransferRefused(f"cannot map the receiver's segment: {exc}") from exc
        inode = _inode(name)
        if inode is None:  # unlinked while we mapped it
            segment.close()
            raise TransferRefused(f"the receiver's segment {name} is gone (its process ended)")
        with self._lock:
            self._attached[name] = (segment, inode, time.monotonic())
            while len(self._attached) > self._max_attached:
                self._attached.popitem(last=False)[1][0].close()
        return segment

    def _drop_gone(self) -> None:
        """Before mapping a new segment (a new receiver): unmap those whose name is gone. A dead
        receiver's pool pages stay allocated while anyone maps them, so without this a writer
        that outlived its receivers kept up to 64 dead pools alive."""
        with self._lock:
            for name in [
                name for name, (_, inode, _) in self._attached.items() if _inode(name) != inode
            ]:
                self._attached.pop(name)[0].close()

    def _submit(self, src: torch.Tensor, nbytes: int, offer: ShmOffer, deadline: float) -> Transfer:
        segment = self._segment(offer.segment)
        if offer.offset + nbytes > segment.size:
            raise TransferRefused(
                f"write [{offer.offset}, +{nbytes}) is outside segment {offer.segment}"
            )
        segment.array[offer.offset : offer.offset + nbytes] = byte_array(src)
        return CompletedTransfer(nbytes, deadline)

    def close(self) -> None:
        with self._lock:
            for segment, _, _ in self._attached.values():
                segment.close()
            self._attached.clear()


def _inode(name: str) -> int | None:
    try:
        return os.stat(os.path.join(SHM_DIR, name)).st_ino
    except OSError:
        return None


@functools.lru_cache(maxsize=OFFER_CACHE)
def _slot_offer(segment: str, offset: int, capacity: int) -> ShmOffer:
    """A slot's offer, validated once: the receiver offers the same slots over and over (its
    validation was 15 % of the receiver's loop at 8 images)."""
    return ShmOffer(
        kind="shm", namespace=namespace_id(), segment=segment, offset=offset, capacity=capacity
    )
