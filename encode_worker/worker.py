"""The encode worker process: the assembly of its stages (``encode_worker.stages``), health
(``encode_worker.health``) and room clients (``encode_worker.room_clients``).

Threads: the ZMQ intake loop, Prepare, TowerStage, StageAndSend, a pool of sender threads, and
housekeeping (reap settled transfers, trim the heap, idle health probe). The handshake app is
served on the bootstrap port by uvicorn in the same process, on the event loop where the
sender's items wait for their receivers; this worker reaches its own rooms in-process, and every
other endpoint's over one pooled aiohttp client per endpoint on that same loop.

``EncodeWorker`` owns what the stages share (queue, hand-offs, send ring, cache, transports, room
table, metrics) and their lifecycle; each stage owns its thread's work and nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from data_plane.mooncake import MooncakeConfig
from data_plane.offers import TRANSPORT_NAMES, transport_spec
from data_plane.pool import MemoryRegion, SlotPool
from data_plane.transport import build_transports
from encode_worker.cache import EmbeddingCache
from encode_worker.health import Health
from encode_worker.inputs import MAX_PIXELS
from encode_worker.intake import IntakeStatus
from encode_worker.messages import EncodedBatch, Handoff, PreparedBatch
from encode_worker.room_clients import InFlightRooms, RateLimitedLog, RoomClients, RoomFailer
from encode_worker.scheduler import BatchQueue
from encode_worker.sender import Outcome, Sender
from encode_worker.stages import SHUTTING_DOWN, Intake, Prepare, StageAndSend, TowerStage
from encode_worker.tower import VisionTower
from handshake.app import create_app
from handshake.models import RoomState
from handshake.rooms import RoomTable
from handshake.server import ThreadedServer
from handshake.settings import DTYPES, SettingError, check_listen
from loop_threads import LoopThread

log = logging.getLogger(__name__)


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
        self.room_clients = RoomClients(self.table, self.loop, config.host, lambda: self.bootstrap_port,
                                     config.handshake_token, config.room_timeout_s)
        item_log = RateLimitedLog(log)
        self.in_flight = InFlightRooms()
        self.failer = RoomFailer(self.room_clients, self.in_flight,
                                 lambda modality: self.metrics.count(modality, RoomState.FAILED), item_log,
                                 config.room_timeout_s)
        self.sender = Sender(self.ring, self.transports, self.room_clients, self.loop, config.receiver_wait_s,
                             config.write_timeout_s, config.send_workers, on_outcome=self._on_outcome)
        self._item_log = item_log
        self._stopping = threading.Event()
        self._prepared: Handoff[PreparedBatch] = Handoff(self._stopping)  # decoded, waiting for the tower
        self._encoded: Handoff[EncodedBatch] = Handoff(self._stopping)  # encoded, waiting for the ring
        self.health = Health(self.tower, self.sender, config.probe_interval_s, self._stopping,
                             lambda: not len(self.queue) and self._prepared.empty())
        self.intake = Intake(config, self.served_model, self.tower, self.queue, self.in_flight, self.failer,
                             self.metrics, item_log, self._stopping)
        self.prepare = Prepare(self.queue, self.tower, self.preprocess_id, self.cache, config.max_image_pixels,
                               self.failer, self._prepared, self._stopping)
        self.tower_stage = TowerStage(self.tower, self.cache, self.metrics, self.health, self.failer,
                                      self._prepared, self._encoded, self._stopping)
        self.stage_and_send = StageAndSend(self.ring, self.sender, config.receiver_wait_s, config.checksum,
                                           self.failer, self._encoded, self._stopping)
        self._threads: list[threading.Thread] = []
        self.server: ThreadedServer | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> EncodeWorker:
        """Serve; a port that cannot be listened on is a ``SettingError`` (one line), and
        whatever had started is stopped again."""
        try:
            self._listen()
        except BaseException:
            self.stop()
            raise
        for target, name in ((self.intake.loop, "intake"), (self.prepare.loop, "prepare"),
                             (self.tower_stage.loop, "encode"), (self.stage_and_send.loop, "stage"),
                             (self.health.loop, "housekeeping")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _listen(self) -> None:
        config = self.config
        self.health.probe()
        if config.bootstrap_port:
            check_listen(config.bind, config.bootstrap_port, "bootstrap port")
        try:
            self.server = ThreadedServer(self.app, config.bind, config.bootstrap_port, self.loop).start()
        except RuntimeError as exc:
            raise SettingError(f"bootstrap port: cannot serve on {config.bind}:{config.bootstrap_port}: {exc}") from None
        self.intake.listen()

    @property
    def bootstrap_port(self) -> int:
        return self.server.port if self.server else self.config.bootstrap_port

    @property
    def intake_port(self) -> int | None:
        return self.intake.port

    @property
    def pending_room_fails(self) -> int:
        """Calls failing rooms at other endpoints, still in flight."""
        return self.failer.pending

    def ready(self) -> bool:
        return self.health.ready()

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop intake, fail what is queued, let in-flight deliveries end, release memory."""
        self._stopping.set()
        self.failer.fail_all(self.queue.drain(), SHUTTING_DOWN)
        for thread in self._threads:
            thread.join(grace_s)
        for prepared in self._prepared.drain():
            self.failer.fail_all(prepared.batch, SHUTTING_DOWN)
        for encoded in self._encoded.drain():
            self.failer.fail_all(encoded.jobs, SHUTTING_DOWN)
        if not self._threads:  # the intake loop closes its socket otherwise
            self.intake.close()
        self.sender.close(wait=True)
        self.sender.reap()
        self.failer.wait()  # rooms failed at shutdown, told
        if self.server is not None:
            self.server.stop()
        self.room_clients.close()
        self.loop.stop()
        for transport in self.transports.values():
            transport.unregister(self.ring.region)
        self._close_transports()
        self.ring.region.close()

    def _close_transports(self) -> None:
        for transport in self.transports.values():
            transport.close()

    def _on_outcome(self, outcome: Outcome) -> None:
        """An item's room ended (the sender's report): the room is free here again, and counted."""
        self.in_flight.release(outcome.room)
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
