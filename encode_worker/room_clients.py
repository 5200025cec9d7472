"""The encode worker's reach to rooms: its own table in-process, every other endpoint over one
pooled aiohttp client per endpoint on the handshake loop (no thread per endpoint); failing an
item's room without waiting on the network; the rooms with an item in flight here; and the
rate-limited per-item log.

Failing a room never blocks its caller (intake, the stages): another endpoint's room is failed by
a call on the loop, bounded in number (``MAX_PENDING_FAILS``) and in time (``room_timeout_s``), so
a silent endpoint holds up nothing but its own rooms.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable

from encode_worker.scheduler import EncodeJob
from epdserve.loop_threads import LoopThread
from epdserve.wire.addresses import EncodeHandshake, Endpoint, canonical_host
from epdserve.wire.modality import Modality
from epdserve.wire.room_client import HandshakeClient
from epdserve.wire.room_signatures import RoomEndpoints, UnsignedRooms
from epdserve.wire.rooms import FailBody
from handshake.access import LocalRooms, RemoteRooms
from handshake.rooms import RoomError, RoomTable

log = logging.getLogger(__name__)
LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "::1"}
MAX_ENDPOINTS = 256  # room endpoints with a pooled client; the oldest is closed beyond
MAX_PENDING_FAILS = (
    1024  # room-fail calls to other endpoints in flight; beyond, the room is left to expire
)


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
            message, args = (
                message + " (%d more such lines left out before this one)",
                (*args, dropped),
            )
        self.logger.warning(message, *args)


class InFlightRooms:
    """Rooms with an item accepted here and not yet ended. A second message for one of them is
    refused: two writers for one slot would race, and the later one could land after the receiver
    handed the slot to a new tenant. Intake claims; the room's end (its outcome, or a failure)
    releases. Bounded by the items in flight."""

    def __init__(self):
        self._rooms: set[int] = set()
        self._lock = threading.Lock()

    def claim(self, room: int) -> bool:
        """True when the room had no item in flight (it has one now)."""
        with self._lock:
            if room in self._rooms:
                return False
            self._rooms.add(room)
            return True

    def release(self, room: int) -> None:
        with self._lock:
            self._rooms.discard(room)


class RoomClients:
    """Where an item's room lives: this worker's own table, or a pooled client of its endpoint
    (any thread). The pool holds at most ``MAX_ENDPOINTS`` clients, the oldest closed first."""

    def __init__(
        self,
        table: RoomTable,
        loop: LoopThread,
        host: str,
        local_port: Callable[[], int],
        token: str | None,
        timeout_s: float,
        unsigned_rooms: UnsignedRooms = "loopback",
    ):
        self.table = table
        self.loop = loop
        self._local_hosts = LOCAL_HOSTS | {canonical_host(host)}
        self._local_port = local_port  # the bootstrap port, known once the server listens
        self._bootstrap_port = 0
        self._local_rooms = LocalRooms(table)
        self._token = token
        self._endpoints = RoomEndpoints(token, unsigned_rooms)
        self._timeout_s = timeout_s
        self._remote: dict[Endpoint, RemoteRooms] = {}
        self._lock = threading.Lock()

    @property
    def bootstrap_port(self) -> int:
        """Asked once the server listens (0 before), then kept."""
        if not self._bootstrap_port:
            self._bootstrap_port = self._local_port()
        return self._bootstrap_port

    def is_local(self, handshake: EncodeHandshake) -> bool:
        key = handshake.endpoint
        return key.host in self._local_hosts and key.port == self.bootstrap_port

    def refusal(self, handshake: EncodeHandshake) -> str | None:
        """Why a room at another endpoint must not be reached (nothing is sent there), or None:
        this worker's own, or signed by the deployment (``wire.room_signatures``)."""
        return None if self.is_local(handshake) else self._endpoints.refusal(handshake)

    def __call__(self, handshake: EncodeHandshake) -> LocalRooms | RemoteRooms:
        key = handshake.endpoint
        if self.is_local(handshake):
            return self._local_rooms
        with self._lock:
            remote = self._remote.get(key)
            if remote is None:
                if len(self._remote) >= MAX_ENDPOINTS:
                    self._remote.pop(next(iter(self._remote))).close()  # the first endpoint added
                client = HandshakeClient(
                    handshake.url, token=self._token, timeout_s=self._timeout_s
                )
                remote = self._remote[key] = RemoteRooms(self.loop, client)
            return remote

    def close(self) -> None:
        """Close every pooled client (the loop still running)."""
        with self._lock:
            remotes, self._remote = list(self._remote.values()), {}
        concurrent.futures.wait([remote.close() for remote in remotes], 5)


class RoomFailer:
    """Fails an item's room with a reason without waiting on the network: this worker's own rooms
    at once, another endpoint's by a call on the loop. Each failure ends the room's item here
    (``InFlightRooms``) and counts it (``on_failed``, with the item's modality)."""

    def __init__(
        self,
        rooms: RoomClients,
        in_flight: InFlightRooms,
        on_failed: Callable[[str], None],
        item_log: RateLimitedLog,
        timeout_s: float,
    ):
        self.rooms = rooms
        self.in_flight = in_flight
        self.on_failed = on_failed
        self.item_log = item_log
        self.timeout_s = timeout_s
        self._failing: set[concurrent.futures.Future] = set()  # calls to other endpoints, in flight
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Calls failing rooms at other endpoints, still in flight."""
        with self._lock:
            return len(self._failing)

    def fail(
        self, handshake: EncodeHandshake, reason: str, modality: Modality, counted: bool = True
    ) -> None:
        """``counted=False``: intake's own refusal of a bad item, counted as intake's answer
        rather than as an accepted item's end."""
        room = handshake.bootstrap_room
        self.in_flight.release(room)
        if counted:
            self.on_failed(modality)
        self.item_log.warning("room %d failed: %s", room, reason)
        rooms = self.rooms(handshake)
        if rooms.in_process:
            try:
                rooms.fail(room, reason, True)
            except RoomError as exc:  # unknown here, or already ended
                log.info("room %d not failed: %s", room, exc)
            return
        with self._lock:
            if len(self._failing) >= MAX_PENDING_FAILS:
                self.item_log.warning(
                    "room %d at %s not told it failed (%d such calls in flight); "
                    "it ends when its TTL does",
                    room,
                    handshake.endpoint,
                    len(self._failing),
                )
                return
            future = self.rooms.loop.submit(self._tell_failed(rooms.client, room, reason))
            self._failing.add(future)
        future.add_done_callback(self._told)

    def fail_all(self, jobs: Iterable[EncodeJob], reason: str) -> None:
        """Fail each job's room with the same reason."""
        for job in jobs:
            self.fail(job.handshake, reason, job.modality)

    def wait(self) -> None:
        """Wait (bounded) until the calls in flight have told their endpoints."""
        with self._lock:
            failing = list(self._failing)
        concurrent.futures.wait(failing, self.timeout_s + 1)

    async def _tell_failed(self, client: HandshakeClient, room: int, reason: str) -> None:
        try:
            (result,) = await asyncio.wait_for(
                client.fail([FailBody(room=room, reason=reason[:500], settled=True)]),
                self.timeout_s,
            )
            if not result.ok:
                log.info("room %d not failed at %s: %s", room, client.base_url, result.error)
        except asyncio.TimeoutError:
            self.item_log.warning(
                "could not tell %s that room %d failed: no answer within %g s",
                client.base_url,
                room,
                self.timeout_s,
            )
        except (
            Exception
        ) as exc:  # unreachable, or an answer that is not the room API's: one line, no traceback
            self.item_log.warning(
                "could not tell %s that room %d failed: %s: %s",
                client.base_url,
                room,
                type(exc).__name__,
                exc,
            )

    def _told(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._failing.discard(future)
