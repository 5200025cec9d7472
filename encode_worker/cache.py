"""Embedding cache: content hash + model + preprocessing config -> wire rows (and their
``image_grid_thw``), LRU bounded in bytes.

A hit skips the tower and still ships; the cached rows include Qwen3-VL's DeepStack levels,
since they travel in the same wire rows.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import torch

from encode_worker.device import QueuedBatch


@dataclass(frozen=True)
class Encoded:
    """One item's wire rows and the ``image_grid_thw`` they came from. On a GPU the rows are
    host memory that the batch's copies are still filling: read them through ``host_rows``."""

    rows: torch.Tensor
    grid_thw: tuple[int, int, int]
    batch: QueuedBatch | None = None  # None: the rows are there

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def host_rows(self) -> torch.Tensor:
        """The rows, once their batch's copies are done (``DeviceLost`` if the device failed)."""
        if self.batch is not None:
            self.batch.wait()
        return self.rows


@dataclass(frozen=True)
class CacheKey:
    content_hash: int
    model: str  # the worker's compact model fingerprint: the rows' model, dtype and preprocessing


class EmbeddingCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: collections.OrderedDict[CacheKey, Encoded] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: CacheKey) -> Encoded | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: CacheKey, encoded: Encoded) -> None:
        if encoded.nbytes > self.capacity_bytes:
            return
        # own the bytes: rows that are a view of a batch's packed output would keep all of it;
        # a GPU batch's rows are copies of their own already (and may still be arriving)
        rows = encoded.rows
        if rows.untyped_storage().nbytes() != rows.nbytes:
            rows = rows.detach().clone()
        entry = Encoded(rows, encoded.grid_thw, encoded.batch)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._entries and self._bytes + entry.nbytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.evictions += 1
            self._entries[key] = entry
            self._bytes += entry.nbytes


class InFlightEncodes:
    """Identical items in flight, encoded once. The first miss of a key leads: it goes to the
    tower, and ``settle`` (rows cached) or ``abandon`` (the encode failed) ends it. A job of the
    same key that arrives meanwhile waits for the leader's rows instead of encoding them again;
    each waiter still has its own room, delivery and failure. One lock makes "cached, in flight,
    or lead" one step against the leader's "cache, then hand the waiters over", so no job of a
    key that is being settled becomes a second leader. Waiters are jobs already admitted by
    intake: bounded by the worker's queue."""

    def __init__(self, cache: EmbeddingCache):
        self.cache = cache
        self._waiters: dict[CacheKey, list] = {}  # key in flight -> jobs waiting for its rows
        self._lock = threading.Lock()
        self.coalesced = 0  # jobs that waited for an identical encode in flight

    def claim(self, key: CacheKey, job) -> tuple[Encoded | None, bool]:
        """``(rows, False)`` from the cache; ``(None, True)``: ``job`` leads (encode it, then
        ``settle`` or ``abandon``); ``(None, False)``: it waits for the leader's rows."""
        with self._lock:
            cached = self.cache.get(key)
            if cached is not None:
                return cached, False
            waiters = self._waiters.get(key)
            if waiters is None:
                self._waiters[key] = []
                return None, True
            waiters.append(job)
            self.coalesced += 1
            return None, False

    def settle(self, key: CacheKey, encoded: Encoded) -> list:
        """The leader's rows: cached, and the jobs that waited for them handed over."""
        with self._lock:
            self.cache.put(key, encoded)
            return self._waiters.pop(key, [])

    def abandon(self, key: CacheKey) -> list:
        """The leader's encode failed (or never ran): the jobs that waited for it, to fail."""
        with self._lock:
            return self._waiters.pop(key, [])

    def drain(self) -> list:
        """Every waiting job (at shutdown, once the stages have stopped)."""
        with self._lock:
            waiters, self._waiters = self._waiters, {}
        return [job for jobs in waiters.values() for job in jobs]
