"""Dispatching one request's images and videos: hash, size, route, name each item's room, send,
and hand back items.

Per request: every item's content hash (xxh3-128 of its bytes, as the encode worker would
compute it) and rows (an image's from its size and the checkpoint's image processor config, read
from the file header; a video's from its container header's frame count, rate and size and the
checkpoint's video processor config: nothing is decoded); one room per item: its id drawn here
and the room opened by the worker's intake with the item (one message per item, no call of its
own), or opened first at a standalone room authority (``rooms_url``) over its room stream, the
rooms of every placement made in one loop step together; each item's bytes to its worker's
intake, all in flight at once. An item whose worker refuses it, times out or cannot be reached
leaves no live room behind (one opened at the authority, or one a silent worker may have opened,
is cancelled at once; one whose open was sent and not answered, over REST, again while unknown)
and is placed on the next worker in the ring. When every worker tried is busy (its queue full, or
the item's wait there past its deadline, with a retry-after), the item backs off (doubling from
the workers' retry-after up to ``MAX_BACKOFF_S``, jittered) and tries them again, within the
intake timeout (at once, none of them can take it within it); an item no worker takes comes back
with the reason and without a room, so the caller falls back (the gateway sends it to the engine
inline) or fails it at once instead of waiting.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from typing import NamedTuple

from epdserve.dispatcher.connections import WorkerConnections
from epdserve.dispatcher.media import DispatchedItem, DispatchError, Media, MediaSizer
from epdserve.dispatcher.workers import MAX_WORKERS, WorkerAddress, WorkerSet
from epdserve.vision.limits import MAX_PIXELS
from epdserve.vision.sizing import QWEN_VL, Sizing
from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.intake import (
    IntakeBusy,
    IntakeLost,
    IntakeRefused,
    IntakeReply,
    IntakeRequest,
    IntakeStatus,
)
from epdserve.wire.offers import drawn_room_id
from epdserve.wire.room_client import HandshakeError
from epdserve.wire.room_signatures import RoomSigner
from epdserve.wire.rooms import RoomView

log = logging.getLogger(__name__)
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,100}$")
MAX_BACKOFF_S = 1.0  # the longest wait before trying busy workers again


class _IntakeOutcome(NamedTuple):
    reason: str | None  # None: accepted
    retry_after_s: float | None = None  # a busy worker's: try it again after this
    unanswered: bool = False  # no answer came: the worker may have taken it (and its room)


class Dispatcher:
    """Places each request's items on encode workers (see the module's docstring), through
    ``WorkerConnections``; cancels the rooms of placed items."""

    def __init__(
        self,
        workers: WorkerSet,
        processor,
        video_processor=None,
        rooms_url: str | None = None,
        served_model: str | None = None,
        handshake_token: str | None = None,
        intake_token: str | None = None,
        room_ttl_s: float = 120.0,
        intake_timeout_s: float = 5.0,
        max_attempts: int = 3,
        sizing: Sizing = QWEN_VL,
        max_image_pixels: int = MAX_PIXELS,
        fingerprint: str | None = None,
    ):
        """``fingerprint``: the engine's model (compact): every item says it, and a worker of
        another model refuses it (and leaves the ring)."""
        self.workers = workers
        self.fingerprint = fingerprint
        self.sizer = MediaSizer(processor, video_processor, sizing, max_image_pixels)
        self.rooms_url = rooms_url  # a standalone room authority; None: rooms at each item's worker
        self.served_model = served_model
        # each room's address signed with the handshake token's key: the deployment's processes
        # call only signed endpoints (wire.room_signatures)
        self.signer = RoomSigner(handshake_token) if handshake_token else None
        self.intake_token = intake_token
        self.room_ttl_s = room_ttl_s
        self.intake_timeout_s = intake_timeout_s
        self.max_attempts = max_attempts
        self._connections = WorkerConnections(workers, rooms_url, handshake_token, intake_timeout_s)
        # a worker that refused busy is not sent more until then (its answer would be the same)
        self._busy_until: dict[str, float] = {}

    def size_for(self, processor, video_processor, sizing: Sizing, fingerprint: str | None) -> None:
        """From now on, size items with these processors and rules, and send them for the model
        of ``fingerprint`` (the engine's changed)."""
        self.sizer = MediaSizer(processor, video_processor, sizing, self.sizer.max_image_pixels)
        self.fingerprint = fingerprint

    async def close(self) -> None:
        await self._connections.close()

    # ---- the request -----------------------------------------------------------------------

    def describe(
        self, media: list[bytes | Media], names: list[str] | None = None, vllm_decodes=False
    ) -> list[DispatchedItem]:
        """``MediaSizer.describe``: every item hashed and sized, or ``DispatchError``."""
        return self.sizer.describe(media, names, vllm_decodes)

    async def dispatch(
        self,
        request_id: str,
        images: list[bytes | Media],
        near: str | None = None,
        names: list[str] | None = None,
    ) -> list[DispatchedItem]:
        """Place every item on an encode worker; each item comes back with its room, or with
        ``error`` and no room. ``near``: the prefill engine's
        host, whose encode workers are preferred (they can write over SHM). ``names``: what
        errors call the images (their files)."""
        return await self.place(request_id, self.describe(images, names), near)

    async def place(
        self, request_id: str, items: list[DispatchedItem], near: str | None = None
    ) -> list[DispatchedItem]:
        """``dispatch`` for items ``describe`` made (and returns them)."""
        if not REQUEST_ID.match(request_id):
            raise DispatchError(f"request id {request_id!r}: 1..100 of [A-Za-z0-9._:-]")
        started = time.monotonic()
        deadline = started + self.intake_timeout_s
        unplaced, backoff = [item for item in items if not item.encoded_by_vllm], 0.0
        while unplaced:
            tried: dict[int, set[str]] = {id(item): set() for item in unplaced}
            for _ in range(self.max_attempts):
                routes = self._route(unplaced, near, tried)
                if not routes:
                    break
                if len(routes) == 1:  # (the common case: no task for it)
                    ((address, batch),) = routes.items()
                    await self._place(request_id, address, batch, started)
                else:
                    await asyncio.gather(
                        *(
                            self._place(request_id, address, batch, started)
                            for address, batch in routes.items()
                        )
                    )
                unplaced = [item for item in unplaced if item.worker is None]
                if not unplaced:
                    break
            # every worker tried was busy for these: back off, then try them all again
            busy = [item for item in unplaced if item.retry_after_s is not None]
            if not busy or time.monotonic() + min(i.retry_after_s for i in busy) > deadline:
                break  # none busy, or none of them may be taken within the intake timeout
            backoff = min(max(2 * backoff, max(item.retry_after_s for item in busy)), MAX_BACKOFF_S)
            wait = backoff * random.uniform(0.5, 1.0)  # requests refused together spread out
            if time.monotonic() + wait > deadline:
                break
            await asyncio.sleep(wait)
            unplaced = busy
        for item in items:
            if item.worker is None:
                item.encode_handshake = None  # its rooms were not opened, are cancelled, or expire
                if item.error is None:
                    item.error = (
                        f"no encode worker took it (tried {', '.join(item.attempts)})"
                        if item.attempts
                        else self.workers.why_none()
                    )
        return items

    async def cancel(self, items: list[DispatchedItem], reason: str) -> None:
        """Cancel the rooms of placed items (the request ended before the prefill engine took
        their rows: a client that left, an engine that refused): their workers drop them."""
        by_endpoint: dict[str, list[int]] = {}
        for item in items:
            if item.worker is not None and item.encode_handshake is not None:
                by_endpoint.setdefault(self.rooms_url or item.encode_handshake.url, []).append(
                    item.encode_handshake.bootstrap_room
                )
        for url, rooms in by_endpoint.items():
            try:
                await self._connections.rooms_client(url).cancel(rooms, reason)
            except HandshakeError as exc:
                log.warning("could not cancel %d rooms at %s: %s", len(rooms), url, exc)

    def _route(
        self, items: list[DispatchedItem], near: str | None, tried: dict[int, set[str]]
    ) -> dict[WorkerAddress, list[DispatchedItem]]:
        """The next healthy worker not yet ``tried`` (this round) for each item, grouped by
        worker."""
        routes: dict[WorkerAddress, list[DispatchedItem]] = {}
        for item in items:
            address = next(
                (
                    a
                    for a in self.workers.candidates(item.content_hash, near)
                    if a.name not in tried[id(item)]
                ),
                None,
            )
            if address is not None:
                tried[id(item)].add(address.name)
                item.attempts.append(address.name)
                routes.setdefault(address, []).append(item)
        return routes

    async def _place(
        self, request_id: str, address: WorkerAddress, items: list[DispatchedItem], started: float
    ) -> None:
        busy_for = self._busy_for(address)
        if busy_for > 0:  # nothing sent (nor rooms opened and cancelled) for items it would refuse
            for item in items:
                item.error = f"{address.name}: refused: busy for {busy_for:.1f} s more"
                item.retry_after_s = busy_for
            return
        rooms_client, endpoint = self._connections.room_endpoint(address)
        # the worker's intake opens each room with its item; at a standalone handshake, the
        # rooms are opened first, over its room stream
        rooms = [drawn_room_id() for _ in items]
        if self.rooms_url is not None:
            opened = await self._connections.authority().open_rooms(rooms, self.room_ttl_s)
            for item, answer in zip(items, opened):
                if not isinstance(answer, RoomView):  # (one whose answer was lost may be open:
                    # RemoteRooms cancels it)
                    item.error = f"cannot open a room at {endpoint}: {answer}"
                    item.retry_after_s = None
            kept = [i for i, answer in enumerate(opened) if isinstance(answer, RoomView)]
            if not kept:
                return
            items, rooms = [items[i] for i in kept], [rooms[i] for i in kept]
        for item, room in zip(items, rooms):
            item.encode_handshake = EncodeHandshake.at(endpoint, room)
            if self.signer is not None:
                item.encode_handshake = self.signer.sign(item.encode_handshake, self.room_ttl_s)
        replies = await self._send(request_id, address, items)
        left_live: dict[str, list[int]] = {}  # the reason -> the rooms that may be live for it
        for item, reply in zip(items, replies):
            item.retry_after_s = reply.retry_after_s
            if reply.reason is None:
                item.worker, item.error = address.name, None
                item.dispatch_s = time.monotonic() - started
                continue
            item.error = f"{address.name}: {reply.reason}"
            # a room opened at a standalone handshake outlives a refusal; a room intake opens is
            # not left behind by one (nor by a failure, which fails the room itself), but one
            # whose message got no answer may have been opened
            if self.rooms_url is not None or reply.unanswered:
                left_live.setdefault(reply.reason, []).append(item.encode_handshake.bootstrap_room)
        for reason, rooms in left_live.items():  # the prefill side reads why in the room
            try:
                await rooms_client.cancel(rooms, f"encode dispatch failed: {reason}"[:200])
            except HandshakeError as exc:
                log.warning("could not cancel %d rooms at %s: %s", len(rooms), endpoint, exc)

    async def _send(
        self, request_id: str, address: WorkerAddress, items: list[DispatchedItem]
    ) -> list[_IntakeOutcome]:
        """The worker's answer to each item, sent together (one message, one wait). A worker
        that does not answer leaves the ring."""
        requests = [
            (
                IntakeRequest(
                    request_id=f"{request_id}.{item.index}",
                    model=self.served_model,
                    fingerprint=self.fingerprint,
                    modality=item.modality,
                    content_hash=item.content_hash,
                    encode_handshake=item.encode_handshake,
                    source="bytes",
                    grid_thw=list(item.grid_thw),  # the worker fails an item it sizes otherwise
                    token=self.intake_token,
                    open_room_ttl_s=self.room_ttl_s if self.rooms_url is None else None,
                ),
                item.data,
            )
            for item in items
        ]
        replies = await self._connections.intake(address).send_all(requests)
        timed_out = next((reply for reply in replies if isinstance(reply, TimeoutError)), None)
        if timed_out is not None:
            self.workers.mark_down(address, str(timed_out))
        return [self._outcome(address, reply) for reply in replies]

    def _outcome(
        self, address: WorkerAddress, reply: IntakeReply | IntakeRefused | TimeoutError
    ) -> _IntakeOutcome:
        if isinstance(reply, TimeoutError):
            return _IntakeOutcome(str(reply), unanswered=True)
        if isinstance(reply, IntakeBusy):
            return _IntakeOutcome(str(reply), self._busy(address, reply.retry_after_s))
        if isinstance(reply, IntakeLost):  # the worker is gone: placed elsewhere at once
            self.workers.mark_down(address, str(reply))
            return _IntakeOutcome(str(reply), unanswered=True)
        if isinstance(reply, IntakeRefused):
            return _IntakeOutcome(str(reply))
        if reply.status is IntakeStatus.ACCEPTED:
            return _IntakeOutcome(None)
        if reply.incompatible:
            self.workers.mark_incompatible(address, reply.reason)
        if reply.retry_after_s is not None:
            self._busy(address, reply.retry_after_s)
        return _IntakeOutcome(f"refused: {reply.reason}", reply.retry_after_s)

    def _busy_for(self, address: WorkerAddress) -> float:
        """Seconds left of the retry-after ``address`` last refused with (<= 0: not busy)."""
        return self._busy_until.get(address.name, 0.0) - time.monotonic()

    def _busy(self, address: WorkerAddress, retry_after_s: float) -> float:
        if len(self._busy_until) >= MAX_WORKERS:  # workers come and go (DNS)
            self._busy_until.clear()
        self._busy_until[address.name] = time.monotonic() + retry_after_s
        return retry_after_s
