"""The encode worker's health and housekeeping: the tower probe, readiness, and a loop that reaps
settled transfers, trims the heap and probes an idle tower."""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable

from PIL import Image

from encode_worker.sender import Sender
from epdserve.vision.tower import VisionTower

log = logging.getLogger(__name__)
TRIM_INTERVAL_S = 10.0
HOUSEKEEPING_INTERVAL_S = 0.5


def trim_heap() -> None:
    """Hand the heap's free memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).
    Images, pixel tensors and rows of every size are freed into glibc's per-thread arenas, which
    keep them, so without a periodic trim a worker's resident memory only grows; a trim takes
    milliseconds, against ``TRIM_INTERVAL_S`` between trims."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class Health:
    """Whether the tower works. Ready: its device has not failed, the last probe passed, and the
    tower is encoding or encoded something (a batch or a probe) within three probe intervals.

    Fields: ``busy`` is written by TowerStage only (a batch is in the tower); ``last_ok`` where a
    batch ends (TowerStage on the CPU, StageAndSend on a GPU) and by ``probe``; ``healthy`` by
    ``probe`` only; ``device_failure`` once, by whoever finds the device failed (it never
    clears: a lost GPU needs a new process). Readers take them unlocked: each is one assignment,
    and readiness tolerates a value one batch old."""

    def __init__(
        self,
        tower: VisionTower,
        sender: Sender,
        probe_interval_s: float,
        stopping: threading.Event,
        stages_idle: Callable[[], bool],
    ):
        self.tower = tower
        self.sender = sender
        self.probe_interval_s = probe_interval_s
        self._stopping = stopping
        self._stages_idle = stages_idle  # nothing queued for the tower
        self.busy = False
        self.healthy = False
        self.last_ok = 0.0
        self.device_failure: str | None = None

    def not_ready(self) -> str | None:
        """Why the worker should get no items now, or None when it is ready."""
        if self.device_failure is not None:
            return self.device_failure
        if not self.healthy:
            return "the vision tower's health probe fails"
        if not self.busy and time.monotonic() - self.last_ok >= 3 * self.probe_interval_s:
            return f"the vision tower encoded nothing for {3 * self.probe_interval_s:g} s"
        return None

    def device_lost(self, reason: str) -> None:
        """The tower's device no longer runs work: every item fails with ``reason`` from now on,
        intake refuses, and readiness fails (a new process is needed)."""
        if self.device_failure is None:
            self.device_failure = f"the encode worker's device failed: {reason}"
            log.error("%s; failing items and readiness until restarted", self.device_failure)

    def probe(self) -> None:
        """A tiny dummy encode, waited for; runs only when the tower is idle (or before the
        stages start)."""
        try:
            pixels = self.tower.preprocess([Image.new("RGB", (56, 56))])
            self.tower.encode(pixels["pixel_values"], pixels["image_grid_thw"]).cpu()
            self.healthy, self.last_ok = True, time.monotonic()
        except Exception:
            log.exception("tower health probe failed")
            self.healthy = False

    def loop(self) -> None:
        """Housekeeping until the worker stops: reap settled transfers, trim the heap every
        ``TRIM_INTERVAL_S``, probe the tower when it has been idle for a probe interval."""
        last_trim = time.monotonic()
        while not self._stopping.wait(HOUSEKEEPING_INTERVAL_S):
            self.sender.reap()
            if time.monotonic() - last_trim >= TRIM_INTERVAL_S:
                trim_heap()
                last_trim = time.monotonic()
            idle = not self.busy and self._stages_idle()
            if idle and time.monotonic() - self.last_ok > self.probe_interval_s:
                self.probe()
