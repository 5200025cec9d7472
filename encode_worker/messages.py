"""The messages between the encode worker's stages, and the bounded hand-off that carries them.

Intake -> ``BatchQueue`` (``EncodeJob``) -> Prepare -> ``Handoff[PreparedBatch]`` -> TowerStage ->
``Handoff[EncodedBatch]`` -> StageAndSend -> ``Sender`` (``StagedItem``).

Ownership: a job belongs to the one stage that holds the message it is in; handing the message on
hands the job on, so no field is guarded by a lock. Who writes what:

* ``EncodeJob``: every field is set by Intake and only read afterwards, except
  ``timings``: Prepare writes ``queue_s`` and ``cache_hit`` for a cache hit, TowerStage writes
  ``queue_s`` and ``encode_s`` for a miss and ``queue_s`` for a job that waited for an identical
  miss; StageAndSend reads it and hands a copy to the sender.
  ``payload`` is read by Prepare only (decoded there).
* ``Miss.inputs`` (the image or video processor's output) is made by Prepare and read by TowerStage.
* ``Encoded`` (rows and grid) is made by TowerStage, or comes from the cache; it is never mutated,
  so the cache and the send path share it.
* A message's lists are built by the stage that sends it and not touched after the hand-off.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from encode_worker.cache import CacheKey, Encoded
from encode_worker.scheduler import EncodeJob

T = TypeVar("T")
HANDOFF_POLL_S = 0.2  # how often a blocked hand-off looks at the stop signal


@dataclass(frozen=True)
class TowerInputs:
    """One item as the tower takes it: the processor's patches and its ``[1, 3]`` grid (an image's
    ``image_grid_thw`` or a video's ``video_grid_thw``: the tower reads both alike)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor

    @property
    def grid(self) -> tuple[int, int, int]:
        return tuple(self.grid_thw[0].tolist())


@dataclass(frozen=True)
class Miss:
    """A job the cache did not have: its cache key and its preprocessed tower inputs."""

    job: EncodeJob
    key: CacheKey
    inputs: TowerInputs


@dataclass(frozen=True)
class ReadyItem:
    """A job with its rows: from the tower, or a cache hit."""

    job: EncodeJob
    encoded: Encoded


@dataclass(frozen=True)
class PreparedBatch:
    """One batch taken from the queue, decoded: ``misses`` go to the tower, ``ready`` are cache
    hits. A job whose room Prepare failed (a bad item) is in neither: it is over."""

    misses: list[Miss]
    ready: list[ReadyItem]

    @property
    def jobs(self) -> list[EncodeJob]:
        """The jobs still to deliver (at shutdown: the rooms to fail)."""
        return [miss.job for miss in self.misses] + [item.job for item in self.ready]


@dataclass(frozen=True)
class EncodedBatch:
    """One batch's items with rows, in the order they are staged."""

    ready: list[ReadyItem]

    @property
    def jobs(self) -> list[EncodeJob]:
        return [item.job for item in self.ready]


class Handoff(Generic[T]):
    """A bounded queue of one message between two stage threads: a full hand-off blocks the
    sender (backpressure) until the receiver takes the message or the worker stops."""

    def __init__(self, stopping: threading.Event, size: int = 1):
        self._queue: queue.Queue[T] = queue.Queue(maxsize=size)
        self._stopping = stopping

    def put(self, message: T) -> bool:
        """Hand the message on; False when the worker stopped first (the message stays the
        caller's)."""
        while not self._stopping.is_set():
            try:
                self._queue.put(message, timeout=HANDOFF_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> T | None:
        """The next message, or None after ``HANDOFF_POLL_S`` without one."""
        try:
            return self._queue.get(timeout=HANDOFF_POLL_S)
        except queue.Empty:
            return None

    def empty(self) -> bool:
        return self._queue.empty()

    def drain(self) -> list[T]:
        """The messages left (at shutdown, once the stage threads have stopped)."""
        messages = []
        while not self._queue.empty():
            messages.append(self._queue.get_nowait())
        return messages
