"""The encode worker process: the assembly of its stages (``encode_worker.stages``), health
(``encode_worker.health``) and room clients (``encode_worker.room_clients``).

Threads: the ZMQ intake loop, Prepare, TowerStage, StageAndSend, a pool of sender threads, the
sender's completion poller (the Mooncake writes its loop awaits), and
housekeeping (reap settled transfers, trim the heap, idle health probe). The handshake app is
served on the bootstrap port by uvicorn in the same process, on the event loop where the
sender's items wait for their receivers; this worker reaches its own rooms in-process, and every
other endpoint's over one pooled aiohttp client per endpoint on that same loop.

``EncodeWorker`` owns what the stages share (queue, hand-offs, send ring, cache, transports, room
table, metrics) and their lifecycle; each stage owns its thread's work and nothing else.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry

from encode_worker.cache import EmbeddingCache, InFlightEncodes
from encode_worker.config import WorkerConfig
from encode_worker.device import TowerDevice
from encode_worker.health import Health
from encode_worker.intake_stage import Intake
from encode_worker.messages import EncodedBatch, Handoff, PreparedBatch
from encode_worker.metrics import WorkerMetrics
from encode_worker.prepare import Prepare
from encode_worker.room_clients import InFlightRooms, RateLimitedLog, RoomClients, RoomFailer
from encode_worker.scheduler import BatchQueue
from encode_worker.sender import Sender
from encode_worker.stages import SHUTTING_DOWN, StageContext, StageThreads
from encode_worker.staging import StageAndSend
from encode_worker.tower_stage import TowerStage
from encode_worker.writes import Outcome
from epdserve.data_plane.pool import MemoryRegion, SlotPool
from epdserve.data_plane.transport import build_transports
from epdserve.loop_threads import LoopThread, named_thread
from epdserve.process_settings import SettingError, check_checkpoint, check_listen
from epdserve.vision.fingerprint import tower_fingerprint
from epdserve.vision.tower import VisionTower
from epdserve.wire.offers import transport_spec
from epdserve.wire.rooms import RoomState
from handshake.app import create_app
from handshake.rooms import RoomTable
from handshake.server import ThreadedServer

log = logging.getLogger(__name__)


class EncodeWorker:
    def __init__(
        self, config: WorkerConfig, tower: VisionTower | None = None, transports: dict | None = None
    ):
        self.config = config
        self.tower = tower or VisionTower.load(
            check_checkpoint(config.model),
            config.dtype,
            config.device,
            config.mm_processor_kwargs,
            config.vision_attention,
            config.compile,
            config.compile_cache_dir,
        )
        self.device = TowerDevice(self.tower.device)
        # what this worker's rows are (weights, dtype, preprocessing: read from what it loaded),
        # checked against every item's and receiver's model before a row is computed or written
        self.fingerprint = tower_fingerprint(self.tower)
        self.served_model = config.served_model_name
        self.cache = EmbeddingCache(config.cache_bytes)
        self.encodes = InFlightEncodes(self.cache)
        self.queue = BatchQueue(
            config.queue_items,
            config.batch_patches,
            config.batch_items,
            config.batch_pixels,
            config.queue_bytes,
            config.batch_window_s,
        )
        self.ring = SlotPool(
            MemoryRegion.anonymous(config.ring_bytes),
            config.ring_slot_bytes,
            quarantine_s=config.write_timeout_s * 2,
        )
        # a transport that cannot start (Mooncake) leaves the others in service (logged); alone, it
        # is an error
        self.transports = (
            transports
            if transports is not None
            else build_transports(
                config.transports,
                config.transport_configs(config.host, config.write_timeout_s),
                optional=True,
            )
        )
        try:
            for transport in self.transports.values():
                if transport_spec(transport.name).registers_send_memory:
                    transport.register(self.ring.region)
        except BaseException:
            self._close_transports()
            raise
        self.table = RoomTable(config.room_limits())
        registry = CollectorRegistry()
        self.metrics = WorkerMetrics(registry, self.queue, self.ring, self.cache, self.encodes)
        self.app = create_app(
            self.table,
            token=config.handshake_token,
            not_ready=self.not_ready,
            registry=registry,
            model_name=self.served_model,
            fingerprint=self.fingerprint,
        )
        self.loop = LoopThread(
            "handshake"
        )  # the handshake server's and the sender's: room work without hand-offs
        self.room_clients = RoomClients(
            self.table,
            self.loop,
            config.host,
            lambda: self.bootstrap_port,
            config.handshake_token,
            config.room_timeout_s,
            config.unsigned_rooms,
        )
        item_log = RateLimitedLog(log)
        self.in_flight = InFlightRooms()
        self.failer = RoomFailer(
            self.room_clients,
            self.in_flight,
            lambda modality: self.metrics.count(modality, RoomState.FAILED),
            item_log,
            config.room_timeout_s,
        )
        self.sender = Sender(
            self.ring,
            self.transports,
            self.room_clients,
            self.loop,
            config.receiver_wait_s,
            config.write_timeout_s,
            config.send_workers,
            on_outcome=self._on_outcome,
            local_table=self.table,
            fingerprint=self.fingerprint.compact,
        )
        self._item_log = item_log
        self._stopping = threading.Event()
        self._prepared: Handoff[PreparedBatch] = Handoff(
            self._stopping
        )  # decoded, waiting for the tower
        self._encoded: Handoff[EncodedBatch] = Handoff(
            self._stopping
        )  # encoded, waiting for the ring
        self.health = Health(
            self.tower,
            self.sender,
            config.probe_interval_s,
            self._stopping,
            lambda: not len(self.queue) and self._prepared.empty(),
        )
        context = StageContext(
            config,
            self.tower,
            self.device,
            self.queue,
            self.encodes,
            self.failer,
            self.health,
            self.metrics,
            StageThreads.for_device(self.device),
            self._stopping,
        )
        self.intake = Intake(
            context, self.served_model, self.fingerprint.compact, self.in_flight, item_log
        )
        self.prepare = Prepare(context, self.fingerprint.compact, self._prepared)
        self.tower_stage = TowerStage(context, self._prepared, self._encoded)
        self.stage_and_send = StageAndSend(context, self.ring, self.sender, self._encoded)
        self._threads: list[threading.Thread] = []
        self.server: ThreadedServer | None = None
        self.warmed_up: dict | None = None  # a compiled tower's warm-up, once started

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> EncodeWorker:
        """Serve; a port that cannot be listened on is a ``SettingError`` (one line), and
        whatever had started is stopped again."""
        try:
            self._listen()
        except BaseException:
            self.stop()
            raise
        media = self.config.media_niceness  # media work yields to the control plane's threads
        for target, name, niceness in (
            (self.intake.loop, "intake", 0),
            (self.prepare.loop, "prepare", media),
            (self.tower_stage.loop, "encode", media),
            (self.stage_and_send.loop, "stage", 0),
            (self.health.loop, "housekeeping", 0),
        ):
            thread = named_thread(target, name, niceness)
            thread.start()
            self._threads.append(thread)
        return self

    def _listen(self) -> None:
        config = self.config
        self.warmed_up = self.tower.warm_up(config.batch_items, config.batch_patches)
        if self.warmed_up is not None:
            log.info("compiled tower warmed up: %s", self.warmed_up)
        self.health.probe()
        if config.bootstrap_port:
            check_listen(config.bind, config.bootstrap_port, "bootstrap port")
        try:
            self.server = ThreadedServer(
                self.app, config.bind, config.bootstrap_port, self.loop
            ).start()
        except RuntimeError as exc:
            raise SettingError(
                f"bootstrap port: cannot serve on {config.bind}:{config.bootstrap_port}: {exc}"
            ) from None
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

    def not_ready(self) -> str | None:
        """Why this worker should get no items now (``/readyz``), or None when it is ready."""
        return self.health.not_ready()

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop intake, fail what is queued, let in-flight deliveries end, release memory."""
        self._stopping.set()
        self.failer.fail_all(self.queue.drain(), SHUTTING_DOWN)
        for thread in self._threads:
            thread.join(grace_s)
        self.prepare.close()
        for prepared in self._prepared.drain():
            self.failer.fail_all(prepared.jobs, SHUTTING_DOWN)
        for encoded in self._encoded.drain():
            self.failer.fail_all(encoded.jobs, SHUTTING_DOWN)
        self.failer.fail_all(self.encodes.drain(), SHUTTING_DOWN)
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
        self.metrics.count(outcome.modality, outcome.state)
        if outcome.state is not RoomState.SUCCESS:
            self._item_log.warning(
                "room %d %s: %s", outcome.room, outcome.state.value, outcome.reason
            )
        self.metrics.queue_wait(outcome.timings)
        if "wait_s" in outcome.timings:
            self.metrics.receiver_wait_seconds.observe(outcome.timings["wait_s"])
        if outcome.state is RoomState.SUCCESS and outcome.transport:
            self.metrics.series(self.metrics.bytes, outcome.transport).inc(outcome.nbytes)
            self.metrics.series(self.metrics.transfer_seconds, outcome.transport).observe(
                outcome.timings["transfer_s"]
            )
