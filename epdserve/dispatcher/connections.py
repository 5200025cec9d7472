"""The dispatcher's connections, each made on first use and kept: one room-API client per endpoint
(``HandshakeClient``), the standalone handshake's rooms over one room stream (``rooms_url``), one
intake client per worker (``AsyncIntakeClient``). Workers come and go (DNS): the clients kept per
endpoint and per worker are bounded by ``MAX_WORKERS``."""

from __future__ import annotations

import asyncio

import yarl

from epdserve.dispatcher.workers import MAX_WORKERS, WorkerAddress, WorkerSet
from epdserve.wire.addresses import Endpoint
from epdserve.wire.intake import AsyncIntakeClient
from epdserve.wire.room_client import HandshakeClient
from handshake.access import RemoteRooms


class WorkerConnections:
    """The room-API, room-stream and intake clients a ``Dispatcher`` talks through."""

    def __init__(
        self,
        workers: WorkerSet,
        rooms_url: str | None,
        handshake_token: str | None,
        intake_timeout_s: float,
    ):
        """``rooms_url``: a standalone room authority; None: rooms at each item's worker."""
        self.workers = workers
        self.rooms_url = rooms_url
        self.handshake_token = handshake_token
        self.intake_timeout_s = intake_timeout_s
        self._rooms: dict[str, HandshakeClient] = {}
        self._authority_rooms: RemoteRooms | None = None  # rooms_url's, over its room stream
        self._intakes: dict[str, AsyncIntakeClient] = {}

    async def close(self) -> None:
        if self._authority_rooms is not None:
            await self._authority_rooms.aclose()
            self._authority_rooms = None
        for client in self._rooms.values():
            await client.close()
        for intake in self._intakes.values():
            intake.close()
        self._rooms.clear()
        self._intakes.clear()

    def room_endpoint(self, address: WorkerAddress) -> tuple[HandshakeClient, Endpoint]:
        """The client of the endpoint ``address``'s rooms live at, and that endpoint."""
        if self.rooms_url is None:
            return self.rooms_client(address.url), address.rooms
        parsed = yarl.URL(self.rooms_url)
        return self.rooms_client(self.rooms_url), Endpoint(parsed.host, parsed.port)

    def authority(self) -> RemoteRooms:
        """The standalone handshake's rooms (``rooms_url``), over one room stream."""
        if self._authority_rooms is None:
            self._authority_rooms = RemoteRooms(
                None, HandshakeClient(self.rooms_url, self.handshake_token, timeout_s=2.0)
            )
        return self._authority_rooms

    def rooms_client(self, url: str) -> HandshakeClient:
        """The room-API client of the endpoint at ``url``."""
        url = str(
            yarl.URL(url)
        )  # one spelling per endpoint (EncodeHandshake.url and WorkerAddress.url)
        client = self._rooms.get(url)
        if client is None:
            if len(self._rooms) >= MAX_WORKERS:  # workers come and go (DNS): drop the oldest client
                asyncio.ensure_future(self._rooms.pop(next(iter(self._rooms))).close())
            client = self._rooms[url] = HandshakeClient(
                url, self.handshake_token, timeout_s=2.0, retries=1
            )
        return client

    def intake(self, address: WorkerAddress) -> AsyncIntakeClient:
        """The intake client of the worker at ``address``."""
        intake = self._intakes.get(address.name)
        if intake is None:
            if len(self._intakes) >= MAX_WORKERS:  # workers come and go (DNS): drop the gone ones
                for name in set(self._intakes) - set(self.workers.status()):
                    self._intakes.pop(name).close()
            intake = self._intakes[address.name] = AsyncIntakeClient(
                address.intake_endpoint, self.intake_timeout_s
            )
        return intake
