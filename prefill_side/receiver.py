"""The receiver: reserve a slot per item, register it in the item's room, publish verified rows.

One ``PrefillReceiver`` per engine process owns the receive pool and its transports
(``receive_pool``) and the event-loop thread every job runs on. ``start(request_id, mm_inputs)``
returns at once with a ``ReceiveJob`` (``job``); the work runs on the receiver's loop, so the
engine's loop never blocks on HTTP. Per encode-worker endpoint, one room stream carries every
job's registrations and pushes each room's end (``streams``); a room that succeeds is published
(``publish``), one that fails gives its item up (``give_up``: quarantine, the local tower of
``fallback``, or a failed item).

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
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry

from epdserve.data_plane.commit import EmbeddingLayout
from epdserve.data_plane.pool import NoCapacity, TooLarge
from epdserve.loop_threads import LoopThread
from epdserve.multimodal.items import MultimodalDataItem, MultimodalInputs
from epdserve.multimodal.rows import RowContractError, item_rows
from epdserve.wire.addresses import EncodeHandshake, Endpoint
from epdserve.wire.room_signatures import RoomEndpoints
from epdserve.wire.states import ItemState
from prefill_side.endpoints import Endpoints
from prefill_side.fallback import LocalTower
from prefill_side.give_up import GiveUp
from prefill_side.job import PendingItem, ReceiveJob, set_encoded
from prefill_side.metrics import ReceiverMetrics
from prefill_side.publish import Publisher
from prefill_side.receive_pool import ReceivePool
from prefill_side.settings import ReceiverConfig
from prefill_side.streams import EndpointStreams


class PrefillReceiver:
    """The receive pool, the transports and the loop thread every job runs on.

    Ownership: the receiver owns its parts (the pool and transports, the endpoints' clients,
    made and closed on its loop, the loop itself) and drives each job through the job's public
    methods only; ``cancel`` and ``abort`` may be called from any thread and schedule their work
    on the loop.
    """

    def __init__(
        self,
        config: ReceiverConfig,
        transports: dict | None = None,
        local_tower=None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,  # the pool's (its quarantines')
    ):
        self.config = config
        self.receive_pool = ReceivePool(config, transports, clock)
        self.registry = registry or CollectorRegistry()
        self.metrics = ReceiverMetrics(self.registry, self.receive_pool)
        self.local = LocalTower(config, local_tower)
        self.endpoints = Endpoints(config)
        # the room endpoints it calls: those the deployment signed (or loopback, without a token)
        self.room_endpoints = RoomEndpoints(config.handshake_token, config.unsigned_rooms)
        give_up = GiveUp(config, self.pool, self.metrics, self.local)
        self.give_up = give_up
        self.streams = EndpointStreams(
            config,
            self.endpoints,
            self.receive_pool,
            Publisher(config, self.pool, self.metrics),
            give_up,
        )
        self._loop = LoopThread("prefill-receiver")
        self._starting: list[ReceiveJob] = []  # started, their task not made yet
        self._starting_lock = threading.Lock()

    # ---- what an engine calls ----------------------------------------------------------------

    @property
    def pool(self):
        """The receive pool's slots (``data_plane.pool.SlotPool``)."""
        return self.receive_pool.pool

    @property
    def transports(self) -> dict:
        return self.receive_pool.transports

    def start(self, request_id: str, inputs: MultimodalInputs) -> ReceiveJob:
        """The job, started on the receiver's loop (any thread): the jobs started while the loop
        runs one step start in its next, with one wake-up."""
        job = ReceiveJob(request_id, inputs, self.pool, self.cancel, self.abort)
        with self._starting_lock:
            self._starting.append(job)
            if len(self._starting) > 1:  # a wake-up is due already
                return job
        try:
            self._loop.loop.call_soon_threadsafe(self._start_jobs)
        except RuntimeError:  # the receiver is closed: nothing starts
            with self._starting_lock:
                self._starting.remove(job)
            raise
        return job

    def _start_jobs(self) -> None:
        with self._starting_lock:
            jobs, self._starting = self._starting, []
        for job in jobs:
            self._loop.loop.create_task(self._run(job)).add_done_callback(job.ended)

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
        return self.receive_pool.offered()

    def health(self) -> dict:
        """What a health endpoint reports (``ReceivePool.health``)."""
        return self.receive_pool.health()

    def set_encoded(self, item: MultimodalDataItem, rows: torch.Tensor) -> None:
        """``item.encoded`` (and ``encoded_deepstack``) from wire rows."""
        set_encoded(item, rows, self.config.deepstack_width)

    def encode_locally(self, item: MultimodalDataItem) -> torch.Tensor:
        """Rows for an item from the local tower and the pixels (or image bytes) it kept."""
        return self.local.encode(item)

    def encode_locally_batch(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """Rows for several items in one local tower call (``LocalTower.encode_batch``)."""
        return self.local.encode_batch(items)

    def close(self) -> None:
        async def shutdown():
            # jobs still running (a cancel still retrying an endpoint) end here, not with the loop
            running = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await self.streams.close()
            await self.endpoints.close()

        try:
            self._loop.run(shutdown(), 10)
        finally:  # whatever the clients did, the pool is unregistered and its segment unlinked
            self._loop.stop(10)
            self.receive_pool.close()

    # ---- the job, on the receiver's loop ----------------------------------------------------

    async def _run(self, job: ReceiveJob) -> None:
        pending: list[PendingItem] = []
        refused: list[tuple[int, MultimodalDataItem, str]] = []
        unreserved: dict[Endpoint, list[int]] = {}  # rooms to cancel, so their workers stop waiting
        rooms: set[tuple[Endpoint, int]] = set()
        self.receive_pool.check_shm()
        for index, item in enumerate(job.inputs.mm_items):
            if item.encode_handshake is None or item.encoded is not None:
                job.outcomes[index].state = ItemState.SKIPPED
                continue
            try:
                handshake = _room_address(item)
            except (TypeError, ValueError) as exc:  # no room to cancel: the address names none
                refused.append((index, item, f"invalid encode_handshake: {exc}"))
                continue
            vouched = self.room_endpoints.refusal(handshake)
            if vouched is not None:  # nothing is sent there: not a registration, not a cancel
                refused.append((index, item, vouched))
                continue
            room = (handshake.endpoint, handshake.bootstrap_room)
            if room in rooms:  # the room is the earlier item's: refuse this one, leave the room
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
        by_endpoint: dict[Endpoint, list[PendingItem]] = {}
        for entry in pending:
            by_endpoint.setdefault(entry.handshake.endpoint, []).append(entry)
        if not refused and not unreserved and len(by_endpoint) == 1:  # the common case: no gather
            (entries,) = by_endpoint.values()
            await self.streams.serve(job, entries)
            return
        await asyncio.gather(
            *(
                self.streams.cancel_rooms(endpoint, rooms, "the receiver could not reserve memory")
                for endpoint, rooms in unreserved.items()
            ),
            *(
                self.give_up(job, index, item, reason, None, quarantine=False)
                for index, item, reason in refused
            ),
            *(self.streams.serve(job, entries) for entries in by_endpoint.values()),
        )

    def _reserve(
        self, index: int, item: MultimodalDataItem, handshake: EncodeHandshake
    ) -> PendingItem:
        if not self.receive_pool.live():
            lost = self.receive_pool.lost
            raise ValueError(f"no transport left to offer ({'; '.join(lost.values())})")
        layout = EmbeddingLayout(item_rows(item.offsets), self.config.width, self.config.dtype)
        lease = self.pool.lease(layout.nbytes)  # NoCapacity: refuse now, never wait
        return PendingItem(
            index, item, handshake, layout, lease, time.monotonic() + self.config.item_timeout_s
        )

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
                self.streams.cancel_rooms(endpoint, rooms, reason)
                for endpoint, rooms in by_endpoint.items()
            )
        )

    async def _abort(self, job: ReceiveJob, reason: str) -> None:
        for outcome in job.outcomes:
            if outcome.state == ItemState.PENDING:
                outcome.state, outcome.reason = ItemState.FAILED, reason
                outcome.seconds = time.monotonic() - job.started
                self.metrics.failed()
        job.settle_if_done()


def _room_address(item: MultimodalDataItem) -> EncodeHandshake:
    """The item's room address, checked as far as this side can: an ``EncodeHandshake`` (a room id
    a room table mints) and a host that makes a URL. ``ValueError`` (or ``TypeError``) says what is
    wrong."""
    handshake = EncodeHandshake(**item.encode_handshake)
    handshake.url  # raises for a host that makes no URL
    return handshake
