"""In-process transport for tests: really copies bytes, with injectable faults.

Faults apply to the next submitted transfers, in order:
``delay`` (the copy lands after ``seconds``, then DONE), ``error`` (FAILED at once, nothing lands),
``late`` (FAILED at once, unsettled, but the bytes land after ``seconds``: a failed Mooncake write),
``drop`` (nothing lands; FAILED at the deadline).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Literal

import torch

from epdserve.data_plane.pool import Lease, MemoryRegion, SlotPool
from epdserve.data_plane.transport import (
    CompletedTransfer,
    Transfer,
    TransferRefused,
    TransferState,
    Transport,
    as_bytes,
)
from epdserve.wire.offers import LoopbackOffer


@dataclass(frozen=True)
class LoopbackFault:
    kind: Literal["delay", "error", "late", "drop"]
    seconds: float = 0.0


class _ScheduledTransfer(Transfer):
    def __init__(self, nbytes: int, deadline: float, fault: LoopbackFault, copy):
        super().__init__(nbytes, deadline)
        self._fault = fault
        self._landed = threading.Event()
        if fault.kind == "late":
            self._finish(TransferState.FAILED, "injected error (bytes land later)", settled=False)
        if fault.kind in ("delay", "late"):
            timer = threading.Timer(fault.seconds, self._land, args=(copy,))
            timer.daemon = True
            timer.start()

    def _land(self, copy) -> None:
        copy()
        self._landed.set()

    def poll(self) -> TransferState:
        if self._landed.is_set():
            self._finish(TransferState.DONE)
        elif self.state is TransferState.PENDING and time.monotonic() >= self.deadline:
            # a delayed copy may still land: unsettled, like a Mooncake timeout
            self._finish(
                TransferState.FAILED, "deadline exceeded", settled=self._fault.kind == "drop"
            )
        return self.state


class LoopbackTransport(Transport):
    name = "loopback"
    _ids = itertools.count(1)

    def __init__(self):
        self._regions: dict[int, MemoryRegion] = {}
        self._region_ids: dict[int, int] = {}  # id(region) -> region id
        self._faults: collections.deque[LoopbackFault] = collections.deque()
        self._lock = threading.Lock()

    def inject(self, fault: LoopbackFault, times: int = 1) -> None:
        with self._lock:
            self._faults.extend([fault] * times)

    def register(self, region: MemoryRegion) -> None:
        with self._lock:
            if id(region) not in self._region_ids:
                region_id = next(self._ids)
                self._regions[region_id] = region
                self._region_ids[id(region)] = region_id

    def unregister(self, region: MemoryRegion) -> None:
        with self._lock:
            region_id = self._region_ids.pop(id(region), None)
            self._regions.pop(region_id, None)

    def offer(self, pool: SlotPool, lease: Lease) -> LoopbackOffer:
        region_id = self._region_ids.get(id(pool.region))
        if region_id is None:
            raise TransferRefused("pool region is not registered with the loopback transport")
        return LoopbackOffer(
            kind="loopback", region=region_id, offset=lease.offset, capacity=lease.nbytes
        )

    def reachable(self, offer: LoopbackOffer) -> bool:
        return offer.region in self._regions

    def _submit(
        self, src: torch.Tensor, nbytes: int, offer: LoopbackOffer, deadline: float
    ) -> Transfer:
        region = self._regions[offer.region]
        src = as_bytes(src)
        if offer.offset + nbytes > region.nbytes:
            raise TransferRefused(
                f"write [{offer.offset}, +{nbytes}) is outside the receiver's region"
            )
        dst = region.tensor[offer.offset : offer.offset + nbytes]
        with self._lock:
            fault = self._faults.popleft() if self._faults else None
        if fault is None:
            dst.copy_(src)
            return CompletedTransfer(nbytes, deadline)
        if fault.kind == "error":
            return CompletedTransfer(nbytes, deadline, error="injected error")
        payload = src.clone()  # the sender may reuse its slot; the late copy keeps its own bytes
        return _ScheduledTransfer(nbytes, deadline, fault, lambda: dst.copy_(payload))
