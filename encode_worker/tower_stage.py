"""The tower stage, the encode worker's third: one tower call per batch, its rows split per item,
cached and handed to the items that waited for them; on a GPU only queued
(``encode_worker.device``). A GPU fault costs one batch at most."""

from __future__ import annotations

import logging
import time

import torch

from encode_worker.cache import Encoded
from encode_worker.device import out_of_memory
from encode_worker.messages import EncodedBatch, Handoff, Miss, PreparedBatch, ReadyItem
from encode_worker.stages import SHUTTING_DOWN, StageContext
from epdserve.multimodal.rows import RowContractError, split_rows

log = logging.getLogger(__name__)


class TowerStage:
    """One batch's misses through the tower in one call; rows split per item and cached. On a
    GPU the call only queues the batch (and the copies of its rows to host memory): this thread
    goes on to the next batch while the GPU runs it. A batch that runs the GPU out of memory is
    split in two and each half tried again; a batch the tower refuses otherwise is retried item
    by item, and an item that fails alone fails its room. A device that no longer runs anything
    fails its batch, and the worker's readiness, with the reason."""

    def __init__(
        self,
        context: StageContext,
        inbox: Handoff[PreparedBatch],
        out: Handoff[EncodedBatch],
    ):
        self.tower = context.tower
        self.device = context.device
        self.torch_threads = context.threads.tower
        self.encodes = context.encodes
        self.metrics = context.metrics
        self.health = context.health
        self.failer = context.failer
        self.inbox = inbox
        self.out = out
        self._stopping = context.stopping

    def loop(self) -> None:
        torch.set_num_threads(self.torch_threads)
        while not self._stopping.is_set():
            prepared = self.inbox.get()
            if prepared is None:
                continue
            encoded = self.run(prepared)
            if not self.out.put(encoded):
                self.failer.fail_all(encoded.jobs, SHUTTING_DOWN)

    def run(self, prepared: PreparedBatch) -> EncodedBatch:
        """The batch's cache hits, then its misses with their rows (those the tower encoded)."""
        self.health.busy = True
        try:
            return EncodedBatch(prepared.ready + self.encode(prepared.misses))
        except Exception:
            log.exception("batch crashed")
            reason = "encode worker error while encoding"
            for miss in prepared.misses:
                self.failer.fail_all([miss.job, *self.encodes.abandon(miss.key)], reason)
            return EncodedBatch(prepared.ready)
        finally:
            self.health.busy = False

    def encode(self, misses: list[Miss]) -> list[ReadyItem]:
        """Run the tower once over all misses; cache and return each encoded item's rows, and
        the same rows for every job that waited for that item (their rooms fail with it)."""
        ready = []
        if misses:
            for miss, encoded in zip(misses, self._encode_misses(misses)):
                if encoded is None:
                    self.failer.fail_all(
                        self.encodes.abandon(miss.key),
                        "vision tower failed on an identical item encoded for this one",
                    )
                    continue
                ready.append(ReadyItem(miss.job, encoded))
                for waiter in self.encodes.settle(miss.key, encoded):
                    # its queue: from intake until the rows it waited for were there
                    waiter.timings.update(queue_s=time.monotonic() - waiter.received_at)
                    ready.append(ReadyItem(waiter, encoded))
        return ready

    def _encode_misses(self, misses: list[Miss]) -> list[Encoded | None]:
        """Each miss's rows, or None for one whose room failed."""
        if self.health.device_failure is not None:
            return self._fail(misses, self.health.device_failure)
        started, cpu_started = time.monotonic(), time.thread_time()
        grid_thw = torch.cat([miss.inputs.grid_thw for miss in misses])
        refusal = None
        try:
            with self.device.computing():
                parts = [miss.inputs.pixel_values for miss in misses]
                self.device.adopt(parts)
                begun = self.device.started()
                rows = split_rows(
                    self.tower.encode(torch.cat(parts), grid_thw),
                    self.tower.rows_per_item(grid_thw),
                )
                rows, batch = self.device.download(
                    rows, begun, time.monotonic() - started, self._done(misses)
                )
        except (RuntimeError, ValueError, RowContractError) as exc:
            # without its traceback: the failed call's frames (its activations on the device)
            # are freed before anything is tried again
            refusal = exc.with_traceback(None)
        if refusal is not None:
            return self._refused(misses, refusal)
        self.metrics.encode_cpu_seconds.inc(time.thread_time() - cpu_started)
        self.metrics.batch_items.observe(len(misses))
        for miss in misses:
            miss.job.timings.update(queue_s=started - miss.job.received_at)
        return [Encoded(r, miss.inputs.grid, batch) for r, miss in zip(rows, misses)]

    def _done(self, misses: list[Miss]):
        """What a batch's end records: its device time, per job and in the metrics."""

        def done(seconds: float) -> None:
            for miss in misses:
                miss.job.timings.update(encode_s=seconds)
            self.metrics.encode_seconds.observe(seconds)
            self.health.last_ok = time.monotonic()

        return done

    def _refused(self, misses: list[Miss], exc: Exception) -> list[Encoded | None]:
        """A batch the tower raised on: split on out of memory, fail all on a lost device, else
        item by item."""
        if out_of_memory(exc):
            self.device.release_cached()
            if len(misses) > 1:
                half = len(misses) // 2
                self.metrics.oom_splits.inc()
                log.warning(
                    "out of device memory on a batch of %d items (%d patches): split in two",
                    len(misses),
                    sum(miss.job.patches for miss in misses),
                )
                return self._encode_misses(misses[:half]) + self._encode_misses(misses[half:])
        else:
            failure = self.device.failure()
            if failure is not None:
                self.health.device_lost(failure)
                return self._fail(misses, self.health.device_failure)
        if len(misses) == 1:
            return self._fail(misses, f"vision tower failed on this item: {exc}")
        log.warning("batch of %d failed (%s); encoding items one by one", len(misses), exc)
        return [self._encode_misses([miss])[0] for miss in misses]

    def _fail(self, misses: list[Miss], reason: str) -> list[None]:
        for miss in misses:
            self.failer.fail(miss.job.handshake, reason, miss.job.modality)
        return [None] * len(misses)
