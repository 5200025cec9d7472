"""Same-node transport: the sender maps the receiver's pool segment and copies into the slot.

One copy, into memory the receiver pre-faulted; the receiver then uses the slot as a tensor. Only
offered when both processes see the same ``/dev/shm`` (``namespace_id``).
"""

from __future__ import annotations

import collections
import threading

import torch

from data_plane.offers import ShmOffer
from data_plane.pool import Lease, MemoryRegion, SlotPool
from data_plane.shm import ShmError, ShmSegment, namespace_id
from data_plane.transport import CompletedTransfer, Transfer, TransferRefused, Transport


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, max_attached: int = 64):
        self._attached: collections.OrderedDict[str, ShmSegment] = collections.OrderedDict()
        self._max_attached = max_attached
        self._lock = threading.Lock()

    def register(self, region: MemoryRegion) -> None:
        if region.shm is None:
            raise TransferRefused("the SHM transport needs a pool backed by a /dev/shm segment")

    def offer(self, pool: SlotPool, lease: Lease) -> ShmOffer:
        if pool.region.shm is None:
            raise TransferRefused("pool is not backed by /dev/shm")
        return ShmOffer(kind="shm", namespace=namespace_id(), segment=pool.region.shm.name, offset=lease.offset,
                        capacity=lease.nbytes)

    def reachable(self, offer: ShmOffer) -> bool:
        return offer.namespace == namespace_id()

    def _segment(self, name: str) -> ShmSegment:
        with self._lock:
            segment = self._attached.get(name)
            if segment is not None:
                self._attached.move_to_end(name)
                return segment
        try:
            segment = ShmSegment.attach(name)
        except (ShmError, ValueError) as exc:
            raise TransferRefused(f"cannot map the receiver's segment: {exc}") from exc
        with self._lock:
            self._attached[name] = segment
            while len(self._attached) > self._max_attached:
                self._attached.popitem(last=False)[1].close()
        return segment

    def _submit(self, src: torch.Tensor, offer: ShmOffer, deadline: float) -> Transfer:
        segment = self._segment(offer.segment)
        nbytes = src.numel()
        if offer.offset + nbytes > segment.size:
            raise TransferRefused(f"write [{offer.offset}, +{nbytes}) is outside segment {offer.segment}")
        segment.tensor[offer.offset : offer.offset + nbytes].copy_(src)
        return CompletedTransfer(nbytes, deadline)

    def close(self) -> None:
        with self._lock:
            for segment in self._attached.values():
                segment.close()
            self._attached.clear()
