"""Embedding cache: content hash + model + preprocessing config -> wire rows, LRU bounded in bytes.

A hit skips the tower and still ships; the cached rows include Qwen3-VL's DeepStack levels,
since they travel in the same wire rows.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheKey:
    content_hash: int
    model_id: str
    preprocess_id: str


class EmbeddingCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: collections.OrderedDict[CacheKey, torch.Tensor] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def get(self, key: CacheKey) -> torch.Tensor | None:
        with self._lock:
            rows = self._entries.get(key)
            if rows is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return rows

    def put(self, key: CacheKey, rows: torch.Tensor) -> None:
        nbytes = rows.numel() * rows.element_size()
        if nbytes > self.capacity_bytes:
            return
        rows = rows.detach().clone()  # own the bytes: the batch output they came from is reused
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.numel() * old.element_size()
            while self._entries and self._bytes + nbytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.numel() * evicted.element_size()
                self.evictions += 1
            self._entries[key] = rows
            self._bytes += nbytes
