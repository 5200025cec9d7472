"""Encode jobs and the bounded FIFO that batches them under a patch budget, a decoded-pixel
budget and an item cap.

The queue holds at most ``max_items`` jobs and ``max_bytes`` of their payloads (what intake
received: image files, raw pixels; nothing decoded waits here). A job whose patches (or pixels)
alone exceed the budget runs in a batch of its own. ``put`` never blocks: a full queue is refused
at once, so the dispatcher learns it (backpressure) instead of waiting.

How long a new job would wait (``wait_s``): the patches queued ahead of it times the pipeline's
measured seconds per patch, sampled whenever its consumer comes back for a batch and finds jobs
that waited (the pace of the slowest stage behind the queue, under the backlog this estimate is
for). A sample is *quiet* when no job was queued while it was taken: a burst's arrival (intake,
the room API, receivers registering) takes the CPU from the pipeline, and the batches of its
first seconds ran 3-8x slower than the ones after (``epd-bench overload``, 2,000 items at once:
their median refused items the burst had time for). The work queued ahead drains once the
arrivals stop, at the quiet pace. So the pace is the lower quartile of the quiet samples of the
last ``PACE_WINDOW_S`` of backlog once there are three; where arrivals filled the whole window
(sustained load: the contention lasts), the lower quartile of all its samples; else unknown (no
refusal for the wait). A pipeline slowed for good slows every sample, and the estimate follows
within the window. Intake refuses a job that would wait past its deadline.

The batching window: a batch that is not full (its item cap, or a budget the next job would
pass) waits for more jobs until ``window_s`` after its oldest job arrived, then goes as it is.
So the items of a burst share a batch, a lone item waits at most ``window_s``, and a job that
already waited in the queue behind a busy tower does not wait again.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.modality import Modality

if TYPE_CHECKING:
    from epdserve.vision.video import VideoPlan


PACE_WINDOW_S = 10.0  # the backlog's time the pace is measured over (a burst arrives in ~1-3 s)
MIN_PACE_SAMPLES = 3
MAX_PACE_SAMPLES = 1024  # bounds the window where batches are short (a GPU's: ~10 ms)


class _PaceSample(NamedTuple):
    seconds: float  # the consumer's time on the batch
    per_patch: float
    quiet: bool  # no job was queued meanwhile


def lower_quartile(samples) -> float:
    """The sample a quarter of the way up the sorted samples (the fastest of up to four)."""
    ordered = sorted(samples)
    return ordered[(len(ordered) - 1) // 4]


@dataclass
class EncodeJob:
    request_id: str
    handshake: EncodeHandshake
    content_hash: int
    source: str  # "bytes" | "pixels" | "shm"
    payload: Any  # bytes, uint8 [H, W, 3] or [T, H, W, 3] tensor, or ShmTensorHandle
    patches: int  # from the grid intake sized the item to, for batching
    modality: Modality = Modality.IMAGE
    pixels: int = 0  # the item's decoded pixels (a video's: all its sampled frames')
    nbytes: int = 0  # payload bytes this job holds in this process (an SHM handle's: none yet)
    grid_thw: tuple[int, int, int] | None = None  # what the processor must make of it (checked)
    video: VideoPlan | None = None  # a video's frames to decode
    received_at: float = field(default_factory=time.monotonic)
    timings: dict[str, float | bool] = field(
        default_factory=dict
    )  # by the stages: EncodeTimings' fields

    @property
    def room(self) -> int:
        return self.handshake.bootstrap_room


class BatchQueue:
    def __init__(
        self,
        max_items: int,
        patch_budget: int,
        batch_items: int,
        pixel_budget: int | None = None,
        max_bytes: int | None = None,
        window_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,  # times the pace
    ):
        self.max_items = max_items
        self.patch_budget = patch_budget
        self.batch_items = batch_items
        self.pixel_budget = pixel_budget
        self.max_bytes = max_bytes
        self.window_s = window_s
        self.clock = clock
        self.nbytes = 0
        self.patches = 0  # of the jobs queued
        # the batches measured, the last PACE_WINDOW_S of them
        self._pace_samples: collections.deque[_PaceSample] = collections.deque(
            maxlen=MAX_PACE_SAMPLES
        )
        self._pace_span_s = 0.0  # their seconds
        self._puts = 0  # jobs queued so far (a sample is quiet when none came meanwhile)
        # their lower quartile, made per batch measured: every job's intake reads it
        self.seconds_per_patch: float | None = None  # the pipeline's pace (None: too few yet)
        # when the last batch was taken, its patches and the puts so far, if it left jobs behind
        self._taken: tuple[float, int, int] | None = None
        self._jobs: collections.deque[EncodeJob] = collections.deque()
        self._ready = threading.Condition()
        self.closed = False

    def __len__(self) -> int:
        return len(self._jobs)

    def has_room(self, nbytes: int) -> bool:
        """Whether a job holding ``nbytes`` would be taken now. With one producer (intake) a yes
        holds until its ``put``: only the consumer runs meanwhile, and it only makes room."""
        with self._ready:
            return self._has_room(nbytes)

    def _has_room(self, nbytes: int) -> bool:
        if self.closed or len(self._jobs) >= self.max_items:
            return False
        # one job alone may hold more than max_bytes: it was already received
        return self.max_bytes is None or not self._jobs or self.nbytes + nbytes <= self.max_bytes

    def wait_s(self) -> float | None:
        """How long a job queued now would wait for the tower (None: the pace is not measured
        yet)."""
        with self._ready:
            pace = self.seconds_per_patch
            return None if pace is None else self.patches * pace

    def put(self, job: EncodeJob) -> bool:
        with self._ready:
            if not self._has_room(job.nbytes):
                return False
            self._jobs.append(job)
            self._puts += 1
            self.nbytes += job.nbytes
            self.patches += job.patches
            self._ready.notify()
            return True

    def take_batch(self, timeout: float) -> list[EncodeJob]:
        """The next FIFO batch: at least one job, then more while within the budgets and cap;
        a batch that could take more waits for them within the window."""
        with self._ready:
            if not self._jobs and not self._ready.wait_for(
                lambda: self._jobs or self.closed, timeout
            ):
                self._taken = None
                return []
            if self._taken is not None:  # the consumer was busy with the last batch until now
                taken_at, patches, puts = self._taken
                seconds = self.clock() - taken_at
                self._measured(_PaceSample(seconds, seconds / max(1, patches), puts == self._puts))
            if self.window_s and not self.closed:
                until = self._jobs[0].received_at + self.window_s
                self._ready.wait_for(
                    lambda: self.closed or self._batch_size() < len(self._jobs) or self._at_cap(),
                    max(0.0, until - time.monotonic()),
                )
            batch = [self._jobs.popleft() for _ in range(self._batch_size())]
            for job in batch:
                self.nbytes -= job.nbytes
                self.patches -= job.patches
            # the next take times this batch if the consumer is busy until then: jobs wait
            self._taken = (
                (self.clock(), sum(job.patches for job in batch), self._puts)
                if self._jobs
                else None
            )
            return batch

    def _measured(self, sample: _PaceSample) -> None:
        """One batch's sample: the window keeps the last ``PACE_WINDOW_S`` of them."""
        samples = self._pace_samples
        if len(samples) == samples.maxlen:
            self._pace_span_s -= samples[0].seconds
        samples.append(sample)
        self._pace_span_s += sample.seconds
        while self._pace_span_s - samples[0].seconds >= PACE_WINDOW_S:
            self._pace_span_s -= samples.popleft().seconds
        quiet = [s.per_patch for s in samples if s.quiet]
        if len(quiet) >= MIN_PACE_SAMPLES:
            self.seconds_per_patch = lower_quartile(quiet)
        elif self._pace_span_s >= PACE_WINDOW_S:  # arrivals all along: that is the pace
            self.seconds_per_patch = lower_quartile([s.per_patch for s in samples])
        else:
            self.seconds_per_patch = None

    def _batch_size(self) -> int:
        """How many jobs from the head make the next batch (at least one)."""
        count = patches = pixels = 0
        for job in self._jobs:
            if count == self.batch_items:
                break
            if count and (
                patches + job.patches > self.patch_budget
                or (self.pixel_budget is not None and pixels + job.pixels > self.pixel_budget)
            ):
                break
            count += 1
            patches += job.patches
            pixels += job.pixels
        return count

    def _at_cap(self) -> bool:
        return self._batch_size() == self.batch_items

    def drain(self) -> list[EncodeJob]:
        with self._ready:
            self.closed = True
            jobs = list(self._jobs)
            self._jobs.clear()
            self.nbytes = self.patches = 0
            self._ready.notify_all()
            return jobs
