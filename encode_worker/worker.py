"""The encode worker process: intake -> batch -> tower -> row split -> cache -> send ring -> send.

Threads: the ZMQ intake loop, one encode loop (the tower), a pool of sender threads, and a
housekeeping loop (reap settled transfers, idle health probe). The handshake app is served on the
bootstrap port by uvicorn in the same process, on the event loop where the sender's items wait
for their receivers; this worker reaches its own rooms in-process, and every other endpoint's
over one pooled aiohttp client per endpoint on that same loop (no thread per endpoint).

Intake never waits on the network: an item refused there whose room lives at another endpoint
has that room failed by a call on the loop (bounded in number and by ``room_timeout_s``), so a
silent endpoint holds up nothing but its own rooms.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import io
import json
import logging
import os
import queue
import threading
import time
import zlib
from dataclasses import dataclass

import torch
import zmq
from PIL import Image
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from data_plane.commit import EmbeddingLayout, checksum
from data_plane.mooncake import MooncakeConfig
from data_plane.offers import TRANSPORT_NAMES, transport_spec
from data_plane.pool import MemoryRegion, NoCapacity, SlotPool, TooLarge
from data_plane.shm import ShmTensorHandle
from data_plane.transport import build_transports
from encode_worker.cache import CacheKey, EmbeddingCache, Encoded
from encode_worker.inputs import (
    ALLOWED_FORMATS,
    MAX_PIXELS,
    MAX_SIDE,
    BadItem,
    image_from_bytes,
    image_from_pixels,
    pixels_from_shm,
)
from encode_worker.intake import IntakeRefused, IntakeReply, IntakeStatus, parse_request
from encode_worker.scheduler import BatchQueue, EncodeJob
from encode_worker.sender import Outcome, Sender, StagedItem, stage
from encode_worker.tower import VisionTower
from handshake.access import LocalRooms, RemoteRooms
from handshake.app import create_app
from handshake.client import HandshakeClient
from handshake.models import FailBody, RoomState
from handshake.rooms import RoomError, RoomTable
from handshake.server import ThreadedServer
from handshake.settings import DTYPES, SettingError, check_listen
from loop_threads import LoopThread
from multimodal.hashing import hash_feature
from multimodal.rows import RowContractError, image_grid, split_rows
from multimodal.wire import EncodeHandshake, endpoint_url

log = logging.getLogger(__name__)
LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "::1"}
TRIM_INTERVAL_S = 10.0
MAX_ENDPOINTS = 256  # room endpoints with a pooled client; the oldest is closed beyond
MAX_PENDING_FAILS = 1024  # room-fail calls to other endpoints in flight; beyond, the room is left to expire


def _trim_heap() -> None:
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


@dataclass
class WorkerConfig:
    model: str
    served_model: str | None = None  # the name dispatchers use; default: the checkpoint folder's name
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"  # the address peers use for this worker (rooms, Mooncake)
    bind: str = "0.0.0.0"
    bootstrap_port: int = 8998
    intake_port: int = 8999
    transports: tuple[str, ...] = ("shm", "mooncake")
    mooncake_hca: str = ""
    mooncake_force_tcp: bool = False
    batch_patches: int = 16384  # tower input patches per batch
    batch_items: int = 8
    queue_items: int = 64
    queue_bytes: int = 1 << 30  # payloads waiting for the tower (queue_items x max_payload_bytes is 4 GiB)
    max_payload_bytes: int = 64 << 20
    # decoded pixels: one image (checked from its header or shape at intake, before decoding),
    # and one batch (the prepare stage decodes a batch's images one after another)
    max_image_pixels: int = MAX_PIXELS
    batch_pixels: int = 2 * MAX_PIXELS
    ring_bytes: int = 512 << 20
    ring_slot_bytes: int = 1 << 20
    cache_bytes: int = 1 << 30
    receiver_wait_s: float = 30.0  # then the room fails ("no receiver registered within ...")
    write_timeout_s: float = 30.0
    room_timeout_s: float = 5.0  # one call to another endpoint's room API
    checksum: bool = True
    send_workers: int = 8
    handshake_token: str | None = None
    intake_token: str | None = None
    probe_interval_s: float = 10.0

    def validate(self) -> WorkerConfig:
        """Refuse (``SettingError``, one line) any setting that cannot work, before anything starts."""
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise SettingError(message)

        need(self.dtype in DTYPES, f"dtype {self.dtype!r}: a tower runs in {', '.join(DTYPES)}")
        need(bool(self.transports), "transports: give at least one of " + ", ".join(TRANSPORT_NAMES))
        unknown = [t for t in self.transports if t not in TRANSPORT_NAMES]
        need(not unknown, f"transports: unknown {unknown}; use {', '.join(TRANSPORT_NAMES)}")
        need(bool(self.host) and bool(self.bind), "host and bind must be addresses")
        for name in ("bootstrap_port", "intake_port"):
            need(0 <= getattr(self, name) <= 65535, f"{name} {getattr(self, name)} is not in 0..65535 (0: any)")
        need(not self.bootstrap_port or self.bootstrap_port != self.intake_port,
             f"bootstrap and intake ports are both {self.intake_port}")
        for name in ("batch_patches", "batch_items", "queue_items", "queue_bytes", "max_payload_bytes", "max_image_pixels",
                     "batch_pixels", "ring_bytes", "ring_slot_bytes", "send_workers"):
            need(getattr(self, name) > 0, f"{name} must be above 0, got {getattr(self, name)}")
        need(self.cache_bytes >= 0, f"cache_bytes must be 0 (off) or above, got {self.cache_bytes}")
        need(self.ring_slot_bytes <= self.ring_bytes,
             f"ring_slot_bytes {self.ring_slot_bytes} is larger than the ring ({self.ring_bytes})")
        need(self.batch_pixels >= self.max_image_pixels,
             f"batch_pixels {self.batch_pixels} is below max_image_pixels {self.max_image_pixels}")
        for name in ("receiver_wait_s", "write_timeout_s", "room_timeout_s", "probe_interval_s"):
            value = getattr(self, name)
            need(0 < value < float("inf"), f"{name} must be a positive number of seconds, got {value}")
        return self


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, worker: EncodeWorker):
        self.registry = registry
        self.requests = Counter("epd_encoder_requests", "Items by modality and outcome", ["modality", "status"],
                                registry=registry)
        self.batch_items = Histogram("epd_encoder_batch_items", "Items per tower batch",
                                     buckets=(1, 2, 4, 8, 16, 32), registry=registry)
        self.encode_seconds = Histogram("epd_encoder_encode_seconds", "Tower time per batch", registry=registry)
        self.queue_seconds = Histogram("epd_encoder_queue_seconds", "Intake to the tower starting the item's batch",
                                       registry=registry)
        self.receiver_wait_seconds = Histogram("epd_encoder_receiver_wait_seconds",
                                               "Rows staged to the receiver registered (or the wait ended)",
                                               registry=registry)
        self.transfer_seconds = Histogram("epd_encoder_transfer_seconds",
                                          "The write alone per delivered item: submit to the transport settled",
                                          ["transport"], registry=registry)
        self.bytes = Counter("epd_encoder_bytes", "Bytes delivered", ["transport"], registry=registry)
        Gauge("epd_encoder_queue_depth", "Items waiting for the tower", registry=registry).set_function(
            lambda: len(worker.queue))
        Gauge("epd_encoder_ring_occupancy", "Leased fraction of the send ring", registry=registry).set_function(
            lambda: worker.ring.stats()["leased_slots"] / worker.ring.slot_count)
        for name in ("hits", "misses", "evictions"):
            Gauge(f"epd_encoder_cache_{name}", f"Embedding cache {name}", registry=registry).set_function(
                lambda name=name: getattr(worker.cache, name))

    def count(self, modality: str, status: IntakeStatus | RoomState) -> None:
        """One item's intake answer or room end in ``epd_encoder_requests``: the status label is the
        enum's value in lower case (accepted, refused, failed; success, cancelled, expired)."""
        self.requests.labels(modality, status.value.lower()).inc()


class RateLimitedLog:
    """Per-item lines (refusals, failed rooms): each item is logged once, and at most
    ``per_interval`` lines per ``interval_s``; the next line says how many were left out."""

    def __init__(self, logger: logging.Logger, per_interval: int = 20, interval_s: float = 1.0):
        self.logger = logger
        self.per_interval = per_interval
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._window = -interval_s
        self._count = 0
        self._dropped = 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._window >= self.interval_s:
                self._window, self._count = now, 0
            if self._count >= self.per_interval:
                self._dropped += 1
                return
            self._count += 1
            dropped, self._dropped = self._dropped, 0
        if dropped:
            message, args = message + " (%d more such lines left out before this one)", (*args, dropped)
        self.logger.warning(message, *args)


class LoopClient:
    """A ``HandshakeClient`` on a loop every endpoint's client shares (the worker's handshake
    loop), with ``SyncHandshakeClient``'s interface for ``RemoteRooms``."""

    def __init__(self, loop: LoopThread, client: HandshakeClient):
        self._loop = loop
        self.client = client

    def submit(self, name: str, *args, **kwargs) -> concurrent.futures.Future:
        return self._loop.submit(getattr(self.client, name)(*args, **kwargs))

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def call(*args, **kwargs):
            if threading.current_thread() is self._loop.thread:  # it would wait for itself forever
                raise RuntimeError(f"blocking room call {name} on the loop that serves it")
            return self._loop.run(method(*args, **kwargs))
        return call

    def close(self) -> concurrent.futures.Future:
        return self._loop.submit(self.client.close())


class EncodeWorker:
    def __init__(self, config: WorkerConfig, tower: VisionTower | None = None, transports: dict | None = None):
        self.config = config.validate()
        self.tower = tower or VisionTower.load(config.model, config.dtype, config.device)
        self.preprocess_id = f"{zlib.crc32(json.dumps(self.tower.processor.to_dict(), sort_keys=True, default=str).encode()):08x}"
        self.served_model = config.served_model or os.path.basename(os.path.normpath(config.model))
        self.cache = EmbeddingCache(config.cache_bytes)
        self.queue = BatchQueue(config.queue_items, config.batch_patches, config.batch_items, config.batch_pixels,
                                config.queue_bytes)
        self.ring = SlotPool(MemoryRegion.anonymous(config.ring_bytes), config.ring_slot_bytes,
                             quarantine_s=config.write_timeout_s * 2)
        # a transport that cannot start (Mooncake) leaves the others in service (logged); alone, it
        # is an error
        self.transports = transports if transports is not None else build_transports(
            config.transports, {"mooncake": MooncakeConfig(hostname=config.host, device_names=config.mooncake_hca,
                                                           force_tcp=config.mooncake_force_tcp,
                                                           transfer_timeout_s=max(5, int(config.write_timeout_s)))},
            optional=True)
        try:
            for transport in self.transports.values():
                if transport_spec(transport.name).registers_send_memory:
                    transport.register(self.ring.region)
        except BaseException:
            self._close_transports()
            raise
        self.table = RoomTable()
        registry = CollectorRegistry()
        self.metrics = WorkerMetrics(registry, self)
        self.app = create_app(self.table, token=config.handshake_token, ready=self.ready, registry=registry)
        self.loop = LoopThread("handshake")  # the handshake server's and the sender's: room work without hand-offs
        self.sender = Sender(self.ring, self.transports, self.rooms_for, self.loop, config.receiver_wait_s,
                             config.write_timeout_s, config.send_workers, on_outcome=self._on_outcome)
        self._remote: dict[tuple[str, int], RemoteRooms] = {}
        self._remote_lock = threading.Lock()
        self._failing: set[concurrent.futures.Future] = set()  # room-fail calls to other endpoints
        self._item_log = RateLimitedLog(log)
        # rooms with an item accepted and not yet ended: a second message for one of them is
        # refused (two writers for one slot would race; the later one could land after the
        # receiver handed the slot to a new tenant). Bounded by the items in flight.
        self._in_flight: set[int] = set()
        self._in_flight_lock = threading.Lock()
        self._stopping = threading.Event()
        self._healthy = False
        self._last_ok = 0.0
        self._busy = False
        self._prepared: queue.Queue = queue.Queue(maxsize=1)  # batches decoded, waiting for the tower
        self._encoded: queue.Queue = queue.Queue(maxsize=1)  # batches encoded, waiting for the ring
        self._threads: list[threading.Thread] = []
        self.server: ThreadedServer | None = None
        self._socket: zmq.Socket | None = None
        self.intake_port: int | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> EncodeWorker:
        """Serve; a port that cannot be listened on is a ``SettingError`` (one line), and
        whatever had started is stopped again."""
        try:
            self._listen()
        except BaseException:
            self.stop()
            raise
        for target, name in ((self._intake_loop, "intake"), (self._prepare_loop, "prepare"),
                             (self._encode_loop, "encode"), (self._stage_loop, "stage"),
                             (self._housekeeping_loop, "housekeeping")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _listen(self) -> None:
        config = self.config
        self._probe()
        if config.bootstrap_port:
            check_listen(config.bind, config.bootstrap_port, "bootstrap port")
        try:
            self.server = ThreadedServer(self.app, config.bind, config.bootstrap_port, self.loop).start()
        except RuntimeError as exc:
            raise SettingError(f"bootstrap port: cannot serve on {config.bind}:{config.bootstrap_port}: {exc}") from None
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, config.max_payload_bytes + (1 << 20))
        self._socket.setsockopt(zmq.IPV6, 1)  # --bind may be an IPv6 address
        try:
            if config.intake_port:
                self._socket.bind(endpoint_url("tcp", config.bind, config.intake_port))
                self.intake_port = config.intake_port
            else:
                self.intake_port = self._socket.bind_to_random_port(endpoint_url("tcp", config.bind))
        except zmq.ZMQError as exc:
            raise SettingError(f"intake port: cannot listen on {config.bind}:{config.intake_port}: {exc.strerror}") from None

    @property
    def bootstrap_port(self) -> int:
        return self.server.port if self.server else self.config.bootstrap_port

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop intake, fail what is queued, let in-flight deliveries end, release memory."""
        self._stopping.set()
        self._fail_all(self.queue.drain(), "encode worker shutting down")
        for thread in self._threads:
            thread.join(grace_s)
        for stage_queue, pick in ((self._prepared, lambda item: item[0]), (self._encoded, lambda item: [j for j, _ in item])):
            while not stage_queue.empty():
                self._fail_all(pick(stage_queue.get_nowait()), "encode worker shutting down")
        if not self._threads and self._socket is not None:  # the intake loop closes it otherwise
            self._socket.close(0)
        self.sender.close(wait=True)
        self.sender.reap()
        with self._remote_lock:
            failing = list(self._failing)
        concurrent.futures.wait(failing, self.config.room_timeout_s + 1)  # rooms failed at shutdown, told
        if self.server is not None:
            self.server.stop()
        with self._remote_lock:
            remotes, self._remote = list(self._remote.values()), {}
        concurrent.futures.wait([remote.client.close() for remote in remotes], 5)
        self.loop.stop()
        for transport in self.transports.values():
            transport.unregister(self.ring.region)
        self._close_transports()
        self.ring.region.close()

    def _close_transports(self) -> None:
        for transport in self.transports.values():
            transport.close()

    # ---- health ----------------------------------------------------------------------------

    def ready(self) -> bool:
        return self._healthy and (self._busy or time.monotonic() - self._last_ok < 3 * self.config.probe_interval_s)

    def _probe(self) -> None:
        """A tiny dummy encode; runs only when the tower is idle."""
        try:
            pixels = self.tower.processor(images=[Image.new("RGB", (56, 56))], return_tensors="pt")
            self.tower.encode(pixels["pixel_values"], pixels["image_grid_thw"])
            self._healthy, self._last_ok = True, time.monotonic()
        except Exception:
            log.exception("tower health probe failed")
            self._healthy = False

    # ---- rooms -----------------------------------------------------------------------------

    def rooms_for(self, handshake: EncodeHandshake):
        """This worker's own table, or a pooled client of the room's endpoint (any thread)."""
        if handshake.bootstrap_port == self.bootstrap_port and handshake.bootstrap_host in LOCAL_HOSTS | {self.config.host}:
            return LocalRooms(self.table)
        key = (handshake.bootstrap_host, handshake.bootstrap_port)
        with self._remote_lock:
            remote = self._remote.get(key)
            if remote is None:
                if len(self._remote) >= MAX_ENDPOINTS:
                    self._remote.pop(next(iter(self._remote))).client.close()  # the first endpoint added
                client = HandshakeClient(handshake.url, token=self.config.handshake_token,
                                         timeout_s=self.config.room_timeout_s)
                remote = self._remote[key] = RemoteRooms(LoopClient(self.loop, client))
            return remote

    @property
    def pending_room_fails(self) -> int:
        """Calls failing rooms at other endpoints, still in flight."""
        with self._remote_lock:
            return len(self._failing)

    def _fail_room(self, handshake: EncodeHandshake, reason: str, modality: str) -> None:
        """Fail an item's room with ``reason`` without waiting on the network: this worker's own
        rooms at once, another endpoint's by a call on the loop (``_tell_failed``)."""
        room = handshake.bootstrap_room
        self._end_room(room)
        self.metrics.count(modality, RoomState.FAILED)
        self._item_log.warning("room %d failed: %s", room, reason)
        rooms = self.rooms_for(handshake)
        if rooms.in_process:
            try:
                rooms.fail(room, reason, True)
            except RoomError as exc:  # unknown here, or already ended
                log.info("room %d not failed: %s", room, exc)
            return
        with self._remote_lock:
            if len(self._failing) >= MAX_PENDING_FAILS:
                self._item_log.warning("room %d at %s:%d not told it failed (%d such calls in flight); "
                                       "it ends when its TTL does", room, handshake.bootstrap_host,
                                       handshake.bootstrap_port, len(self._failing))
                return
            future = self.loop.submit(self._tell_failed(rooms.client.client, room, reason))
            self._failing.add(future)
        future.add_done_callback(self._told)

    async def _tell_failed(self, client: HandshakeClient, room: int, reason: str) -> None:
        try:
            (result,) = await asyncio.wait_for(
                client.fail([FailBody(room=room, reason=reason[:500], settled=True)]), self.config.room_timeout_s)
            if not result.ok:
                log.info("room %d not failed at %s: %s", room, client.base_url, result.error)
        except asyncio.TimeoutError:
            self._item_log.warning("could not tell %s that room %d failed: no answer within %g s",
                                   client.base_url, room, self.config.room_timeout_s)
        except Exception as exc:  # unreachable, or an answer that is not the room API's: one line, no traceback
            self._item_log.warning("could not tell %s that room %d failed: %s: %s", client.base_url, room,
                                   type(exc).__name__, exc)

    def _told(self, future: concurrent.futures.Future) -> None:
        with self._remote_lock:
            self._failing.discard(future)

    def _end_room(self, room: int) -> None:
        with self._in_flight_lock:
            self._in_flight.discard(room)

    def _on_outcome(self, outcome: Outcome) -> None:
        self._end_room(outcome.room)
        self.metrics.count("IMAGE", outcome.state)
        if outcome.state is not RoomState.SUCCESS:
            self._item_log.warning("room %d %s: %s", outcome.room, outcome.state.value, outcome.reason)
        if "queue_s" in outcome.timings:
            self.metrics.queue_seconds.observe(outcome.timings["queue_s"])
        if "wait_s" in outcome.timings:
            self.metrics.receiver_wait_seconds.observe(outcome.timings["wait_s"])
        if outcome.state is RoomState.SUCCESS and outcome.transport:
            self.metrics.bytes.labels(outcome.transport).inc(outcome.nbytes)
            self.metrics.transfer_seconds.labels(outcome.transport).observe(outcome.timings["transfer_s"])

    # ---- intake ----------------------------------------------------------------------------

    def _intake_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart(copy=True)
            identity, body = frames[0], frames[1:]
            reply = self._accept(body)
            self._socket.send_multipart([identity, reply.frame()])
        self._socket.close(0)

    def _accept(self, frames: list[bytes]) -> IntakeReply:
        try:
            request, payload = parse_request(frames, self.config.max_payload_bytes, self.config.intake_token,
                                             self.served_model)
        except IntakeRefused as exc:
            self.metrics.count("IMAGE", IntakeStatus.REFUSED)
            self._item_log.warning("intake refused an item (room %s): %s", exc.room, exc)
            return IntakeReply(status=IntakeStatus.REFUSED, room=exc.room, reason=str(exc))
        room = request.encode_handshake.bootstrap_room
        with self._in_flight_lock:
            duplicate = room in self._in_flight
            self._in_flight.add(room)
        if duplicate:
            self.metrics.count(request.modality, IntakeStatus.REFUSED)
            self._item_log.warning("intake refused room %d: an item for it is already in flight here", room)
            return IntakeReply(status=IntakeStatus.REFUSED, room=room,
                               reason=f"room {room} already has an item in flight here")
        try:
            job = self._job(request, payload)
        except BadItem as exc:
            self._fail_room(request.encode_handshake, str(exc), request.modality)
            return IntakeReply(status=IntakeStatus.FAILED, room=room, reason=str(exc))
        if not self.queue.put(job):
            self._end_room(room)
            self.metrics.count(request.modality, IntakeStatus.REFUSED)
            return IntakeReply(status=IntakeStatus.REFUSED, room=room, reason="queue full", retry_after_s=0.1)
        self.metrics.count(request.modality, IntakeStatus.ACCEPTED)
        return IntakeReply(status=IntakeStatus.ACCEPTED, room=room)

    def _job(self, request, payload: bytes | None) -> EncodeJob:
        """The item as a job, from what intake can see without decoding (the header, the shape,
        the SHM name); ``BadItem`` for an item that must not go further."""
        if request.source == "bytes":
            try:
                with Image.open(io.BytesIO(payload)) as probe:
                    width, height = probe.size
                    image_format = probe.format
            except Exception as exc:
                raise BadItem(f"cannot read image header: {type(exc).__name__}") from None
            if image_format not in ALLOWED_FORMATS:
                raise BadItem(f"image format {image_format!r} is not accepted ({sorted(ALLOWED_FORMATS)})")
        else:
            height, width = (request.shape if request.source == "pixels" else request.shm.shape)[:2]
        if width > MAX_SIDE or height > MAX_SIDE or width * height > self.config.max_image_pixels:
            raise BadItem(f"image of {width}x{height} pixels is larger than this worker decodes "
                          f"({self.config.max_image_pixels} pixels, {MAX_SIDE} a side)")
        if request.source == "bytes":
            source_payload = payload
        elif request.source == "pixels":
            source_payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(height, width, 3)
        else:
            try:  # the name alone decides: a segment that is not an intake handle is never opened
                source_payload = ShmTensorHandle.for_intake(request.shm.shm_name, tuple(request.shm.shape),
                                                            torch.uint8)
            except ValueError as exc:
                raise BadItem(str(exc)) from None
        # The cache key is the hash of the bytes this worker encodes, never the client's word for
        # it: a wrong claimed hash would poison the cache entry of the image it names.
        if request.source == "shm":
            if request.content_hash is None:
                raise BadItem("SHM-backed items must carry a content hash")
            content_hash = request.content_hash  # checked against the pixels once read (_image)
        else:
            content_hash = hash_feature(payload)
            _check_claimed_hash(request.content_hash, content_hash)
        return EncodeJob(request.request_id, request.encode_handshake, content_hash, request.source,
                         source_payload, self._patches(height, width), request.modality, pixels=width * height,
                         nbytes=len(payload) if payload is not None else 0)

    def _patches(self, height: int, width: int) -> int:
        try:
            t, h, w = image_grid(self.tower.processor, height, width)
        except ValueError as exc:
            raise BadItem(f"image of {width}x{height} cannot be resized for the tower: {exc}") from None
        return t * h * w

    # ---- encode ----------------------------------------------------------------------------

    # Three stages, one thread each, joined by bounded queues, so decoding the next batch and
    # staging the last one overlap the tower. A full send ring blocks staging, which fills the
    # queues behind it, which stops the prepare stage pulling from intake: backpressure.

    def _prepare_loop(self) -> None:
        while not self._stopping.is_set():
            batch = self.queue.take_batch(0.2)
            if batch and not self._put(self._prepared, (batch, self.prepare(batch))):
                self._fail_all(batch, "encode worker shutting down")

    def _encode_loop(self) -> None:
        while not self._stopping.is_set():
            item = self._get(self._prepared)
            if item is None:
                continue
            batch, (misses, ready) = item
            self._busy = True
            try:
                ready = ready + self.encode(misses)
            except Exception:
                log.exception("batch crashed")
                self._fail_all([job for job, *_ in misses], "encode worker error while encoding")
            finally:
                self._busy = False
            if not self._put(self._encoded, ready):
                self._fail_all([job for job, _ in ready], "encode worker shutting down")

    def _stage_loop(self) -> None:
        while not self._stopping.is_set():
            ready = self._get(self._encoded)
            for job, encoded in ready or ():
                self._stage_and_send(job, encoded)

    def _put(self, stage_queue: queue.Queue, item) -> bool:
        while not self._stopping.is_set():
            try:
                stage_queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, stage_queue: queue.Queue):
        try:
            return stage_queue.get(timeout=0.2)
        except queue.Empty:
            return None

    def _fail_all(self, jobs: list[EncodeJob], reason: str) -> None:
        for job in jobs:
            self._fail_room(job.handshake, reason, job.modality)

    def prepare(self, batch: list[EncodeJob]):
        """Decode and preprocess; cache hits skip the tower. -> (misses, ready)."""
        misses, ready = [], []
        for job in batch:
            try:
                image = self._image(job)
                key = CacheKey(job.content_hash, self.tower.model_id, self.preprocess_id)
                cached = self.cache.get(key)
                if cached is not None:
                    job.timings.update(queue_s=time.monotonic() - job.received_at, cache_hit=True)
                    ready.append((job, cached))
                else:
                    misses.append((job, key, self.tower.processor(images=[image], return_tensors="pt")))
            except BadItem as exc:
                self._fail_room(job.handshake, str(exc), job.modality)
        return misses, ready

    def encode(self, misses) -> list[tuple[EncodeJob, Encoded]]:
        """Run the tower once over all misses; cache and return each item's rows."""
        ready = []
        if misses:
            for (job, key, inputs), rows in zip(misses, self._encode_misses(misses)):
                if rows is not None:
                    encoded = Encoded(rows, tuple(inputs["image_grid_thw"][0].tolist()))
                    self.cache.put(key, encoded)
                    ready.append((job, encoded))
        return ready

    def _encode_misses(self, misses) -> list[torch.Tensor | None]:
        pixel_values = torch.cat([inputs["pixel_values"] for _, _, inputs in misses])
        grid_thw = torch.cat([inputs["image_grid_thw"] for _, _, inputs in misses])
        started = time.monotonic()
        try:
            rows = split_rows(self.tower.encode(pixel_values, grid_thw), self.tower.rows_per_item(grid_thw))
            seconds = time.monotonic() - started
            for job, _, _ in misses:
                job.timings.update(queue_s=started - job.received_at, encode_s=seconds)
            self.metrics.encode_seconds.observe(seconds)
            self.metrics.batch_items.observe(len(misses))
            self._last_ok = time.monotonic()
            return rows
        except (RuntimeError, ValueError, RowContractError) as exc:
            if len(misses) == 1:
                job = misses[0][0]
                self._fail_room(job.handshake, f"vision tower failed on this item: {exc}", job.modality)
                return [None]
            log.warning("batch of %d failed (%s); encoding items one by one", len(misses), exc)
            return [self._encode_misses([miss])[0] for miss in misses]

    def _image(self, job: EncodeJob) -> Image.Image:
        limit = self.config.max_image_pixels
        if job.source == "bytes":
            return image_from_bytes(job.payload, limit)
        if job.source == "pixels":
            return image_from_pixels(job.payload, limit)
        pixels = pixels_from_shm(job.payload)
        _check_claimed_hash(job.content_hash, hash_feature(memoryview(pixels.numpy()).cast("B")))
        return image_from_pixels(pixels, limit)

    def _stage_and_send(self, job: EncodeJob, encoded: Encoded) -> None:
        rows = encoded.rows
        layout = EmbeddingLayout.of(rows)
        deadline = time.monotonic() + self.config.receiver_wait_s
        while True:
            try:
                lease = stage(self.ring, rows)
                break
            except TooLarge:
                self._fail_room(job.handshake, f"item of {layout.nbytes} bytes is larger than the send ring",
                                job.modality)
                return
            except NoCapacity:  # backpressure: this stage blocks, and so, in turn, do those before it
                if time.monotonic() >= deadline:
                    self._fail_room(job.handshake, "send ring stayed full", job.modality)
                    return
                with self.sender.slot_freed:
                    self.sender.slot_freed.wait(0.05)
        digest = checksum(self.ring.view(lease)) if self.config.checksum else None
        self.sender.submit(StagedItem(job.request_id, job.handshake, lease, layout, digest, dict(job.timings),
                                      encoded.grid_thw))

    def _housekeeping_loop(self) -> None:
        last_trim = time.monotonic()
        while not self._stopping.wait(0.5):
            self.sender.reap()
            if time.monotonic() - last_trim >= TRIM_INTERVAL_S:
                _trim_heap()
                last_trim = time.monotonic()
            idle = not self._busy and not len(self.queue) and self._prepared.empty()
            if idle and time.monotonic() - self._last_ok > self.config.probe_interval_s:
                self._probe()


def _check_claimed_hash(claimed: int | None, computed: int) -> None:
    """A client's content hash must be the xxh3-128 of the payload's bytes (file or raw pixels)."""
    if claimed is not None and claimed != computed:
        raise BadItem(f"claimed content hash {claimed:032x} is not the hash of the item's bytes ({computed:032x})")
