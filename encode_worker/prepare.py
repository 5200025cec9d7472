"""Prepare, the encode worker's second stage: a batch taken from the queue, each item looked up in
the cache (or left to wait for an identical item in flight), the rest decoded (an image, or a
video's sampled frames) and preprocessed by the checkpoint's image or video processor, on the
stage's own thread or a bounded pool of them."""

from __future__ import annotations

import logging
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import numpy as np
import torch

from encode_worker.cache import CacheKey
from encode_worker.inputs import check_claimed_hash, pixels_from_shm
from encode_worker.messages import Handoff, Miss, PreparedBatch, ReadyItem, TowerInputs
from encode_worker.scheduler import EncodeJob
from encode_worker.stages import SHUTTING_DOWN, StageContext
from epdserve.loop_threads import name_os_thread, nice_this_thread
from epdserve.multimodal.hashing import hash_feature
from epdserve.vision.images import BadItem, image_from_bytes, image_from_pixels
from epdserve.vision.video import video_frames

log = logging.getLogger(__name__)
TAKE_BATCH_S = 0.2  # how long Prepare waits for a batch before looking at the stop signal


class Prepare:
    """Decode and preprocess one batch; look each item up in the cache. A bad item fails its
    room. With ``--preprocess-workers`` above one, the batch's items are decoded and preprocessed
    in parallel by that many threads (bounded: at most one batch is in their hands), each with one
    torch thread; with one, in this stage's own thread. Each item's tower inputs end on the tower's
    device (``TowerDevice.preparing``: uploads overlap the tower's work); with
    ``--preprocess-device tower``, an image's resize and normalisation run there too."""

    def __init__(self, context: StageContext, model: str, out: Handoff[PreparedBatch]):
        """``model``: the worker's compact model fingerprint, which keys its cache."""
        config = context.config
        self.queue = context.queue
        self.tower = context.tower
        self.device = context.device
        self.model = model
        self.encodes = context.encodes
        self.max_image_pixels = config.max_image_pixels
        self.failer = context.failer
        self.metrics = context.metrics
        self.out = out
        self.on_device = config.preprocess_device == "tower"
        self.torch_threads = context.threads.prepare
        self._stopping = context.stopping
        self._pool = (
            ThreadPoolExecutor(
                max_workers=config.preprocess_workers,
                thread_name_prefix="preprocess",
                initializer=_media_thread,
                initargs=("preprocess", config.media_niceness),
            )
            if config.preprocess_workers > 1
            else None
        )

    def loop(self) -> None:
        torch.set_num_threads(self.torch_threads)
        while not self._stopping.is_set():
            batch = self.queue.take_batch(TAKE_BATCH_S)
            if not batch:
                continue
            prepared = self.run(batch)
            if not self.out.put(prepared):
                self.failer.fail_all(prepared.jobs, SHUTTING_DOWN)

    def close(self) -> None:
        """Stop the preprocessing threads (once this stage's thread has stopped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def run(self, batch: list[EncodeJob]) -> PreparedBatch:
        misses, ready, leaders = [], [], []
        for job in self._still_wanted(batch):
            try:
                # SHM pixels are read first: their claimed hash is checked before it keys anything
                shm_pixels = self._shm_pixels(job) if job.source == "shm" else None
                key = CacheKey(job.content_hash, self.model)
                cached, leads = self.encodes.claim(key, job)
                if cached is not None:
                    job.timings.update(queue_s=time.monotonic() - job.received_at, cache_hit=True)
                    ready.append(ReadyItem(job, cached))
                elif leads:
                    leaders.append((job, key, self._start(job, shm_pixels)))
                # else: it waits for the identical item in flight (TowerStage hands it over)
            except BadItem as exc:
                self.failer.fail(job.handshake, str(exc), job.modality)
        for job, key, outcome in leaders:
            try:
                inputs = outcome.result() if isinstance(outcome, Future) else outcome
            except CancelledError:  # the worker stopped before a pool thread took it
                inputs = SHUTTING_DOWN
            if isinstance(inputs, TowerInputs):
                misses.append(Miss(job, key, inputs))
                continue
            self.failer.fail(job.handshake, inputs, job.modality)
            self._abandon(key, f"an identical item failed: {inputs}")
        return PreparedBatch(misses, ready)

    def _still_wanted(self, batch: list[EncodeJob]) -> list[EncodeJob]:
        """The batch without the items whose room (in this worker's table) ended while they
        queued: a client that left, an engine that refused the request; they are neither decoded
        nor encoded. An item whose room lives elsewhere is kept (no call per item to learn it)."""
        local = [job for job in batch if self.failer.rooms(job.handshake).in_process]
        if not local:
            return batch
        ended = self.failer.rooms(local[0].handshake).table.ended([job.room for job in local])
        if not ended:
            return batch
        for job in batch:
            if job.room in ended:
                if job.source == "shm":  # the intake segment is this worker's to unlink
                    job.payload.release()
                self.failer.in_flight.release(job.room)
                self.metrics.count(job.modality, ended[job.room])
        return [job for job in batch if job.room not in ended]

    def _start(self, job: EncodeJob, shm_pixels: torch.Tensor | None) -> TowerInputs | str | Future:
        """The item's preparation: done here, or handed to a pool thread."""
        if self._pool is None:
            return self._prepared(job, shm_pixels)
        try:
            return self._pool.submit(self._prepared, job, shm_pixels)
        except RuntimeError:  # the pool is shut down: the worker is stopping
            return SHUTTING_DOWN

    def _prepared(self, job: EncodeJob, shm_pixels: torch.Tensor | None) -> TowerInputs | str:
        """The item's tower inputs, or why it has none (its room fails with that reason): never
        raises, so one item's failure, expected or not, stays its own."""
        cpu_started = time.thread_time()
        try:
            with self.device.preparing():
                return self._tower_inputs(job, shm_pixels)
        except BadItem as exc:
            return str(exc)
        except Exception as exc:
            log.exception("preprocessing room %d failed", job.room)
            return f"encode worker error while preprocessing: {type(exc).__name__}: {exc}"
        finally:
            self.metrics.preprocess_cpu_seconds.inc(time.thread_time() - cpu_started)

    def _abandon(self, key: CacheKey, reason: str) -> None:
        for waiter in self.encodes.abandon(key):
            self.failer.fail(waiter.handshake, reason, waiter.modality)

    def _shm_pixels(self, job: EncodeJob) -> torch.Tensor:
        pixels = pixels_from_shm(job.payload)
        check_claimed_hash(job.content_hash, hash_feature(memoryview(pixels.numpy()).cast("B")))
        return pixels

    def _tower_inputs(self, job: EncodeJob, shm_pixels: torch.Tensor | None) -> TowerInputs:
        """Decode and preprocess the item; ``BadItem`` when it cannot be, or when the processor
        sizes it otherwise than intake did (its rows would not be the ones placed for it)."""
        device = self.device
        if job.video is not None:
            frames = video_frames(job.payload, job.video)
            out = self.tower.video_processor(
                videos=[frames], do_sample_frames=False, return_tensors="pt"
            )
            pixel_values, grid_thw = out["pixel_values_videos"], out["video_grid_thw"]
        else:
            if job.source == "bytes":
                image = image_from_bytes(job.payload, self.max_image_pixels)
            else:
                pixels = shm_pixels if shm_pixels is not None else job.payload
                image = image_from_pixels(pixels, self.max_image_pixels)
            if self.on_device:  # the uint8 pixels go up (a quarter of the float patches' bytes)
                pixels = device.upload(torch.from_numpy(np.array(image)).permute(2, 0, 1))
                out = self.tower.preprocess([pixels], device=device.device)
            else:
                out = self.tower.preprocess([image])
            pixel_values, grid_thw = out["pixel_values"], out["image_grid_thw"]
        inputs = TowerInputs(device.upload(pixel_values), grid_thw.cpu())
        if job.grid_thw is not None and inputs.grid != job.grid_thw:
            raise BadItem(
                f"the processor made grid {list(inputs.grid)} of this item, intake sized it "
                f"{list(job.grid_thw)}"
            )
        return inputs


def _media_thread(name: str, niceness: int) -> None:
    """A pool thread of the media stages: named, niced as they are, one torch thread."""
    name_os_thread(name)
    nice_this_thread(niceness)
    torch.set_num_threads(1)
