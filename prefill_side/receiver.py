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
is already set (chunked prefill), are left alone. A job ends with its last item's outcome, and an
item's outcome, once settled, never changes; every slot a job reserved is released, or quarantined
while a writer may still land bytes in it, whatever path the item took.

If someone unlinks the receive pool's ``/dev/shm`` segment, same-node writers can no longer map it:
the receiver notices at the next job (or health check), stops offering the transports that need it
(``TransportSpec.needs_shm_pool``: SHM), says so once in the log and in ``health()``, and goes on
over its other transports; with none left, ``health()`` says the process cannot receive (restart
it: a new process makes a new pool).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from data_plane.commit import Commit, ContractError, EmbeddingLayout, accept_commit, verify_rows
from data_plane.dtypes import dtype_to_wire
from data_plane.pool import Lease, MemoryRegion, NoCapacity, SlotPool, TooLarge
from data_plane.shm import ShmError
from data_plane.transport import TransportUnavailable, build_transports
from handshake.client import HandshakeClient, HandshakeError
from loop_threads import LoopThread
from metrics import LATENCY_BUCKETS
from multimodal.items import GRID_KEYS, MultimodalDataItem, MultimodalInputs
from multimodal.rows import RowContractError, item_rows
from wire.addresses import EncodeHandshake, Endpoint
from wire.offers import DTYPE_NAMES, MAX_WIDTH, transport_spec
from wire.rooms import (
    MAX_BATCH,
    MAX_DEADLINE_S,
    MAX_WAIT_S,
    EncodeTimings,
    Registration,
    RoomState,
)
from wire.states import ItemState, JobState

log = logging.getLogger(__name__)


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

    def __post_init__(self) -> None:
        """Refuse now what would fail every item later, at its registration or its long-poll."""
        problems = [
            problem
            for bad, problem in (
                (not 0 < self.width <= MAX_WIDTH, f"width {self.width} is not in 1..{MAX_WIDTH}"),
                (
                    self.dtype not in DTYPE_NAMES,
                    f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_NAMES)}",
                ),
                (
                    not 0 <= self.deepstack_width < self.width,
                    f"deepstack_width {self.deepstack_width} is not in 0..width-1",
                ),
                (
                    not 0 < self.item_timeout_s <= MAX_DEADLINE_S,
                    f"item_timeout_s {self.item_timeout_s} is not in "
                    f"(0, {MAX_DEADLINE_S}] (a room's deadline)",
                ),
                (
                    not 0 < self.poll_s <= MAX_WAIT_S,
                    f"poll_s {self.poll_s} is not in (0, {MAX_WAIT_S}] (a long-poll)",
                ),
                (
                    not self.endpoint_timeout_s > 0,
                    f"endpoint_timeout_s {self.endpoint_timeout_s} is not above 0",
                ),
                (
                    self.fallback not in ("fail", "local_tower"),
                    f"fallback {self.fallback!r} is not fail or local_tower",
                ),
                (not self.transports, "no transport given"),
            )
            if bad
        ]
        if problems:
            raise ValueError("ReceiverConfig: " + "; ".join(problems))


@dataclass
class ItemOutcome:
    index: int
    state: ItemState = ItemState.PENDING
    transport: str | None = None
    reason: str | None = None
    seconds: float = 0.0  # job start -> published (or failed)
    fallback: bool = False
    encoder: EncodeTimings | None = (
        None  # where the time went on the encode worker, from its commit
    )


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
    """One request's items, as the engine sees them while the receiver fills them.

    Ownership: the job owns its future, its cancelled flag and the zero-copy leases it holds; the
    receiver changes them only through ``hold``, ``mark_cancelled``, ``settle_if_done`` and
    ``ended``. ``outcomes`` is written by the receiver's loop thread alone while the job runs (an
    item's outcome, once settled, never changes); the engine's threads read it, and call ``poll``,
    ``wait``, ``cancel``, ``abort`` and ``release``. ``_held`` and ``_released`` are guarded by
    ``_lock`` (the loop adds to ``_held``; ``release``, from any thread, empties it); ``_cancelled``
    is set once, from any thread, under the same lock.
    """

    def __init__(self, request_id: str, inputs: MultimodalInputs, receiver: PrefillReceiver):
        self.request_id = request_id
        self.inputs = inputs
        self.outcomes = [ItemOutcome(i) for i in range(len(inputs.mm_items))]
        self._receiver = receiver
        self._future = Future()  # done as soon as every item is settled (or the job's task crashed)
        self._cancelled = threading.Event()
        self._held: list[
            tuple[MultimodalDataItem, Lease]
        ] = []  # zero-copy slots behind published views
        self._lock = threading.Lock()
        self._released = False
        self.started = time.monotonic()

    def poll(self) -> JobState:
        """Non-blocking: PENDING until every item is DONE (or skipped), or FAILED."""
        if not self._future.done():
            return JobState.PENDING
        return (
            JobState.FAILED
            if any(o.state == ItemState.FAILED for o in self.outcomes)
            else JobState.DONE
        )

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
        return {o.index: o.reason for o in self.outcomes if o.state == ItemState.FAILED}

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel`` (or ``abort``) was asked: no item falls back to the local tower
        then."""
        return self._cancelled.is_set()

    def mark_cancelled(self) -> bool:
        """Set the cancelled flag (any thread); True for the one call that set it."""
        with self._lock:
            first = not self._cancelled.is_set()
            self._cancelled.set()
        return first

    def hold(self, item: MultimodalDataItem, lease: Lease) -> bool:
        """Zero-copy, on the receiver's loop: keep ``lease`` (the slot behind ``item``'s rows) until
        ``release``. False when the engine already released the job: nobody will read the rows,
        and the caller frees the lease."""
        with self._lock:
            if self._released:
                return False
            self._held.append((item, lease))
        return True

    def release(self) -> None:
        """Zero-copy mode: the engine is done with the items' ``encoded`` views; free their slots
        (and clear ``encoded``, so nothing reads a slot its next tenant writes). Idempotent."""
        with self._lock:
            held, self._held, self._released = self._held, [], True
        for item, lease in held:
            item.encoded = item.encoded_deepstack = None
            self._receiver.pool.release(lease)

    def settle_if_done(self) -> None:
        """On the receiver's loop, after an item's outcome is final: the job ends with its last
        item, not when its coroutines have unwound (that took ~80 us more here)."""
        if all(outcome.state != ItemState.PENDING for outcome in self.outcomes):
            self.ended()

    def ended(self, task: Future | None = None) -> None:
        """End the job (its future completes); a second call changes nothing. As the done-callback
        of the job's task (``task`` given), a task that crashed or was cancelled ends the job with
        that error."""
        error = None
        if task is not None:
            error = (
                RuntimeError("the receive job's task was cancelled")
                if task.cancelled()
                else task.exception()
            )
        try:
            if error is not None:
                self._future.set_exception(error)
            else:
                self._future.set_result(None)
        except InvalidStateError:  # already ended: its first end stands
            return

    def cancel(self, reason: str = "request cancelled by the engine") -> None:
        """Cancel the job's rooms now, so encode workers stop; items not yet received fail.
        A room being written stays WRITING until its writer's outcome (then CANCELLED)."""
        self._receiver.cancel(self, reason)

    def abort(self, reason: str) -> None:
        """``cancel``, and fail every item not yet settled now with ``reason`` (for a caller that
        stops waiting: a request's timeout). The job ends at once; the slots of those items are
        still released, or quarantined, when their rooms end."""
        self._receiver.abort(self, reason)


class ReceiverMetrics:
    def __init__(self, registry: CollectorRegistry, receiver: PrefillReceiver):
        self.items = Counter(
            "epd_prefill_items",
            "Items by transport and outcome",
            ["transport", "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "epd_prefill_receive_seconds",
            "Start of job to item published",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.bytes = Counter(
            "epd_prefill_bytes", "Bytes received", ["transport"], registry=registry
        )
        self.fallbacks = Counter(
            "epd_prefill_fallbacks", "Items encoded by the local tower", registry=registry
        )
        Gauge(
            "epd_prefill_pool_leased_slots", "Receive pool slots leased", registry=registry
        ).set_function(lambda: receiver.pool.stats()["leased_slots"])
        Gauge(
            "epd_prefill_pool_quarantined_slots",
            "Receive pool slots in quarantine",
            registry=registry,
        ).set_function(lambda: receiver.pool.stats()["quarantined_slots"])
        self.transports = Gauge(
            "epd_prefill_transport_offered",
            "1 while the transport is offered to writers, "
            "0 once lost (the SHM pool segment unlinked)",
            ["transport"],
            registry=registry,
        )


class PrefillReceiver:
    """The receive pool, the transports and the loop thread every job runs on.

    Ownership: the receiver owns the pool, the transports, ``lost`` (replaced whole under
    ``_lost_lock``, by whichever thread notices the segment gone), the handshake clients (created
    and closed on its loop thread) and the loop. It drives each job through the job's public
    methods only; ``cancel`` and ``abort`` may be called from any thread and schedule their work
    on the loop.
    """

    def __init__(
        self,
        config: ReceiverConfig,
        transports: dict | None = None,
        local_tower=None,
        registry: CollectorRegistry | None = None,
    ):
        self.config = config
        self.pool = SlotPool(
            _receive_region(config, transports), config.slot_bytes, config.quarantine_s
        )
        try:
            self.transports = (
                transports
                if transports is not None
                else build_transports(config.transports, optional=True)
            )
            if (
                self.pool.region.shm is None
            ):  # /dev/shm had no room: nothing to offer same-node writers
                self.transports = {
                    name: t
                    for name, t in self.transports.items()
                    if not transport_spec(name).needs_shm_pool
                }
                if not self.transports:
                    raise TransportUnavailable(
                        "no transport left: /dev/shm has no room for the pool and "
                        "no transport without it is available"
                    )
            for transport in self.transports.values():
                transport.register(self.pool.region)
        except BaseException:
            self.pool.region.close()
            raise
        self.local_tower = local_tower
        self.registry = registry or CollectorRegistry()
        self.metrics = ReceiverMetrics(self.registry, self)
        self.lost: dict[str, str] = {}  # transports no longer offered, with why
        # offered only while the pool's /dev/shm segment is linked
        self._shm_bound = tuple(
            name for name in self.transports if transport_spec(name).needs_shm_pool
        )
        for name in self.transports:
            self.metrics.transports.labels(name).set(1)
        self._lost_lock = threading.Lock()
        self._clients: dict[Endpoint, HandshakeClient] = {}
        self._loop = LoopThread("prefill-receiver")

    def start(self, request_id: str, inputs: MultimodalInputs) -> ReceiveJob:
        job = ReceiveJob(request_id, inputs, self)
        self._loop.submit(self._run(job)).add_done_callback(job.ended)
        return job

    def cancel(self, job: ReceiveJob, reason: str) -> None:
        """Cancel ``job``'s rooms that are still pending (once per job; any thread): scheduled on
        the loop, so encode workers stop; their items fail as their rooms end."""
        if job.mark_cancelled():
            self._loop.submit(self._cancel(job, reason))

    def abort(self, job: ReceiveJob, reason: str) -> None:
        """``cancel``, then fail ``job``'s unsettled items with ``reason`` on the loop (any
        thread)."""
        self.cancel(job, reason)
        self._loop.submit(self._abort(job, reason))

    def offered(self) -> list[str]:
        """The transports this receiver offers writers now (SHM leaves once its segment is gone)."""
        self._check_shm()
        return [name for name in self.transports if name not in self.lost]

    def health(self) -> dict:
        """What a health endpoint reports: the transports offered and lost, the pool's slots, and
        ``cannot_receive`` / ``not_ready``: why the process cannot receive at all (no transport
        left: only a restart helps), or cannot take an item now (no free slot), else None."""
        offered = self.offered()
        stats = self.pool.stats()
        cannot_receive = (
            None if offered else f"no transport left to offer: {'; '.join(self.lost.values())}"
        )
        not_ready = cannot_receive or (
            f"receive pool exhausted: 0 of {stats['slots']} slots free ({stats['leased_slots']} "
            "leased, "
            f"{stats['quarantined_slots']} quarantined)"
            if stats["free_slots"] == 0
            else None
        )
        return {
            "transports": offered,
            "lost": dict(self.lost),
            "pool": stats,
            "cannot_receive": cannot_receive,
            "not_ready": not_ready,
        }

    def _check_shm(self) -> None:
        """Stop offering the transports that need the pool's ``/dev/shm`` segment once ``/dev/shm``
        no longer names it (said once)."""
        if not self._shm_bound or self._shm_bound[0] in self.lost or self.pool.region.shm_linked():
            return
        with self._lost_lock:
            if self._shm_bound[0] in self.lost:
                return
            reason = (
                f"the receive pool's SHM segment {self.pool.region.shm.name} is gone from /dev/shm "
                "(unlinked by someone else): same-node writers cannot map it"
            )
            self.lost = {**self.lost, **dict.fromkeys(self._shm_bound, reason)}
        for name in self._shm_bound:
            self.metrics.transports.labels(name).set(0)
        others = [name for name in self.transports if name not in self.lost]
        log.warning(
            "%s; %s no longer offered, %s",
            reason,
            ", ".join(self._shm_bound),
            f"receiving over {', '.join(others)}"
            if others
            else "and no transport is left: restart this process",
        )

    def close(self) -> None:
        async def shutdown():
            # jobs still running (a cancel still retrying an endpoint) end here, not with the loop
            running = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
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

    def _client(self, endpoint: Endpoint) -> HandshakeClient:
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = HandshakeClient(
                endpoint.url("http"),
                self.config.handshake_token,
                timeout_s=self.config.endpoint_timeout_s,
                retries=2,
                backoff_s=0.1,
                retry_timeouts=False,
            )
        return client

    async def _run(self, job: ReceiveJob) -> None:
        pending: list[_Pending] = []
        refused: list[tuple[int, MultimodalDataItem, str]] = []
        unreserved: dict[Endpoint, list[int]] = {}  # rooms to cancel, so their workers stop waiting
        rooms: set[tuple[Endpoint, int]] = set()
        self._check_shm()
        for index, item in enumerate(job.inputs.mm_items):
            if item.encode_handshake is None or item.encoded is not None:
                job.outcomes[index].state = ItemState.SKIPPED
                continue
            try:
                handshake = _room_address(item)
            except (TypeError, ValueError) as exc:  # no room to cancel: the address names none
                refused.append((index, item, f"invalid encode_handshake: {exc}"))
                continue
            room = (handshake.endpoint, handshake.bootstrap_room)
            if (
                room in rooms
            ):  # the room is the earlier item's: refuse this one, leave the room alone
                refused.append(
                    (
                        index,
                        item,
                        f"duplicate room {handshake.bootstrap_room}: an earlier item "
                        "of this request names it",
                    )
                )
                continue
            rooms.add(room)
            try:
                pending.append(self._reserve(index, item, handshake))
            except (TypeError, ValueError, RowContractError, NoCapacity, TooLarge) as exc:
                refused.append((index, item, f"cannot reserve: {exc}"))
                unreserved.setdefault(handshake.endpoint, []).append(handshake.bootstrap_room)
        by_endpoint: dict[Endpoint, list[_Pending]] = {}
        for entry in pending:
            by_endpoint.setdefault(entry.handshake.endpoint, []).append(entry)
        await asyncio.gather(
            *(
                self._cancel_rooms(endpoint, rooms, "the receiver could not reserve memory")
                for endpoint, rooms in unreserved.items()
            ),
            *(
                self._give_up(job, index, item, reason, None, quarantine=False)
                for index, item, reason in refused
            ),
            *(
                self._serve_endpoint(job, entries[start : start + MAX_BATCH])  # a call's bound
                for entries in by_endpoint.values()
                for start in range(0, len(entries), MAX_BATCH)
            ),
        )

    def _reserve(
        self, index: int, item: MultimodalDataItem, handshake: EncodeHandshake
    ) -> _Pending:
        if not any(name not in self.lost for name in self.transports):
            raise ValueError(f"no transport left to offer ({'; '.join(self.lost.values())})")
        layout = EmbeddingLayout(item_rows(item.offsets), self.config.width, self.config.dtype)
        lease = self.pool.lease(layout.nbytes)  # NoCapacity: refuse now, never wait
        return _Pending(
            index, item, handshake, layout, lease, time.monotonic() + self.config.item_timeout_s
        )

    async def _serve_endpoint(self, job: ReceiveJob, entries: list[_Pending]) -> None:
        """One endpoint's items, to their end. Whatever goes wrong here, no item is left pending
        and no slot leased: an unforeseen error fails the items still pending and quarantines
        their slots (a registration may have gone out)."""
        live = {entry.handshake.bootstrap_room: entry for entry in entries}
        try:
            await self._exchange(job, entries, live)
        except Exception as exc:
            log.exception(
                "receive job %s: endpoint %s failed", job.request_id, entries[0].handshake.endpoint
            )
            for entry in entries:
                if job.outcomes[entry.index].state == ItemState.PENDING:
                    await self._give_up(
                        job,
                        entry.index,
                        entry.item,
                        f"receiver error: {type(exc).__name__}: {exc}",
                        entry,
                        quarantine=True,
                    )

    async def _exchange(
        self, job: ReceiveJob, entries: list[_Pending], live: dict[int, _Pending]
    ) -> None:
        client = self._client(entries[0].handshake.endpoint)
        registrations = []
        for entry in entries:
            offers = [
                t.offer(self.pool, entry.lease)
                for name, t in self.transports.items()
                if name not in self.lost
            ]
            registrations.append(
                Registration(
                    room=entry.handshake.bootstrap_room,
                    generation=entry.lease.generation,
                    rows=entry.layout.rows,
                    width=entry.layout.width,
                    dtype=entry.layout.dtype,
                    offers=offers,
                    deadline_s=self.config.item_timeout_s,
                )
            )
        first = True
        while live:
            try:
                # Each answer comes when a room ends or after poll_s (the deadlines are checked
                # then): a write that begins is nothing to act on here.
                if first:  # register, and in the same round trip wait
                    results = await client.register(
                        registrations,  # answered with every room: each one's version
                        wait_s=self.config.poll_s,
                        until_ended=True,
                    )
                    first = False
                else:
                    results = await client.watch(
                        {room: e.version for room, e in live.items()},
                        self.config.poll_s,
                        until_ended=True,
                        changed_only=True,
                    )
            except HandshakeError as exc:
                # a register that timed out may still have reached the room, so a writer may come:
                # hold the slot whatever round this was
                for entry in list(live.values()):
                    await self._give_up(
                        job,
                        entry.index,
                        entry.item,
                        f"encode worker endpoint unreachable: {exc}",
                        entry,
                        quarantine=True,
                    )
                return
            await self._handle(job, live, results)

    async def _cancel(self, job: ReceiveJob, reason: str) -> None:
        by_endpoint: dict[Endpoint, list[int]] = {}
        for item, outcome in zip(job.inputs.mm_items, job.outcomes):
            if outcome.state == ItemState.PENDING and item.encode_handshake is not None:
                try:
                    handshake = _room_address(item)
                except (TypeError, ValueError):  # refused at the start: it names no room
                    continue
                by_endpoint.setdefault(handshake.endpoint, []).append(handshake.bootstrap_room)
        await asyncio.gather(
            *(
                self._cancel_rooms(endpoint, rooms, reason)
                for endpoint, rooms in by_endpoint.items()
            )
        )

    async def _abort(self, job: ReceiveJob, reason: str) -> None:
        for outcome in job.outcomes:
            if outcome.state == ItemState.PENDING:
                outcome.state, outcome.reason = ItemState.FAILED, reason
                outcome.seconds = time.monotonic() - job.started
                self.metrics.items.labels("none", "failed").inc()
        job.settle_if_done()

    async def _cancel_rooms(self, endpoint: Endpoint, rooms: list[int], reason: str) -> None:
        client = self._client(endpoint)
        for start in range(0, len(rooms), MAX_BATCH):  # a call's bound
            try:
                await client.cancel(rooms[start : start + MAX_BATCH], reason)
            except HandshakeError as exc:
                log.warning(
                    "cancel of %d rooms at %s failed: %s",
                    len(rooms[start : start + MAX_BATCH]),
                    endpoint,
                    exc,
                )

    async def _handle(self, job: ReceiveJob, live: dict[int, _Pending], results) -> None:
        now = time.monotonic()
        for result in results:
            entry = live.get(result.room)
            if entry is None:
                continue
            if not result.ok:
                del live[result.room]
                await self._give_up(
                    job,
                    entry.index,
                    entry.item,
                    f"room refused or lost: {result.error}",
                    entry,
                    quarantine=entry.version > 0,
                )
                continue
            view = result.view
            entry.version = view.version
            if view.state is RoomState.SUCCESS:
                del live[result.room]
                await self._publish(job, entry, view)
            elif view.state.terminal:
                del live[result.room]
                await self._give_up(
                    job,
                    entry.index,
                    entry.item,
                    f"room {view.state.value}: {view.reason or 'no reason given'}",
                    entry,
                    quarantine=not view.writer_settled,
                )
        # the answer holds the rooms with news only: every other one is checked against its deadline
        late = [room for room, entry in live.items() if now >= entry.deadline]
        if late:
            await self._cancel_rooms(live[late[0]].handshake.endpoint, late, "receiver timed out")
        for room in late:
            entry = live.pop(room)
            await self._give_up(
                job,
                entry.index,
                entry.item,
                "timed out waiting for the encode worker",
                entry,
                quarantine=True,
            )

    async def _publish(self, job: ReceiveJob, entry: _Pending, view) -> None:
        if (
            job.outcomes[entry.index].state != ItemState.PENDING
        ):  # aborted: the writer is done, nobody reads the rows
            self.pool.release(entry.lease)
            return
        commit = Commit.of(view.commit)
        try:
            rows = accept_commit(
                self.pool, entry.lease, entry.layout, commit, verify_checksum=False
            )
            if not self.config.zero_copy:
                rows = rows.clone()  # verified below: the bytes checked are the bytes published
            verify_rows(rows, commit, self.config.require_checksum)
        except ContractError as exc:
            await self._give_up(
                job, entry.index, entry.item, f"commit rejected: {exc}", entry, quarantine=True
            )
            return
        grid = view.commit.grid_thw
        grid_key = GRID_KEYS.get(entry.item.modality)
        known = entry.item.model_specific_data.get(grid_key) if grid_key else None
        if (
            grid is not None
            and known is not None
            and [int(v) for v in torch.as_tensor(known).reshape(-1)] != list(grid)
        ):
            await self._give_up(
                job,
                entry.index,
                entry.item,
                f"encoder's {grid_key} {list(grid)} differs from "
                f"the request's {torch.as_tensor(known).reshape(-1).tolist()}",
                entry,
                quarantine=False,
            )
            return
        if self.config.zero_copy:
            if not job.hold(
                entry.item, entry.lease
            ):  # the engine already let go: nobody reads the view
                self.pool.release(entry.lease)
                return
            self.set_encoded(entry.item, rows)
        else:
            self.pool.release(entry.lease)
            self.set_encoded(entry.item, rows)
        if grid is not None and known is None and grid_key:
            entry.item.model_specific_data[grid_key] = torch.tensor([list(grid)])
        outcome = job.outcomes[entry.index]
        outcome.state, outcome.transport, outcome.encoder = (
            ItemState.DONE,
            view.transport,
            view.commit.timings,
        )
        outcome.seconds = time.monotonic() - job.started
        self.metrics.items.labels(view.transport or "unknown", "done").inc()
        self.metrics.bytes.labels(view.transport or "unknown").inc(entry.layout.nbytes)
        self.metrics.latency.observe(outcome.seconds)
        job.settle_if_done()

    def set_encoded(self, item: MultimodalDataItem, rows: torch.Tensor) -> None:
        """``item.encoded`` (and ``encoded_deepstack``) from wire rows."""
        if self.config.deepstack_width:
            item.encoded = rows[:, : rows.shape[1] - self.config.deepstack_width]
            item.encoded_deepstack = rows[:, rows.shape[1] - self.config.deepstack_width :]
        else:
            item.encoded = rows

    async def _give_up(
        self,
        job: ReceiveJob,
        index: int,
        item: MultimodalDataItem,
        reason: str,
        entry: _Pending | None,
        quarantine: bool,
    ) -> None:
        """The room failed: free or quarantine its slot, then fall back or fail the item."""
        if entry is not None:
            (self.pool.quarantine if quarantine else self.pool.release)(entry.lease)
        outcome = job.outcomes[index]
        if outcome.state != ItemState.PENDING:  # aborted already: its outcome stands
            return
        outcome.seconds = time.monotonic() - job.started
        if (
            self.config.fallback == "local_tower"
            and self.local_tower is not None
            and item.feature is not None
            and not job.cancelled
        ):
            try:
                rows = await asyncio.get_running_loop().run_in_executor(
                    None, self.encode_locally, item
                )
                if outcome.state != ItemState.PENDING:  # aborted while the tower ran
                    return
                self.set_encoded(item, rows)
                outcome.state, outcome.transport, outcome.fallback = (
                    ItemState.DONE,
                    "local_tower",
                    True,
                )
                outcome.reason = f"fallback after: {reason}"
                self.metrics.fallbacks.inc()
                self.metrics.items.labels("local_tower", "done").inc()
                job.settle_if_done()
                return
            except Exception as exc:  # the fallback failing must not hide the first reason
                reason = f"{reason}; local tower also failed: {exc}"
        outcome.state, outcome.reason = ItemState.FAILED, reason
        self.metrics.items.labels("none", "failed").inc()
        job.settle_if_done()

    def encode_locally(self, item: MultimodalDataItem) -> torch.Tensor:
        """Rows for an item from the local tower and the pixels (or image bytes) it kept."""
        (rows,) = self.encode_locally_batch([item])
        return rows

    def encode_locally_batch(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """Rows for several items in one tower call (a colocated engine's path). The row contract
        holds here as on the wire: ``RowContractError``, before the tower runs, for an item whose
        image makes other rows than its placeholders hold, or another patch grid than the one it
        carries, or for a tower whose rows are not this receiver's width and dtype."""
        from encode_worker.inputs import image_from_bytes, image_from_pixels

        tower = self.local_tower
        if (tower.info.wire_width, dtype_to_wire(tower.dtype)) != (
            self.config.width,
            self.config.dtype,
        ):
            raise RowContractError(
                f"the local tower makes [*, {tower.info.wire_width}] {dtype_to_wire(tower.dtype)} "
                f"rows, this receiver takes [*, {self.config.width}] {self.config.dtype}"
            )
        processed = []
        for item in items:
            feature = item.feature
            image = (
                image_from_bytes(feature)
                if isinstance(feature, (bytes, bytearray))
                else image_from_pixels(feature)
            )
            inputs = tower.processor(images=[image], return_tensors="pt")
            grid = inputs["image_grid_thw"]
            (rows,) = tower.rows_per_item(grid)
            placeholders = item_rows(item.offsets)
            if rows != placeholders:
                raise RowContractError(
                    f"the image makes {rows} rows (grid {grid.reshape(-1).tolist()}) but the "
                    f"item's placeholders hold {placeholders}"
                )
            known = item.model_specific_data.get("image_grid_thw")
            if (
                known is not None
                and torch.as_tensor(known).reshape(-1).tolist() != grid.reshape(-1).tolist()
            ):
                raise RowContractError(
                    f"the image's grid {grid.reshape(-1).tolist()} differs from the item's "
                    f"image_grid_thw {torch.as_tensor(known).reshape(-1).tolist()}"
                )
            processed.append(inputs)
        rows = tower.encode_items(
            torch.cat([p["pixel_values"] for p in processed]),
            torch.cat([p["image_grid_thw"] for p in processed]),
        )
        return [r.to(tower.dtype).clone() for r in rows]


def _receive_region(config: ReceiverConfig, transports: dict | None) -> MemoryRegion:
    """The receive pool's memory: a /dev/shm segment, so same-node writers can map it. When /dev/shm
    has no room for it (ENOSPC) and a transport that does not need the segment is offered too
    (Mooncake), process memory instead, said in a warning. With only transports that need it (SHM),
    the ENOSPC stands."""
    try:
        return MemoryRegion.shared(config.pool_bytes)
    except ShmError as exc:
        names = list(transports) if transports is not None else list(config.transports)
        others = [name for name in names if not transport_spec(name).needs_shm_pool]
        if exc.errno != errno.ENOSPC or not others:
            raise
        log.warning(
            "no room in /dev/shm for the %d-byte receive pool (%s): using process memory, "
            "%s only (no SHM)",
            config.pool_bytes,
            exc.strerror,
            ", ".join(others),
        )
        return MemoryRegion.anonymous(config.pool_bytes)


def _room_address(item: MultimodalDataItem) -> EncodeHandshake:
    """The item's room address, checked as far as this side can: an ``EncodeHandshake`` (a room id
    a room table mints) and a host that makes a URL. ``ValueError`` (or ``TypeError``) says what is
    wrong."""
    handshake = EncodeHandshake(**item.encode_handshake)
    handshake.url  # raises for a host that makes no URL
    return handshake
