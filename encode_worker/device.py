"""The tower's device as the encode worker's stages use it: which stream each thread queues on,
copies that do not wait for the GPU, and what a device error means. On the CPU every step is a
plain call or nothing, so the stages read the same either way.

On CUDA:

* the tower thread queues each batch on a compute stream of its own and never waits for it
  (``TowerDevice.computing``);
* each preprocessing thread queues its uploads (and, with ``--preprocess-device tower``, its
  resize and normalisation) on a stream of its own, and waits for that stream alone
  (``TowerDevice.preparing``), so uploads overlap the tower's work;
* a batch's rows are copied to pinned host memory on a copy stream, after the batch, one host
  tensor per item; events mark the batch's start, the end of its tower call (its GPU time:
  ``epd_encoder_encode_seconds``) and the end of its copies (``TowerDevice.download``). The
  thread that stages the rows waits for that last event (``QueuedBatch.wait``), once per batch;
  the tower thread is already queuing the next batch meanwhile.

Memory that a stream other than its allocator's reads is marked with ``record_stream``, so the
caching allocator does not hand it out again before that stream has passed the read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch


class DeviceLost(RuntimeError):
    """The tower's device no longer runs work (a sticky CUDA error): the worker is not ready, and
    no batch is tried on it again."""


def out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError)


class QueuedBatch:
    """A batch's tower call and row copies, queued: ``wait`` returns once the rows are in host
    memory, with the seconds the device spent running the tower on the batch (on CUDA, from the
    batch's start to the end of its tower call on the compute stream: the GPU's busy time, the
    copies after it overlapping the next batch). ``on_done`` runs once: on the CPU, where the
    batch is done when it is made, at once; on CUDA in the first waiter's thread."""

    def __init__(
        self,
        seconds: float | None = None,
        events: tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event] | None = None,
        on_done: Callable[[float], None] = lambda seconds: None,
    ):
        self._seconds = seconds
        self._events = events
        self._on_done = on_done
        self._lock = threading.Lock()
        self._done = events is None
        if self._done:
            on_done(seconds)
            self._on_done = None  # it holds the batch's jobs: let them go with it

    def wait(self) -> float:
        """Block (asleep: the event is a blocking one) until the batch's rows are in host memory;
        the device seconds it took. ``DeviceLost`` when the device failed meanwhile."""
        with self._lock:
            if not self._done:
                if self._events is not None:
                    started, computed, copied = self._events
                    try:
                        copied.synchronize()
                    except RuntimeError as exc:
                        raise DeviceLost(f"GPU failed while encoding: {exc}") from exc
                    self._seconds = started.elapsed_time(computed) / 1000
                self._done = True
                self._on_done(self._seconds)
                self._on_done = self._events = None  # they hold the batch: let it go
            return self._seconds


class TowerDevice:
    """Streams, pinned memory and device checks for one tower device (``cpu``, ``cuda[:N]``)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._compute = torch.cuda.Stream(self.device)
            self._copy = torch.cuda.Stream(self.device)
        self._local = threading.local()  # a preprocessing thread's own stream

    # ---- the tower thread -------------------------------------------------------------------

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Queue the block's device work on the compute stream (the tower thread's)."""
        if not self.is_cuda:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._compute):
            yield

    def started(self) -> torch.cuda.Event | None:
        """An event at the start of a batch on the compute stream (None on the CPU)."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._compute)
        return event

    def adopt(self, tensors: list[torch.Tensor]) -> None:
        """Tensors a preprocessing thread made on its stream, read next on the compute stream."""
        if self.is_cuda:
            for tensor in tensors:
                if tensor.is_cuda:
                    tensor.record_stream(self._compute)

    def download(
        self,
        items: list[torch.Tensor],
        started: torch.cuda.Event | None,
        seconds: float,
        on_done: Callable[[float], None],
    ) -> tuple[list[torch.Tensor], QueuedBatch]:
        """Each item's rows in host memory, and the batch they belong to. On CUDA the copies are
        queued on the copy stream after the compute stream's work, into pinned tensors that are
        valid once the batch's ``wait`` returned; the tower's output stays allocated until the
        copies have read it. On the CPU the rows are already there (``seconds``: the tower's)."""
        if not self.is_cuda:
            return items, QueuedBatch(seconds, on_done=on_done)
        computed = torch.cuda.Event(enable_timing=True)  # the tower's end on the compute stream
        computed.record(self._compute)
        self._copy.wait_stream(self._compute)
        hosts = []
        with torch.cuda.stream(self._copy):
            for rows in items:
                host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                host.copy_(rows, non_blocking=True)
                rows.record_stream(self._copy)
                hosts.append(host)
        finished = torch.cuda.Event(enable_timing=True, blocking=True)  # waited for asleep
        finished.record(self._copy)
        return hosts, QueuedBatch(events=(started, computed, finished), on_done=on_done)

    def release_cached(self) -> None:
        """Hand the allocator's cached blocks back (after an out-of-memory error)."""
        if self.is_cuda:
            torch.cuda.empty_cache()

    def failure(self) -> str | None:
        """Why the device no longer runs work (after an error that was not out of memory), or
        None when it does: a sticky CUDA error fails every later call, a one-off one does not."""
        if not self.is_cuda:
            return None
        try:
            with torch.cuda.device(self.device):
                torch.cuda.synchronize()
                probe = torch.ones(1, device=self.device)
                if float(probe.add_(1).item()) != 2.0:
                    return "GPU computed 1 + 1 wrong"
        except RuntimeError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    # ---- preprocessing threads ---------------------------------------------------------------

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """Queue the block's device work (uploads, preprocessing) on this thread's own stream,
        and wait for that stream alone at its end."""
        if not self.is_cuda:
            yield
            return
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield
        done = torch.cuda.Event(blocking=True)  # waited for asleep, not spinning on a core
        done.record(stream)
        done.synchronize()

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the device (inside ``preparing``)."""
        return tensor.to(self.device, non_blocking=True) if self.is_cuda else tensor
