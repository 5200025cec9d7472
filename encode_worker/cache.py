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


@dataclass(frozen=True)
class Encoded:
    """One item's wire rows and the ``image_grid_thw`` they came from."""

    rows: torch.Tensor
    grid_thw: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


@dataclass(frozen=True)
class CacheKey:
    content_hash: int
    model_id: str
    preprocess_id: str


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
        # own the bytes: the batch output they came from is reused
        entry = Encoded(encoded.rows.detach().clone(), encoded.grid_thw)
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
