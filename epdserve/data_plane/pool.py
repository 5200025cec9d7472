"""Registered memory pools: one region per pool, allocated and touched once, sliced into slots.

The same ``SlotPool`` serves as the prefill side's receive pool and the encode worker's send ring.
A lease is a run of contiguous slots with a generation that only grows. Released leases are free
at once; failed or cancelled ones are quarantined until a deadline that outlasts any write still in
flight (a Mooncake write that returned an error can still land).
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from epdserve.data_plane.shm import SHM_DIR, ShmSegment


class NoCapacity(Exception):
    """The pool has no free run of slots for this size right now (retry later or refuse)."""


class TooLarge(ValueError):
    """The request exceeds the whole pool: no amount of waiting will fit it."""


@dataclass(frozen=True)
class Lease:
    first_slot: int
    slot_count: int
    offset: int  # bytes from the start of the region
    nbytes: int  # bytes requested (<= slot_count * slot_bytes)
    generation: int


class MemoryRegion:
    """One contiguous, pre-faulted uint8 buffer: anonymous memory, or a ``/dev/shm`` segment that
    a same-node peer can map."""

    def __init__(self, tensor: torch.Tensor, shm: ShmSegment | None = None):
        self.tensor = tensor
        self.array = tensor.numpy()  # the same bytes, for numpy's copies (``byte_array``)
        self.shm = shm
        self.address = tensor.data_ptr()
        self.nbytes = tensor.numel()
        self._shm_file = (
            _file_id(shm.name) if shm is not None else None
        )  # (device, inode) of our segment

    @classmethod
    def anonymous(cls, nbytes: int) -> MemoryRegion:
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        tensor.zero_()  # fault every page in now, not on the first transfer
        return cls(tensor)

    @classmethod
    def shared(cls, nbytes: int) -> MemoryRegion:
        segment = ShmSegment.create(nbytes, kind="pool")
        segment.tensor.zero_()
        return cls(segment.tensor, segment)

    def shm_linked(self) -> bool:
        """Whether ``/dev/shm`` still names this region's segment. Someone may unlink it (or put
        another file in its place): the memory stays valid here, but a same-node writer can no
        longer map it."""
        return (
            self.shm is not None
            and self._shm_file is not None
            and _file_id(self.shm.name) == self._shm_file
        )

    def contains(self, address: int, nbytes: int) -> bool:
        return self.address <= address and address + nbytes <= self.address + self.nbytes

    def close(self) -> None:
        """Unlink the backing segment (if any); the memory goes when the last view does."""
        if self.shm is not None:
            if self.shm.owner:
                self.shm.unlink()
            self.shm.close()
            self.shm = None


class SlotPool:
    """Leases of contiguous slots over a region, with generations and quarantine. Thread-safe."""

    def __init__(
        self,
        region: MemoryRegion,
        slot_bytes: int,
        quarantine_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        if slot_bytes <= 0 or region.nbytes < slot_bytes:
            raise ValueError(
                f"slot size {slot_bytes} must be positive and fit the {region.nbytes}-byte region"
            )
        if quarantine_s <= 0:
            raise ValueError("quarantine must be positive")
        self.region = region
        self.slot_bytes = slot_bytes
        self.slot_count = region.nbytes // slot_bytes
        self.quarantine_s = quarantine_s
        self._clock = clock
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.slot_count)]  # sorted (start, length) runs
        self._leased: dict[int, Lease] = {}  # by first slot
        self._quarantined: dict[int, tuple[Lease, float]] = {}  # by first slot: (lease, until)
        self._generation = 0

    @property
    def capacity(self) -> int:
        return self.slot_count * self.slot_bytes

    def slots_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.slot_bytes))

    def lease(self, nbytes: int) -> Lease:
        """Lease the first free run that fits ``nbytes``; ``NoCapacity`` now, ``TooLarge`` ever."""
        if nbytes <= 0:
            raise ValueError(f"lease size must be positive, got {nbytes}")
        need = self.slots_for(nbytes)
        if need > self.slot_count:
            raise TooLarge(f"{nbytes} bytes exceed the pool's {self.capacity}-byte capacity")
        with self._lock:
            self._reclaim_locked()
            for index, (start, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[index]
                    else:
                        self._free[index] = (start + need, length - need)
                    self._generation += 1
                    lease = Lease(start, need, start * self.slot_bytes, nbytes, self._generation)
                    self._leased[start] = lease
                    return lease
        raise NoCapacity(f"no free run of {need} slots ({nbytes} bytes) in the pool right now")

    def is_current(self, lease: Lease) -> bool:
        """True while ``lease`` is the live tenant of its slots (its generation is current)."""
        with self._lock:
            return self._leased.get(lease.first_slot) == lease

    def release(self, lease: Lease) -> None:
        """Free a lease whose writers are all finished. Idempotent."""
        with self._lock:
            if self._leased.get(lease.first_slot) == lease:
                del self._leased[lease.first_slot]
                self._free_locked(lease.first_slot, lease.slot_count)

    def quarantine(self, lease: Lease, seconds: float | None = None) -> None:
        """Hold a failed or cancelled lease until no late write can land. Idempotent."""
        hold = self.quarantine_s if seconds is None else seconds
        with self._lock:
            if self._leased.get(lease.first_slot) == lease:
                del self._leased[lease.first_slot]
                self._quarantined[lease.first_slot] = (lease, self._clock() + hold)

    def view(self, lease: Lease) -> torch.Tensor:
        """The lease's bytes as a uint8 tensor view of the region."""
        return self.region.tensor[lease.offset : lease.offset + lease.nbytes]

    def bytes_of(self, lease: Lease) -> np.ndarray:
        """The lease's bytes as a numpy view of the region (``data_plane.transport.byte_array``:
        no torch call)."""
        return self.region.array[lease.offset : lease.offset + lease.nbytes]

    def stats(self) -> dict[str, int]:
        """Slot counts now; quarantines that have ended are reclaimed first, so a gauge built on
        this shows held slots coming back without waiting for the next lease."""
        with self._lock:
            self._reclaim_locked()
            return {
                "slots": self.slot_count,
                "free_slots": sum(length for _, length in self._free),
                "leased_slots": sum(lease.slot_count for lease in self._leased.values()),
                "quarantined_slots": sum(
                    lease.slot_count for lease, _ in self._quarantined.values()
                ),
                "leases": len(self._leased),
                "generation": self._generation,
            }

    def _reclaim_locked(self) -> int:
        now = self._clock()
        expired = [slot for slot, (_, until) in self._quarantined.items() if until <= now]
        for slot in expired:
            lease, _ = self._quarantined.pop(slot)
            self._free_locked(lease.first_slot, lease.slot_count)
        return len(expired)

    def _free_locked(self, start: int, length: int) -> None:
        index = bisect.bisect_left(self._free, (start, 0))
        if index < len(self._free) and self._free[index][0] == start + length:  # merge with next
            length += self._free.pop(index)[1]
        if index > 0 and sum(self._free[index - 1]) == start:  # merge with previous
            prev_start, prev_length = self._free[index - 1]
            self._free[index - 1] = (prev_start, prev_length + length)
        else:
            self._free.insert(index, (start, length))


def _file_id(name: str) -> tuple[int, int] | None:
    try:
        info = os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False)
    except OSError:
        return None
    return info.st_dev, info.st_ino
