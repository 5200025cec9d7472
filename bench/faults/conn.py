"""The lab's clients for one event loop (``Conn``: aiohttp, handshake clients and intake sockets
per role) and the steps of a request they take: minting rooms, sending items to a worker's intake,
posting to a prefill process (its report a ``Posted``), watching rooms and tallying a report
against the reference rows into a ``FaultOutcome``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.cluster import Role
    from bench.faults.lab import FaultLab, FaultOutcome
    from wire.intake import IntakeReply


@dataclass
class Posted:
    sent: float
    returned: float
    status: int
    report: dict

    def row(self, index: int) -> dict:
        return self.report["items"][index]

    def failed_at(self, index: int) -> float:
        """When the prefill process settled item ``index``, on this host's monotonic clock (which
        the prefill process shares: it reports its job's start on it)."""
        return (self.report.get("started_monotonic") or self.sent) + self.row(index)["seconds"]


class Conn:
    """Clients for one event loop: aiohttp, handshake clients and intake sockets per role."""

    def __init__(self, lab: FaultLab):
        self.lab = lab
        self._session = None
        self._rooms: dict[str, object] = {}
        self._intakes: dict[tuple, object] = {}

    async def __aenter__(self) -> Conn:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for client in self._rooms.values():
            await client.close()
        for intake in self._intakes.values():
            intake.close()
        self._rooms.clear()
        self._intakes.clear()
        if self._session is not None:
            await self._session.close()

    def rooms(self, url: str):
        from handshake.client import HandshakeClient

        client = self._rooms.get(url)
        if client is None:
            client = self._rooms[url] = HandshakeClient(url, timeout_s=5.0, retries=2)
        return client

    def intake(self, role: Role):
        from wire.intake import AsyncIntakeClient

        key = (role.name, role.process.pid)
        intake = self._intakes.get(key)
        if intake is None:
            intake = self._intakes[key] = AsyncIntakeClient(
                role.worker.intake_endpoint, timeout_s=10
            )
        return intake

    # ---- the steps of a request ------------------------------------------------------------

    async def mint(self, items, rooms_url: str) -> None:
        """One room per item at ``rooms_url`` (a worker's bootstrap URL or the standalone
        handshake)."""
        from wire.addresses import EncodeHandshake

        host, port = rooms_url.rsplit("/", 1)[-1].rsplit(":", 1)
        rooms = await self.rooms(rooms_url).mint(len(items), 120)
        for item, room in zip(items, rooms):
            item.encode_handshake = EncodeHandshake(
                bootstrap_room=room, bootstrap_host=host, bootstrap_port=int(port)
            )

    async def send(self, worker: Role, item, request_id: str) -> IntakeReply:
        from wire.intake import IntakeRequest

        request = IntakeRequest(
            request_id=f"{request_id}.{item.index}",
            content_hash=item.content_hash,
            encode_handshake=item.encode_handshake,
            source="bytes",
        )
        return await self.intake(worker).send(request, item.data)

    def post(
        self, prefill: Role, request_id: str, items, timeout_s: float = 60.0, body_edit=None
    ) -> asyncio.Task:
        """POST /v1/prefill for ``items`` (as a task: faults are injected while it runs)."""
        from dispatcher.cli import prefill_body

        body = prefill_body(request_id, items, verify=False)
        body["timeout_s"] = timeout_s
        if body_edit is not None:
            body_edit(body)

        async def run() -> Posted:
            sent = time.monotonic()
            async with self._session.post(prefill.url + "/v1/prefill", json=body) as response:
                status = response.status
                report = await response.json(content_type=None)
            return Posted(sent, time.monotonic(), status, report)

        return asyncio.ensure_future(run())

    async def wait_rooms(
        self, url: str, rooms: list[int], until, timeout_s: float = 30.0
    ) -> dict[int, object]:
        """Long-poll ``rooms`` at ``url`` until ``until(views)`` holds, or every room is terminal
        (views by room); the views. ``TimeoutError`` if neither happens within ``timeout_s``."""
        from wire.rooms import RoomState

        client = self.rooms(url)
        versions = dict.fromkeys(rooms, 0)
        views: dict[int, object] = {}
        end = time.monotonic() + timeout_s
        while True:
            results = await client.watch(
                versions, wait_s=max(0.01, min(2.0, end - time.monotonic()))
            )
            for result in results:
                if result.ok:
                    views[result.room] = result.view
                    versions[result.room] = result.view.version
            if until(views):
                return views
            if all(
                v.state is not RoomState.PENDING and v.state.terminal for v in views.values()
            ) and len(views) == len(rooms):
                return views
            if time.monotonic() >= end:
                raise TimeoutError(
                    f"rooms at {url} not as awaited within {timeout_s} s: "
                    f"{ {room: view.state.value for room, view in views.items()} }"
                )

    def tally(
        self,
        outcome: FaultOutcome,
        posted: Posted,
        items,
        affected: dict[int, float],
        expect_reason: str | None = None,
    ) -> FaultOutcome:
        """Fill ``outcome`` from a prefill report: ``affected`` maps item index -> the moment its
        fault became observable; every other item must arrive bit-exact."""
        for index, item in enumerate(items):
            row = posted.row(index)
            if row["state"] == "DONE":
                if row["checksum"] == self.lab.reference(item.data):
                    outcome.delivered += 1
                else:
                    outcome.corrupted += 1
            elif index not in affected:
                outcome.collateral += 1
                outcome.notes.setdefault("collateral_reasons", []).append(row["reason"])
            if index in affected:
                ttf = posted.failed_at(index) - affected[index] if row["state"] != "DONE" else None
                outcome.affected.append(
                    {"index": index, "state": row["state"], "reason": row["reason"], "ttf_s": ttf}
                )
                if (
                    expect_reason is not None
                    and row["state"] != "DONE"
                    and expect_reason not in (row["reason"] or "")
                ):
                    outcome.expected = False
        return outcome
