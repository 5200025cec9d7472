"""The receiver: reserve a slot per item, register it in the item's room, publish verified rows.

One ``PrefillReceiver`` per engine process owns the registered receive pool and the transports.
``start(request_id, mm_inputs)`` returns at once with a ``ReceiveJob``; the work runs on the
receiver's own event-loop thread, so the engine's loop never blocks on HTTP. Per endpoint, one
register call and one long-poll watch per round cover all of a request's items.

By default ``encoded`` is a copy of the slot's rows, and the checksum is verified on that copy (the
bytes checked are the bytes published); the slot is released at once, so receive-pool occupancy is
bounded by items in flight, and ``encoded`` is plain memory owned by the item (freed with it).
With ``ReceiverConfig(zero_copy=True)`` ``encoded`` is a view of the slot itself (no copy, no page
faults of fresh memory): the slot stays leased until the engine calls ``job.release()`` (after it
moved the rows to the device or finished the prefill), which also clears ``encoded``; until then
the pool counts it as leased. Items without an ``encode_handshake``, and items whose ``encoded``
is already set (chunked prefill), are left alone. A job ends with its last item's outcome.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from data_plane.commit import Commit, ContractError, EmbeddingLayout, accept_commit, verify_rows
from data_plane.mooncake import MooncakeUnavailable
from data_plane.pool import Lease, MemoryRegion, NoCapacity, SlotPool, TooLarge
from data_plane.shm import ShmError
from data_plane.transport import build_transports
from handshake.client import HandshakeClient, HandshakeError
from handshake.loops import LoopThread
from handshake.models import EncodeTimings, Registration, RoomState
from multimodal.items import MultimodalDataItem, MultimodalInputs
from multimodal.rows import RowContractError, item_rows
from multimodal.wire import EncodeHandshake

log = logging.getLogger(__name__)


class JobState(enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True)
class ReceiverConfig:
    width: int  # wire width of one row (Qwen3-VL: out_width * (1 + deepstack_levels))
    dtype: str = "bfloat16"
    deepstack_width: int = 0  # > 0: the last deepstack_width columns go to encoded_deepstack
    pool_bytes: int = 1 << 30
    slot_bytes: int = 1 << 20
    quarantine_s: float = 40.0  # above the writers' own transfer timeout (see MooncakeConfig)
    transports: tuple[str, ...] = ("shm", "mooncake")
    item_timeout_s: float = 60.0
    poll_s: float = 0.5  # long-poll slice: an unreachable endpoint is noticed within about this
    # an endpoint that has not answered a call this long after its long-poll slice is stalled
    # (a SIGSTOPped or hung worker): its items fail then, without a retry
    endpoint_timeout_s: float = 1.0
    fallback: str = "fail"  # or "local_tower": encode the kept pixels with a local VisionTower
    handshake_token: str | None = None
    # Publish only rows whose xxh3-64 matches the sender's commit; a commit without a checksum is
    # refused. False accepts such commits on generation and layout alone (a sent checksum is still
    # verified).
    require_checksum: bool = True
    zero_copy: bool = False  # encoded = a view of the slot, held until job.release()


@dataclass
class ItemOutcome:
    index: int
    state: str = "PENDING"  # PENDING, DONE, FAILED, SKIPPED
    transport: str | None = None
    reason: str | None = None
    seconds: float = 0.0  # job start -> published (or failed)
    fallback: bool = False
    encoder: EncodeTimings | None = None  # where the time went on the encode worker, from its commit


@dataclass
class _Pending:
    index: int
    item: MultimodalDataItem
    handshake: EncodeHandshake
    layout: EmbeddingLayout
    lease: Lease
    deadline: float
    version: int = 0


class ReceiveJob:
    def __init__(self, request_id: str, inputs: MultimodalInputs, receiver: PrefillReceiver):
        self.request_id = request_id
        self.inputs = inputs
        self.outcomes = [ItemOutcome(i) for i in range(len(inputs.mm_items))]
        self._receiver = receiver
        self._future = Future()  # done as soon as every item is settled (or the job's task crashed)
        self._cancelled = threading.Event()
        self._held: list[tuple[MultimodalDataItem, Lease]] = []  # zero-copy slots behind published views
        self._held_lock = threading.Lock()
        self._released = False
        self.started = time.monotonic()

    def poll(self) -> JobState:
        """Non-blocking: PENDING until every item is DONE (or skipped), or FAILED."""
        if not self._future.done():
            return JobState.PENDING
        return JobState.FAILED if any(o.state == "FAILED" for o in self.outcomes) else JobState.DONE

    def wait(self, timeout: float | None = None) -> JobState:
        try:
            self._future.result(timeout)
        except TimeoutError:
            return JobState.PENDING
        return self.poll()

    @property
    def future(self) -> Future:
        """Completes when the job ends (``asyncio.wrap_future`` it to await from a loop)."""
        return self._future

    @property
    def reasons(self) -> dict[int, str]:
        return {o.index: o.reason for o in self.outcomes if o.state == "FAILED"}

    def release(self) -> None:
        """Zero-copy mode: the engine is done with the items' ``encoded`` views; free their slots
        (and clear ``encoded``, so nothing reads a slot its next tenant writes). Idempotent."""
        with self._held_lock:
            held, self._held, self._released = self._held, [], True
        for item, lease in held:
            item.encoded = item.encoded_deepstack = None
            self._receiver.pool.release(lease)

    def _settle_if_done(self) -> None:
        """On the receiver's loop, after an item's outcome is final: the job ends with its last
        item, not when its coroutines have unwound (that took ~80 us more here)."""
        if all(outcome.state != "PENDING" for outcome in self.outcomes):
            self._end()

    def _end(self, task: Future | None = None) -> None:
        error = None
        if task is not None:  # the job's task ended: a crash ends the job with its error
            error = RuntimeError("the receive job's task was cancelled") if task.cancelled() else task.exception()
        try:
            if error is not None:
                self._future.set_exception(error)
            else:
                self._future.set_result(None)
        except InvalidStateError:  # already ended
            pass

    def cancel(self, reason: str = "request cancelled by the engine") -> None:
        """Cancel the job's rooms now, so encode workers stop; items not yet received fail.
        A room being written stays WRITING until its writer's outcome (then CANCELLED)."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._receiver._loop.submit(self._receiver._cancel(self, reason))


class ReceiverMetrics:
    def __init__(self, registry: CollectorRegistry, receiver: PrefillReceiver):
        self.items = Counter("epd_prefill_items", "Items by transport and outcome", ["transport", "outcome"],
                             registry=registry)
        self.latency = Histogram("epd_prefill_receive_seconds", "Start of job to item published",
                                 registry=registry)
        self.bytes = Counter("epd_prefill_bytes", "Bytes received", ["transport"], registry=registry)
        self.fallbacks = Counter("epd_prefill_fallbacks", "Items encoded by the local tower", registry=registry)
        Gauge("epd_prefill_pool_leased_slots", "Receive pool slots leased", registry=registry).set_function(
            lambda: receiver.pool.stats()["leased_slots"])
        Gauge("epd_prefill_pool_quarantined_slots", "Receive pool slots in quarantine",
              registry=registry).set_function(lambda: receiver.pool.stats()["quarantined_slots"])


class PrefillReceiver:
    def __init__(self, config: ReceiverConfig, transports: dict | None = None, local_tower=None,
                 registry: CollectorRegistry | None = None):
        self.config = config
        self.pool = SlotPool(_receive_region(config, transports), config.slot_bytes, config.quarantine_s)
        try:
            self.transports = (transports if transports is not None
                               else build_transports(config.transports, mooncake_optional=True))
            if self.pool.region.shm is None:  # /dev/shm had no room: nothing to offer same-node writers
                self.transports = {name: t for name, t in self.transports.items() if name != "shm"}
                if not self.transports:
                    raise MooncakeUnavailable("no transport left: /dev/shm has no room for the pool and "
                                              "Mooncake is not available")
            for transport in self.transports.values():
                transport.register(self.pool.region)
        except BaseException:
            self.pool.region.close()
            raise
        self.local_tower = local_tower
        self.registry = registry or CollectorRegistry()
        self.metrics = ReceiverMetrics(self.registry, self)
        self._clients: dict[tuple[str, int], HandshakeClient] = {}
        self._loop = LoopThread("prefill-receiver")

    def start(self, request_id: str, inputs: MultimodalInputs) -> ReceiveJob:
        job = ReceiveJob(request_id, inputs, self)
        self._loop.submit(self._run(job)).add_done_callback(job._end)
        return job

    def close(self) -> None:
        async def shutdown():
            for client in self._clients.values():
                await client.close()

        try:
            self._loop.run(shutdown(), 10)
        finally:  # whatever the clients did, the pool is unregistered and its segment unlinked
            self._loop.stop(10)
            try:
                for transport in self.transports.values():
                    transport.unregister(self.pool.region)
                    transport.close()
            finally:
                self.pool.region.close()

    # ---- the job, on the receiver's loop ----------------------------------------------------

    def _client(self, handshake: EncodeHandshake) -> HandshakeClient:
        key = (handshake.bootstrap_host, handshake.bootstrap_port)
        client = self._clients.get(key)
        if client is None:
            url = f"http://{handshake.bootstrap_host}:{handshake.bootstrap_port}"
            client = self._clients[key] = HandshakeClient(url, self.config.handshake_token,
                                                          timeout_s=self.config.endpoint_timeout_s, retries=2,
                                                          backoff_s=0.1, retry_timeouts=False)
        return client

    async def _run(self, job: ReceiveJob) -> None:
        pending: list[_Pending] = []
        refused: list[tuple[int, MultimodalDataItem, str]] = []
        unreserved: dict[tuple[str, int], list[int]] = {}  # rooms to cancel, so their workers stop waiting
        rooms: set[tuple[str, int, int]] = set()
        for index, item in enumerate(job.inputs.mm_items):
            if item.encode_handshake is None or item.encoded is not None:
                job.outcomes[index].state = "SKIPPED"
                continue
            handshake = _handshake_or_none(item)
            if handshake is not None:
                room = (handshake.bootstrap_host, handshake.bootstrap_port, handshake.bootstrap_room)
                if room in rooms:  # the room is the earlier item's: refuse this one, leave the room alone
                    refused.append((index, item, f"duplicate room {handshake.bootstrap_room}: an earlier item "
                                                 "of this request names it"))
                    continue
                rooms.add(room)
            try:
                pending.append(self._reserve(index, item))
            except (ValueError, RowContractError, NoCapacity, TooLarge) as exc:
                refused.append((index, item, f"cannot reserve: {exc}"))
                handshake = _handshake_or_none(item)
                if handshake is not None:
                    unreserved.setdefault((handshake.bootstrap_host, handshake.bootstrap_port), []).append(
                        handshake.bootstrap_room)
        by_endpoint: dict[tuple[str, int], list[_Pending]] = {}
        for entry in pending:
            by_endpoint.setdefault((entry.handshake.bootstrap_host, entry.handshake.bootstrap_port), []).append(entry)
        await asyncio.gather(*(self._cancel_rooms(endpoint, rooms, "the receiver could not reserve memory")
                               for endpoint, rooms in unreserved.items()),
                             *(self._give_up(job, index, item, reason, None, quarantine=False)
                               for index, item, reason in refused),
                             *(self._serve_endpoint(job, entries) for entries in by_endpoint.values()))

    def _reserve(self, index: int, item: MultimodalDataItem) -> _Pending:
        handshake = EncodeHandshake(**item.encode_handshake)
        layout = EmbeddingLayout(item_rows(item.offsets), self.config.width, self.config.dtype)
        lease = self.pool.lease(layout.nbytes)  # NoCapacity: refuse now, never wait
        return _Pending(index, item, handshake, layout, lease, time.monotonic() + self.config.item_timeout_s)

    async def _serve_endpoint(self, job: ReceiveJob, entries: list[_Pending]) -> None:
        client = self._client(entries[0].handshake)
        registrations = []
        for entry in entries:
            offers = [t.offer(self.pool, entry.lease) for t in self.transports.values()]
            registrations.append(Registration(room=entry.handshake.bootstrap_room, generation=entry.lease.generation,
                                              rows=entry.layout.rows, width=entry.layout.width,
                                              dtype=entry.layout.dtype, offers=offers,
                                              deadline_s=self.config.item_timeout_s))
        live = {entry.handshake.bootstrap_room: entry for entry in entries}
        first = True
        while live:
            try:
                if first:  # register, and in the same round trip wait for the first change
                    results = await client.register(registrations, wait_s=self.config.poll_s)
                    first = False
                else:
                    results = await client.watch({room: e.version for room, e in live.items()}, self.config.poll_s)
            except HandshakeError as exc:
                # a register that timed out may still have reached the room, so a writer may come:
                # hold the slot whatever round this was
                for entry in list(live.values()):
                    await self._give_up(job, entry.index, entry.item, f"encode worker endpoint unreachable: {exc}",
                                        entry, quarantine=True)
                return
            await self._handle(job, client, live, results)

    async def _cancel(self, job: ReceiveJob, reason: str) -> None:
        by_endpoint: dict[tuple[str, int], list[int]] = {}
        for item, outcome in zip(job.inputs.mm_items, job.outcomes):
            if outcome.state == "PENDING" and item.encode_handshake is not None:
                handshake = EncodeHandshake(**item.encode_handshake)
                by_endpoint.setdefault((handshake.bootstrap_host, handshake.bootstrap_port), []).append(
                    handshake.bootstrap_room)
        await asyncio.gather(*(self._cancel_rooms(endpoint, rooms, reason) for endpoint, rooms in by_endpoint.items()))

    async def _cancel_rooms(self, endpoint: tuple[str, int], rooms: list[int], reason: str) -> None:
        host, port = endpoint
        client = self._client(EncodeHandshake(bootstrap_room=0, bootstrap_host=host, bootstrap_port=port))
        try:
            await client.cancel(rooms, reason)
        except HandshakeError as exc:
            log.warning("cancel of %d rooms at %s:%d failed: %s", len(rooms), host, port, exc)

    async def _handle(self, job: ReceiveJob, client: HandshakeClient, live: dict[int, _Pending], results) -> None:
        now = time.monotonic()
        for result in results:
            entry = live.get(result.room)
            if entry is None:
                continue
            if not result.ok:
                del live[result.room]
                await self._give_up(job, entry.index, entry.item, f"room refused or lost: {result.error}", entry,
                                    quarantine=entry.version > 0)
                continue
            view = result.view
            entry.version = view.version
            if view.state is RoomState.SUCCESS:
                del live[result.room]
                await self._publish(job, entry, view)
            elif view.state.terminal:
                del live[result.room]
                await self._give_up(job, entry.index, entry.item,
                                    f"room {view.state.value}: {view.reason or 'no reason given'}", entry,
                                    quarantine=not view.writer_settled)
            elif now >= entry.deadline:
                del live[result.room]
                try:
                    await client.cancel([result.room], "receiver timed out")
                except HandshakeError:
                    pass
                await self._give_up(job, entry.index, entry.item, "timed out waiting for the encode worker", entry,
                                    quarantine=True)

    async def _publish(self, job: ReceiveJob, entry: _Pending, view) -> None:
        commit = Commit.of(view.commit)
        try:
            rows = accept_commit(self.pool, entry.lease, entry.layout, commit, verify_checksum=False)
            if not self.config.zero_copy:
                rows = rows.clone()  # verified below: the bytes checked are the bytes published
            verify_rows(rows, commit, self.config.require_checksum)
        except ContractError as exc:
            await self._give_up(job, entry.index, entry.item, f"commit rejected: {exc}", entry, quarantine=True)
            return
        grid = view.commit.grid_thw
        known = entry.item.model_specific_data.get("image_grid_thw")
        if grid is not None and known is not None and [int(v) for v in torch.as_tensor(known).reshape(-1)] != list(grid):
            await self._give_up(job, entry.index, entry.item, f"encoder's image_grid_thw {list(grid)} differs from "
                                f"the request's {torch.as_tensor(known).reshape(-1).tolist()}", entry,
                                quarantine=False)
            return
        if self.config.zero_copy:
            with job._held_lock:
                if job._released:  # the engine already let go of this job: nobody will read the view
                    self.pool.release(entry.lease)
                    return
                job._held.append((entry.item, entry.lease))
            self.set_encoded(entry.item, rows)
        else:
            self.pool.release(entry.lease)
            self.set_encoded(entry.item, rows)
        if grid is not None and known is None:
            entry.item.model_specific_data["image_grid_thw"] = torch.tensor([list(grid)])
        outcome = job.outcomes[entry.index]
        outcome.state, outcome.transport, outcome.encoder = "DONE", view.transport, view.commit.timings
        outcome.seconds = time.monotonic() - job.started
        self.metrics.items.labels(view.transport or "unknown", "done").inc()
        self.metrics.bytes.labels(view.transport or "unknown").inc(entry.layout.nbytes)
        self.metrics.latency.observe(outcome.seconds)
        job._settle_if_done()

    def set_encoded(self, item: MultimodalDataItem, rows: torch.Tensor) -> None:
        """``item.encoded`` (and ``encoded_deepstack``) from wire rows."""
        if self.config.deepstack_width:
            item.encoded = rows[:, : rows.shape[1] - self.config.deepstack_width]
            item.encoded_deepstack = rows[:, rows.shape[1] - self.config.deepstack_width :]
        else:
            item.encoded = rows

    async def _give_up(self, job: ReceiveJob, index: int, item: MultimodalDataItem, reason: str,
                       entry: _Pending | None, quarantine: bool) -> None:
        """The room failed: free or quarantine its slot, then fall back or fail the item."""
        if entry is not None:
            (self.pool.quarantine if quarantine else self.pool.release)(entry.lease)
        outcome = job.outcomes[index]
        outcome.seconds = time.monotonic() - job.started
        if self.config.fallback == "local_tower" and self.local_tower is not None and item.feature is not None \
                and not job._cancelled.is_set():
            try:
                rows = await asyncio.get_running_loop().run_in_executor(None, self.encode_locally, item)
                self.set_encoded(item, rows)
                outcome.state, outcome.transport, outcome.fallback = "DONE", "local_tower", True
                outcome.reason = f"fallback after: {reason}"
                self.metrics.fallbacks.inc()
                self.metrics.items.labels("local_tower", "done").inc()
                job._settle_if_done()
                return
            except Exception as exc:  # the fallback failing must not hide the first reason
                reason = f"{reason}; local tower also failed: {exc}"
        outcome.state, outcome.reason = "FAILED", reason
        self.metrics.items.labels("none", "failed").inc()
        job._settle_if_done()

    def encode_locally(self, item: MultimodalDataItem) -> torch.Tensor:
        """Rows for an item from the local tower and the pixels (or image bytes) it kept."""
        (rows,) = self.encode_locally_batch([item])
        return rows

    def encode_locally_batch(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """Rows for several items in one tower call (a colocated engine's path)."""
        from encode_worker.inputs import image_from_bytes, image_from_pixels

        processed = []
        for item in items:
            feature = item.feature
            image = image_from_bytes(feature) if isinstance(feature, (bytes, bytearray)) else image_from_pixels(feature)
            processed.append(self.local_tower.processor(images=[image], return_tensors="pt"))
        rows = self.local_tower.encode_items(torch.cat([p["pixel_values"] for p in processed]),
                                             torch.cat([p["image_grid_thw"] for p in processed]))
        return [r.to(self.local_tower.dtype).clone() for r in rows]


def _receive_region(config: ReceiverConfig, transports: dict | None) -> MemoryRegion:
    """The receive pool's memory: a /dev/shm segment, so same-node writers can map it. When /dev/shm
    has no room for it (ENOSPC) and Mooncake is offered too, process memory instead: Mooncake only,
    said in a warning. With SHM alone, the ENOSPC stands."""
    try:
        return MemoryRegion.shared(config.pool_bytes)
    except ShmError as exc:
        names = set(transports) if transports is not None else set(config.transports)
        if exc.errno != errno.ENOSPC or not names - {"shm"}:
            raise
        log.warning("no room in /dev/shm for the %d-byte receive pool (%s): using process memory, "
                    "Mooncake only (no SHM)", config.pool_bytes, exc.strerror)
        return MemoryRegion.anonymous(config.pool_bytes)


def _handshake_or_none(item: MultimodalDataItem) -> EncodeHandshake | None:
    try:
        return EncodeHandshake(**item.encode_handshake)
    except (TypeError, ValueError):
        return None
