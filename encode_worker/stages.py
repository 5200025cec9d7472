"""The encode worker's stages, one job and one thread each, joined by bounded queues
(``encode_worker.messages`` says what travels and who writes which field):

* ``Intake``: the ZMQ ROUTER loop; validates each message into an ``EncodeJob`` from what it can
  see without decoding, queues it, and answers at once with an ``IntakeReply``.
* ``Prepare``: takes a batch from the ``BatchQueue``; cache hits skip the tower, and so does an
  item identical to one in flight (``InFlightEncodes``: it waits for that item's rows); the rest
  are decoded (an image, or a video's sampled frames) and preprocessed by the checkpoint's image
  or video processor. Images and videos share batches and tower calls.
* ``TowerStage``: one tower call per batch, rows split per item, cached and handed to the items
  that waited for them; a batch that fails is retried item by item, so a bad item fails only its
  room (and those of the items waiting for it).
* ``StageAndSend``: copies each item's rows into the send ring and hands it to the ``Sender``.

Decoding the next batch and staging the last one overlap the tower. A full send ring blocks
StageAndSend, which fills the hand-offs behind it, which stops Prepare pulling from the queue,
which makes intake refuse ("queue full"): backpressure, all the way to the dispatcher.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch
import zmq
from PIL import Image

from data_plane.commit import EmbeddingLayout, checksum
from data_plane.pool import NoCapacity, SlotPool, TooLarge
from data_plane.shm import ShmTensorHandle
from encode_worker.cache import CacheKey, Encoded, InFlightEncodes
from encode_worker.device import DeviceLost, TowerDevice, out_of_memory
from encode_worker.inputs import pixels_from_shm
from encode_worker.messages import (
    EncodedBatch,
    Handoff,
    Miss,
    PreparedBatch,
    ReadyItem,
    TowerInputs,
)
from encode_worker.room_clients import InFlightRooms, RateLimitedLog, RoomFailer
from encode_worker.scheduler import BatchQueue, EncodeJob
from encode_worker.sender import Sender, StagedItem, stage
from handshake.rooms import RoomConflict, RoomError, RoomsFull
from loop_threads import name_os_thread, nice_this_thread
from multimodal.hashing import hash_feature
from multimodal.rows import RowContractError, split_rows
from process_settings import SettingError
from vision.images import BadItem, image_from_bytes, image_from_pixels
from vision.limits import IMAGE_FORMATS, MAX_SIDE
from vision.sizing import VideoLimits, plan_video_file, plan_video_frames
from vision.tower import VisionTower
from vision.video import video_frames
from wire.addresses import endpoint_url
from wire.intake import (
    QUEUE_FULL_RETRY_S,
    IntakeRefused,
    IntakeReply,
    IntakeRequest,
    IntakeStatus,
    parse_request,
)
from wire.modality import Modality

if TYPE_CHECKING:
    from encode_worker.config import WorkerConfig
    from encode_worker.health import Health
    from encode_worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)
INTAKE_POLL_MS = 100  # how often the intake loop looks at the stop signal
TAKE_BATCH_S = 0.2  # how long Prepare waits for a batch before looking at the stop signal
SHUTTING_DOWN = "encode worker shutting down"


class Intake:
    """The intake socket and its loop. Never waits on the network or the tower: each message is
    refused (room untouched), failed (a bad item: its room fails) or queued, and answered at
    once."""

    def __init__(
        self,
        config: WorkerConfig,
        served_model: str,
        tower: VisionTower,
        queue: BatchQueue,
        in_flight: InFlightRooms,
        failer: RoomFailer,
        health: Health,
        metrics: WorkerMetrics,
        item_log: RateLimitedLog,
        stopping: threading.Event,
    ):
        self.config = config
        self.served_model = served_model
        self.tower = tower
        self.queue = queue
        self.in_flight = in_flight
        self.failer = failer
        self.health = health
        self.metrics = metrics
        self.item_log = item_log
        self.video_limits = VideoLimits(
            config.max_image_pixels,
            config.max_video_seconds,
            config.max_video_frames,
            config.max_video_pixels,
        )
        self._stopping = stopping
        self._socket: zmq.Socket | None = None
        self.port: int | None = None

    def listen(self) -> None:
        """Bind the intake port (``SettingError``, one line, when it cannot be)."""
        config = self.config
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, config.max_payload_bytes + (1 << 20))
        self._socket.setsockopt(zmq.IPV6, 1)  # --bind may be an IPv6 address
        try:
            if config.intake_port:
                self._socket.bind(endpoint_url("tcp", config.bind, config.intake_port))
                self.port = config.intake_port
            else:
                self.port = self._socket.bind_to_random_port(endpoint_url("tcp", config.bind))
        except zmq.ZMQError as exc:
            raise SettingError(
                f"intake port: cannot listen on {config.bind}:{config.intake_port}: {exc.strerror}"
            ) from None

    def loop(self) -> None:
        """Answer messages until the worker stops; then close the socket (the loop's own)."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(INTAKE_POLL_MS):
                continue
            frames = self._socket.recv_multipart(copy=True)
            identity, body = frames[0], frames[1:]
            self._socket.send_multipart([identity, self.accept(body).frame()])
        self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)

    def accept(self, frames: list[bytes]) -> IntakeReply:
        try:
            request, payload = parse_request(
                frames, self.config.max_payload_bytes, self.config.intake_token, self.served_model
            )
        except IntakeRefused as exc:
            self.metrics.count(Modality.IMAGE, IntakeStatus.REFUSED)
            self.item_log.warning("intake refused an item (room %s): %s", exc.room, exc)
            return IntakeReply(status=IntakeStatus.REFUSED, room=exc.room, reason=str(exc))
        room = request.encode_handshake.bootstrap_room
        if self.health.device_failure is not None:  # another worker can encode it
            return self._refuse(request, self.health.device_failure)
        if not self.queue.has_room(len(payload) if payload is not None else 0):
            # before the header, the hash and the room: a busy worker refuses cheaply
            return self._refuse(request, "queue full", retry_after_s=QUEUE_FULL_RETRY_S)
        if not self.in_flight.claim(room):
            return self._refuse(
                request, f"room {room} already has an item in flight here", log_it=True
            )
        if request.open_room_ttl_s is not None:
            refusal = self._open_room(request)
            if refusal is not None:
                self.in_flight.release(room)
                return refusal
        try:
            job = self.job(request, payload)
        except BadItem as exc:
            self.failer.fail(request.encode_handshake, str(exc), request.modality, counted=False)
            self.metrics.count(request.modality, IntakeStatus.FAILED)
            return IntakeReply(status=IntakeStatus.FAILED, room=room, reason=str(exc))
        if not self.queue.put(job):  # room was checked above: the queue closed meanwhile
            self.in_flight.release(room)
            if request.open_room_ttl_s is not None:
                self._close_opened_room(room)
            return self._refuse(request, SHUTTING_DOWN)
        self.metrics.count(request.modality, IntakeStatus.ACCEPTED)
        return IntakeReply(status=IntakeStatus.ACCEPTED, room=room)

    def _refuse(
        self,
        request: IntakeRequest,
        reason: str,
        retry_after_s: float | None = None,
        log_it: bool = False,
    ) -> IntakeReply:
        room = request.encode_handshake.bootstrap_room
        self.metrics.count(request.modality, IntakeStatus.REFUSED)
        if log_it:
            self.item_log.warning("intake refused room %d: %s", room, reason)
        return IntakeReply(
            status=IntakeStatus.REFUSED, room=room, reason=reason, retry_after_s=retry_after_s
        )

    def _open_room(self, request: IntakeRequest) -> IntakeReply | None:
        """Open the room the sender named in this worker's table; the refusal, if it cannot be."""
        handshake = request.encode_handshake
        # The port must be this worker's bootstrap port; the host is the sender's name for this
        # worker, which it reached the intake by (a worker does not know every DNS name it has).
        if handshake.endpoint.port != self.failer.rooms.bootstrap_port:
            return self._refuse(
                request,
                f"open_room_ttl_s names a room at {handshake.endpoint}, not at this worker's "
                f"bootstrap port {self.failer.rooms.bootstrap_port}",
                log_it=True,
            )
        try:
            self.failer.rooms.table.open(handshake.bootstrap_room, request.open_room_ttl_s)
        except RoomsFull as exc:
            return self._refuse(request, f"room table full: {exc}", QUEUE_FULL_RETRY_S)
        except RoomError as exc:  # the id is in use here, or the TTL is over this table's maximum
            return self._refuse(request, f"cannot open the room: {exc}", log_it=True)
        return None

    def _close_opened_room(self, room: int) -> None:
        """The room intake opened for an item it then refused: gone without a trace, or (touched
        meanwhile by someone who guessed the id) cancelled."""
        table = self.failer.rooms.table
        try:
            table.discard(room)
        except RoomConflict:
            try:
                table.cancel(room, f"encode worker refused the item: {SHUTTING_DOWN}")
            except RoomError as exc:
                log.info("room %d not cancelled: %s", room, exc)

    def job(self, request: IntakeRequest, payload: bytes | None) -> EncodeJob:
        """The item as a job, from what intake can see without decoding (the image's header, the
        video's container header, the shape, the SHM name); ``BadItem`` for an item that must not
        go further."""
        if request.modality is Modality.VIDEO:
            source_payload, grid, pixels, video = self._video(request, payload)
        else:
            source_payload, grid, pixels = self._image(request, payload)
            video = None
        if request.grid_thw is not None and tuple(request.grid_thw) != grid:
            raise BadItem(
                f"the sender sized this item to grid {list(request.grid_thw)}, this worker's "
                f"processor config to {list(grid)}: the two disagree (same checkpoint and "
                "processor settings on both sides?)"
            )
        # The cache key is the hash of the bytes this worker encodes, never the client's word for
        # it: a wrong claimed hash would poison the cache entry of the image it names.
        if request.source == "shm":
            if request.content_hash is None:
                raise BadItem("SHM-backed items must carry a content hash")
            content_hash = request.content_hash  # checked against the pixels once read (Prepare)
        else:
            content_hash = hash_feature(payload)
            check_claimed_hash(request.content_hash, content_hash)
        return EncodeJob(
            request.request_id,
            request.encode_handshake,
            content_hash,
            request.source,
            source_payload,
            grid[0] * grid[1] * grid[2],
            request.modality,
            pixels=pixels,
            nbytes=len(payload) if payload is not None else 0,
            grid_thw=grid,
            video=video,
        )

    def _image(self, request: IntakeRequest, payload: bytes | None):
        """An image's payload as Prepare reads it, its grid and its pixels."""
        if request.source == "bytes":
            try:
                with Image.open(io.BytesIO(payload)) as probe:
                    width, height = probe.size
                    image_format = probe.format
            except Exception as exc:
                raise BadItem(f"cannot read image header: {type(exc).__name__}") from None
            if image_format not in IMAGE_FORMATS:
                raise BadItem(
                    f"image format {image_format!r} is not accepted ({sorted(IMAGE_FORMATS)})"
                )
        else:
            height, width = (request.shape if request.source == "pixels" else request.shm.shape)[:2]
        if width > MAX_SIDE or height > MAX_SIDE or width * height > self.config.max_image_pixels:
            raise BadItem(
                f"image of {width}x{height} pixels is larger than this worker decodes "
                f"({self.config.max_image_pixels} pixels, {MAX_SIDE} a side)"
            )
        if request.source == "bytes":
            source_payload = payload
        elif request.source == "pixels":
            source_payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(
                height, width, 3
            )
        else:
            try:  # the name alone decides: a segment that is not an intake handle is never opened
                source_payload = ShmTensorHandle.for_intake(
                    request.shm.shm_name, tuple(request.shm.shape), torch.uint8
                )
            except ValueError as exc:
                raise BadItem(str(exc)) from None
        try:
            grid = self.tower.sizing.image_grid(self.tower.processor, height, width)
        except ValueError as exc:
            raise BadItem(
                f"image of {width}x{height} cannot be resized for the tower: {exc}"
            ) from None
        return source_payload, grid, width * height

    def _video(self, request: IntakeRequest, payload: bytes):
        """A video's payload as Prepare reads it, its grid, its decoded pixels and its plan."""
        processor = self.tower.video_processor
        if processor is None:
            raise BadItem("this worker's checkpoint has no video processor: videos are refused")
        if request.source == "bytes":
            plan = plan_video_file(payload, processor, self.video_limits)
            source_payload = payload
        else:
            plan = plan_video_frames(request.shape, processor, self.video_limits)
            source_payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(
                *request.shape
            )
        return source_payload, plan.grid_thw, plan.pixels, plan


class Prepare:
    """Decode and preprocess one batch; look each item up in the cache. A bad item fails its
    room. With ``workers`` above one, the batch's items are decoded and preprocessed in parallel
    by that many threads (bounded: at most one batch is in their hands), each with one torch
    thread; with one, in this stage's own thread, with ``torch_threads``.
    Each item's tower inputs end on the tower's device (``TowerDevice.preparing``: uploads overlap
    the tower's work); with ``on_device``, an image's resize and normalisation run there too."""

    def __init__(
        self,
        queue: BatchQueue,
        tower: VisionTower,
        device: TowerDevice,
        preprocess_id: str,
        encodes: InFlightEncodes,
        max_image_pixels: int,
        failer: RoomFailer,
        metrics: WorkerMetrics,
        out: Handoff[PreparedBatch],
        stopping: threading.Event,
        workers: int = 1,
        niceness: int = 0,
        on_device: bool = False,
        torch_threads: int = 1,
    ):
        self.queue = queue
        self.tower = tower
        self.device = device
        self.preprocess_id = preprocess_id
        self.encodes = encodes
        self.max_image_pixels = max_image_pixels
        self.failer = failer
        self.metrics = metrics
        self.out = out
        self.on_device = on_device
        self.torch_threads = torch_threads
        self._stopping = stopping
        self._pool = (
            ThreadPoolExecutor(
                max_workers=workers,
                thread_name_prefix="preprocess",
                initializer=_media_thread,
                initargs=("preprocess", niceness),
            )
            if workers > 1
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
        for job in batch:
            try:
                # SHM pixels are read first: their claimed hash is checked before it keys anything
                shm_pixels = self._shm_pixels(job) if job.source == "shm" else None
                key = CacheKey(job.content_hash, self.tower.model_id, self.preprocess_id)
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
                out = self.tower.processor(
                    images=[pixels], device=device.device, return_tensors="pt"
                )
            else:
                out = self.tower.processor(images=[image], return_tensors="pt")
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


class TowerStage:
    """One batch's misses through the tower in one call; rows split per item and cached. On a
    GPU the call only queues the batch (and the copies of its rows to host memory): this thread
    goes on to the next batch while the GPU runs it. A batch that runs the GPU out of memory is
    split in two and each half tried again; a batch the tower refuses otherwise is retried item
    by item, and an item that fails alone fails its room. A device that no longer runs anything
    fails its batch, and the worker's readiness, with the reason."""

    def __init__(
        self,
        tower: VisionTower,
        device: TowerDevice,
        encodes: InFlightEncodes,
        metrics: WorkerMetrics,
        health: Health,
        failer: RoomFailer,
        inbox: Handoff[PreparedBatch],
        out: Handoff[EncodedBatch],
        stopping: threading.Event,
        torch_threads: int = 1,
    ):
        self.tower = tower
        self.device = device
        self.torch_threads = torch_threads
        self.encodes = encodes
        self.metrics = metrics
        self.health = health
        self.failer = failer
        self.inbox = inbox
        self.out = out
        self._stopping = stopping

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


class StageAndSend:
    """Copy each item's rows into a send-ring slot and submit it to the sender. On a GPU this
    thread is the one that waits for a batch's rows to reach host memory (once per batch). A full
    ring blocks this stage (backpressure) up to ``receiver_wait_s``; then the item's room fails."""

    def __init__(
        self,
        ring: SlotPool,
        sender: Sender,
        receiver_wait_s: float,
        with_checksum: bool,
        failer: RoomFailer,
        health: Health,
        inbox: Handoff[EncodedBatch],
        stopping: threading.Event,
        torch_threads: int = 1,
    ):
        self.ring = ring
        self.torch_threads = torch_threads
        self.sender = sender
        self.receiver_wait_s = receiver_wait_s
        self.with_checksum = with_checksum
        self.failer = failer
        self.health = health
        self.inbox = inbox
        self._stopping = stopping

    def loop(self) -> None:
        torch.set_num_threads(self.torch_threads)
        while not self._stopping.is_set():
            encoded = self.inbox.get()
            for item in encoded.ready if encoded is not None else ():
                self.send(item)

    def send(self, item: ReadyItem) -> None:
        job = item.job
        try:
            rows = item.encoded.host_rows()
        except DeviceLost as exc:
            self.health.device_lost(str(exc))
            self.failer.fail(job.handshake, str(exc), job.modality)
            return
        layout = EmbeddingLayout.of(rows)
        deadline = time.monotonic() + self.receiver_wait_s
        while True:
            try:
                lease = stage(self.ring, rows)
                break
            except TooLarge:
                self.failer.fail(
                    job.handshake,
                    f"item of {layout.nbytes} bytes is larger than the send ring",
                    job.modality,
                )
                return
            except (
                NoCapacity
            ):  # backpressure: this stage blocks, and so, in turn, do those before it
                if time.monotonic() >= deadline:
                    self.failer.fail(job.handshake, "send ring stayed full", job.modality)
                    return
                with self.sender.slot_freed:
                    self.sender.slot_freed.wait(0.05)
        digest = checksum(self.ring.view(lease)) if self.with_checksum else None
        self.sender.submit(
            StagedItem(
                job.request_id,
                job.handshake,
                lease,
                layout,
                digest,
                dict(job.timings),
                item.encoded.grid_thw,
                job.modality,
            )
        )


def check_claimed_hash(claimed: int | None, computed: int) -> None:
    """A client's content hash must be the xxh3-128 of the payload's bytes (file or raw pixels)."""
    if claimed is not None and claimed != computed:
        raise BadItem(
            f"claimed content hash {claimed:032x} is not the hash of the item's bytes "
            f"({computed:032x})"
        )
