"""Consistent hashing of content hashes onto encode workers.

Each worker owns ``replicas`` points on a 64-bit ring; an item goes to the first worker at or
after its content hash, so the same image meets the same worker (and its embedding cache), and a
worker leaving or joining moves only the items on its own arcs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

import xxhash

RING_BITS = 64


class HashRing:
    def __init__(self, members: Iterable[str] = (), replicas: int = 64):
        self.replicas = replicas
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: set[str] = set()
        for member in members:
            self.add(member)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, member: str) -> bool:
        return member in self._members

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def add(self, member: str) -> None:
        if member in self._members:
            return
        self._members.add(member)
        for replica in range(self.replicas):
            point = xxhash.xxh3_64_intdigest(f"{member}#{replica}".encode())
            index = bisect.bisect_left(self._points, point)
            self._points.insert(index, point)
            self._owners.insert(index, member)

    def remove(self, member: str) -> None:
        if member not in self._members:
            return
        self._members.discard(member)
        kept = [(p, o) for p, o in zip(self._points, self._owners) if o != member]
        self._points = [p for p, _ in kept]
        self._owners = [o for _, o in kept]

    def walk(self, key: int) -> Iterator[str]:
        """Distinct members in ring order from ``key``'s position: the owner first, then the
        members to fall back to, each once."""
        if not self._points:
            return
        start = bisect.bisect_left(self._points, key % (1 << RING_BITS))
        seen: set[str] = set()
        for offset in range(len(self._points)):
            owner = self._owners[(start + offset) % len(self._points)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._members):
                    return

    def owner(self, key: int) -> str | None:
        return next(self.walk(key), None)
