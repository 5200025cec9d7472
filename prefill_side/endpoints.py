"""The encode workers' room APIs as the receiver reaches them: one pooled client per endpoint,
made on the receiver's loop and closed there, and cancelling rooms at an endpoint in calls of
at most ``MAX_BATCH``."""

from __future__ import annotations

import logging

from epdserve.wire.addresses import Endpoint
from epdserve.wire.room_client import HandshakeClient, HandshakeError
from epdserve.wire.rooms import MAX_BATCH
from prefill_side.settings import ReceiverConfig

log = logging.getLogger(__name__)


class Endpoints:
    def __init__(self, config: ReceiverConfig):
        self.config = config
        self._clients: dict[Endpoint, HandshakeClient] = {}

    def client(self, endpoint: Endpoint) -> HandshakeClient:
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

    async def cancel_rooms(self, endpoint: Endpoint, rooms: list[int], reason: str) -> None:
        """Cancel ``rooms`` at ``endpoint`` (so their workers stop); a call that fails is logged:
        the rooms then end at their deadlines."""
        client = self.client(endpoint)
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

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
