"""One endpoint's items, to their end: one register call (answered at once with every room) and
then long-polls (answered when a room ends, with the rooms that ended only: ``until_ended``,
``changed_only``), each slice at most ``poll_s``; every other room's deadline checked per answer.
A room that succeeded goes to the publisher, one that failed to the give-up; an endpoint that
cannot be reached fails its items (quarantining their slots: a registration may have landed)."""

from __future__ import annotations

import logging
import time

from prefill_side.endpoints import Endpoints
from prefill_side.give_up import GiveUp
from prefill_side.job import PendingItem, ReceiveJob
from prefill_side.publish import Publisher
from prefill_side.receive_pool import ReceivePool
from prefill_side.settings import ReceiverConfig
from wire.room_client import HandshakeError
from wire.rooms import Registration, RoomState
from wire.states import ItemState

log = logging.getLogger(__name__)


class EndpointRounds:
    def __init__(
        self,
        config: ReceiverConfig,
        endpoints: Endpoints,
        receive_pool: ReceivePool,
        publish: Publisher,
        give_up: GiveUp,
    ):
        self.config = config
        self.endpoints = endpoints
        self.receive_pool = receive_pool
        self.publish = publish
        self.give_up = give_up

    async def serve(self, job: ReceiveJob, entries: list[PendingItem]) -> None:
        """One endpoint's items (at most ``MAX_BATCH``), to their end. Whatever goes wrong here, no
        item is left pending and no slot leased: an unforeseen error fails the items still
        pending and quarantines their slots (a registration may have gone out)."""
        live = {entry.handshake.bootstrap_room: entry for entry in entries}
        try:
            await self._exchange(job, entries, live)
        except Exception as exc:
            log.exception(
                "receive job %s: endpoint %s failed", job.request_id, entries[0].handshake.endpoint
            )
            for entry in entries:
                if job.outcomes[entry.index].state == ItemState.PENDING:
                    await self.give_up(
                        job,
                        entry.index,
                        entry.item,
                        f"receiver error: {type(exc).__name__}: {exc}",
                        entry,
                        quarantine=True,
                    )

    async def _exchange(
        self, job: ReceiveJob, entries: list[PendingItem], live: dict[int, PendingItem]
    ) -> None:
        client = self.endpoints.client(entries[0].handshake.endpoint)
        registrations = [
            Registration(
                room=entry.handshake.bootstrap_room,
                generation=entry.lease.generation,
                rows=entry.layout.rows,
                width=entry.layout.width,
                dtype=entry.layout.dtype,
                offers=self.receive_pool.offers(entry.lease),
                deadline_s=self.config.item_timeout_s,
            )
            for entry in entries
        ]
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
                    await self.give_up(
                        job,
                        entry.index,
                        entry.item,
                        f"encode worker endpoint unreachable: {exc}",
                        entry,
                        quarantine=True,
                    )
                return
            await self._handle(job, live, results)

    async def _handle(self, job: ReceiveJob, live: dict[int, PendingItem], results) -> None:
        now = time.monotonic()
        for result in results:
            entry = live.get(result.room)
            if entry is None:
                continue
            if not result.ok:
                del live[result.room]
                await self.give_up(
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
                await self.publish(job, entry, view)
            elif view.state.terminal:
                del live[result.room]
                await self.give_up(
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
            await self.endpoints.cancel_rooms(
                live[late[0]].handshake.endpoint, late, "receiver timed out"
            )
        for room in late:
            entry = live.pop(room)
            await self.give_up(
                job,
                entry.index,
                entry.item,
                "timed out waiting for the encode worker",
                entry,
                quarantine=True,
            )
