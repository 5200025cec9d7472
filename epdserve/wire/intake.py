"""Intake over ZMQ (ROUTER): items acknowledged or refused at once, each with a reason.

A message carries one item or a batch. One item: frames (after the ROUTER identity)
``[metadata JSON, payload]``; the payload frame is the encoded image or video file
(``source="bytes"``), raw ``uint8 [H, W, 3]`` pixels or ``[T, H, W, 3]`` video frames
(``source="pixels"``, with ``shape``), or absent (``source="shm"``, an image's pixels, with the
handle in ``shm``). Its reply: one JSON frame, an ``IntakeReply`` (``status``, ``room``,
``reason``, ``retry_after_s``, and ``ok`` for readers that predate ``status``); ``room`` is set
whenever the metadata named one, so a client with several items in flight matches each reply to
its item. A batch: ``[BATCH_MARKER, IntakeBatch JSON, payload, ...]``, one payload frame per item
that has one, in item order; its reply ``[BATCH_MARKER, IntakeBatchReply JSON]``, one
``IntakeReply`` per item, in item order: each item is accepted, refused or failed alone.
``AsyncIntakeClient`` sends what its callers hand it in one loop step as one batch. Nothing from
the network is unpickled. Torch-free: the dispatcher imports it.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import hmac
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, model_validator

from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.fingerprint import CompactFingerprint, say_compact_differences
from epdserve.wire.json_fields import json_float, json_int
from epdserve.wire.modality import EncodedModality, Modality

MAX_METADATA_BYTES = 64 << 10
MAX_BATCH_ITEMS = 64  # items in one batch message
MAX_BATCH_METADATA_BYTES = MAX_BATCH_ITEMS * (4 << 10)  # a batch's metadata frame
MAX_BATCH_PAYLOAD_BYTES = 64 << 20  # a client starts a new batch past this many payload bytes
BATCH_MARKER = b"epd-intake-batch/1"  # the first frame of a batch message and of its reply
QUEUE_FULL_RETRY_S = 0.1  # retry_after_s of a busy refusal: queue full, too many in flight
MAX_RETRY_AFTER_S = 3600.0


class ShmPixels(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shm_name: str = Field(pattern=r"^epd-[A-Za-z0-9_-]{1,100}$")
    shape: list[json_int(gt=0, le=16384)] = Field(min_length=3, max_length=3)
    dtype: Literal["uint8"]


class IntakeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")
    model: str | None = Field(
        default=None, max_length=256
    )  # refused unless it names this worker's model
    # The fingerprint of the model the item is encoded for (the engine's, as the dispatcher read
    # it there): refused, as incompatible, unless it is this worker's own.
    fingerprint: CompactFingerprint | None = None
    modality: EncodedModality = Modality.IMAGE
    # xxh3-128 of the payload's bytes (the image file, or the raw uint8 pixels); the worker computes
    # it itself and refuses an item whose claimed hash differs. Required for SHM-backed pixels.
    content_hash: json_int(ge=0, lt=1 << 128) | None = None
    encode_handshake: EncodeHandshake
    source: Literal["bytes", "pixels", "shm"]
    # source "pixels": [H, W, 3] (an image) or [T, H, W, 3] (a video's frames, already sampled)
    shape: list[json_int(gt=0, le=16384)] | None = Field(default=None, min_length=3, max_length=4)
    shm: ShmPixels | None = None
    # The (t, h, w) patch grid the sender sized the item to (a dispatcher, with its processor
    # configs): the worker fails an item it sizes otherwise, before any encode.
    grid_thw: list[json_int(gt=0, le=1 << 20)] | None = Field(
        default=None, min_length=3, max_length=3
    )
    token: str | None = Field(default=None, max_length=256)
    # Set: the room is not minted yet; intake opens it in this worker's own table (the handshake
    # must name this worker's bootstrap port) with the id the sender chose and this TTL, so
    # placing an item costs one message. A refused item's room is not left behind.
    open_room_ttl_s: json_float(gt=0, le=3600) | None = None


class IntakeBatch(BaseModel):
    """A batch message's metadata: its items, in the order of their payload frames."""

    model_config = ConfigDict(extra="forbid")
    items: list[IntakeRequest] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)


class IntakeStatus(enum.StrEnum):
    """What intake did with one message: the ``result`` label of ``epd_encoder_intake_total`` (the
    value in lower case)."""

    ACCEPTED = "ACCEPTED"  # queued for the tower; the room's outcome comes through the room
    REFUSED = "REFUSED"  # never queued, room untouched (or not opened): bad frames, duplicate
    # room, queue full
    FAILED = "FAILED"  # the item is bad (header, size, hash): its room was failed with the reason


class IntakeReply(BaseModel):
    """Intake's answer to one message. ``ok`` is derived from ``status`` and travels too, so a
    reader that knows only ``ok`` still reads it; a reply without ``status`` (such a worker's) is
    read from ``ok``: accepted, or refused."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    status: IntakeStatus
    room: json_int(ge=0) | None = (
        None  # the room the metadata named; None when it could not be read
    )
    reason: str | None = None  # why, when not accepted
    # set on a refusal that may succeed later (busy: queue full, or its wait past the deadline)
    retry_after_s: json_float(ge=0, le=MAX_RETRY_AFTER_S) | None = None
    # set on a refusal because the item is for another model than this worker's (its
    # fingerprint): no item for that model will be taken
    incompatible: bool = False

    @computed_field
    @property
    def ok(self) -> bool:
        return self.status is IntakeStatus.ACCEPTED

    @model_validator(mode="before")
    @classmethod
    def _status_from_ok(cls, data: Any) -> Any:
        if isinstance(data, dict) and "status" not in data and "ok" in data:
            return {
                **data,
                "status": IntakeStatus.ACCEPTED if data["ok"] is True else IntakeStatus.REFUSED,
            }
        return data

    def frame(self) -> bytes:
        return self.model_dump_json().encode()


class IntakeBatchReply(BaseModel):
    """The answer to a batch message: one reply per item, in item order."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    replies: list[IntakeReply] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)

    def frames(self) -> list[bytes]:
        return [BATCH_MARKER, self.model_dump_json().encode()]


class IntakeRefused(ValueError):
    """The message is refused; the reason goes back to the dispatcher (with the room, once
    known)."""

    def __init__(self, reason: str, room: int | None = None):
        super().__init__(reason)
        self.room = room


class IntakeIncompatible(IntakeRefused):
    """Refused because the item is for another model than the worker's (its fingerprint)."""


class IntakeLost(IntakeRefused):
    """No answer will come: the connection to the worker's intake closed (the worker stopped or
    died) while the message was unanswered."""


class IntakeBusy(IntakeRefused):
    """Refused by the client itself: too many messages in flight to that worker already (as a
    full queue there, worth retrying after ``retry_after_s``)."""

    retry_after_s = QUEUE_FULL_RETRY_S


class IntakeGate(BaseModel):
    """What a worker's intake checks every item against: payload size, token, served model name
    and model fingerprint."""

    model_config = ConfigDict(frozen=True)
    max_payload_bytes: int
    token: str | None = None
    model: str | None = None  # the served model name
    fingerprint: str | None = None  # the worker's compact fingerprint


def parse_request(frames: list[bytes], gate: IntakeGate) -> tuple[IntakeRequest, bytes | None]:
    """Validate one item's frames (identity already removed)."""
    if not 1 <= len(frames) <= 2:
        raise IntakeRefused(f"expected [metadata, payload] frames, got {len(frames)}")
    if len(frames[0]) > MAX_METADATA_BYTES:
        raise IntakeRefused(f"metadata frame larger than {MAX_METADATA_BYTES} bytes")
    try:
        request = IntakeRequest.model_validate_json(frames[0])
    except ValidationError as exc:
        raise IntakeRefused(f"bad metadata: {exc.errors(include_url=False)[:3]}") from None
    payload = frames[1] if len(frames) == 2 else None
    check_request(request, payload, gate)
    return request, payload


def parse_batch(
    frames: list[bytes], gate: IntakeGate
) -> list[tuple[IntakeRequest, bytes | None] | IntakeRefused]:
    """Validate a batch's frames (identity and ``BATCH_MARKER`` removed): per item, its request
    and payload, or why it is refused (every item, naming its room, when the payload frames are
    not one per item that has one). ``IntakeRefused`` (no room) when the metadata is
    unreadable."""
    if not frames:
        raise IntakeRefused("a batch needs its metadata frame")
    if len(frames[0]) > MAX_BATCH_METADATA_BYTES:
        raise IntakeRefused(f"batch metadata frame larger than {MAX_BATCH_METADATA_BYTES} bytes")
    try:
        items = IntakeBatch.model_validate_json(frames[0]).items
    except ValidationError as exc:
        raise IntakeRefused(f"bad batch metadata: {exc.errors(include_url=False)[:3]}") from None
    payloads = iter(frames[1:])
    with_payload = sum(item.source != "shm" for item in items)
    if with_payload != len(frames) - 1:
        reason = (
            f"a batch of {len(items)} items, {with_payload} with a payload, came with "
            f"{len(frames) - 1} payload frames"
        )
        return [IntakeRefused(reason, item.encode_handshake.bootstrap_room) for item in items]
    parsed: list[tuple[IntakeRequest, bytes | None] | IntakeRefused] = []
    for request in items:
        payload = next(payloads) if request.source != "shm" else None
        try:
            check_request(request, payload, gate)
        except IntakeRefused as exc:
            parsed.append(exc)
            continue
        parsed.append((request, payload))
    return parsed


def check_request(request: IntakeRequest, payload: bytes | None, gate: IntakeGate) -> None:
    """An item's request against its payload frame and the worker's ``gate``: token, served model
    and fingerprint; ``IntakeRefused`` (with the room) when they do not fit."""
    room = request.encode_handshake.bootstrap_room
    max_payload_bytes = gate.max_payload_bytes
    if gate.token is not None and not hmac.compare_digest(
        (request.token or "").encode(), gate.token.encode()
    ):
        raise IntakeRefused("missing or wrong intake token", room)
    if request.model is not None and request.model != gate.model:
        raise IntakeRefused(
            f"unknown model {request.model!r}: this worker serves {gate.model!r}", room
        )
    if (
        request.fingerprint is not None
        and gate.fingerprint is not None
        and request.fingerprint != gate.fingerprint
    ):
        raise IntakeIncompatible(
            "incompatible: "
            + say_compact_differences(
                gate.fingerprint, request.fingerprint, "this worker", "the engine"
            ),
            room,
        )
    if request.source == "shm":
        if request.shm is None or payload is not None:
            raise IntakeRefused("source 'shm' needs the 'shm' handle and no payload frame", room)
        if request.modality is not Modality.IMAGE:
            raise IntakeRefused("source 'shm' carries an image's pixels only", room)
        return
    if payload is None or not payload:
        raise IntakeRefused(f"source {request.source!r} needs a payload frame", room)
    if len(payload) > max_payload_bytes:
        raise IntakeRefused(f"payload of {len(payload)} bytes exceeds {max_payload_bytes}", room)
    if request.source == "pixels":
        layout = ["H", "W", "3"] if request.modality is Modality.IMAGE else ["T", "H", "W", "3"]
        shape = request.shape
        if shape is None or len(shape) != len(layout) or shape[-1] != 3:
            raise IntakeRefused(f"source 'pixels' needs shape [{', '.join(layout)}]", room)
        if math.prod(shape) != len(payload):
            raise IntakeRefused(
                f"payload of {len(payload)} bytes does not match shape {shape}", room
            )


class IntakeClient:
    """The dispatcher's side of intake: one DEALER socket, one request in flight at a time."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0):
        import zmq

        self._zmq = zmq
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IPV6, 1)  # an IPv6 worker's endpoint as well as an IPv4 one
        self._socket.connect(endpoint)

    def send(self, request: dict, payload: bytes | None = None) -> IntakeReply:
        frames = [IntakeRequest.model_validate(request).model_dump_json(exclude_none=True).encode()]
        if payload is not None:
            frames.append(payload)
        return self.send_raw(frames)

    def send_raw(self, frames: list[bytes]) -> IntakeReply:
        """Send frames as they are (tests use it for malformed messages); wait for the reply."""
        self._socket.send_multipart(frames)
        if not self._socket.poll(self.timeout_ms):
            raise TimeoutError(f"no answer from encode worker intake {self.endpoint}")
        return IntakeReply.model_validate_json(self._socket.recv())

    def close(self) -> None:
        self._socket.close(0)


class AsyncIntakeClient:
    """The dispatcher's asyncio side of intake: one DEALER socket, many items in flight. The items
    its callers send in one loop step go out as one message (a batch of at most
    ``MAX_BATCH_ITEMS`` items and about ``MAX_BATCH_PAYLOAD_BYTES`` of payload; one item alone in
    the one-item form); each reply is matched to its item by room (a dispatcher never has two
    items for one room in flight). A reply that names no room (the worker could not read the
    message's metadata) fails the items of the message it answers: the worker answers messages
    in the order they came, so that is the oldest message not answered yet. When the connection
    to the worker closes (ZMQ's socket monitor: the worker stopped or died), every item not
    answered yet fails at once with ``IntakeLost``, instead of waiting out its timeout."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0, max_in_flight: int = 1024):
        import zmq
        import zmq.asyncio

        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IPV6, 1)  # an IPv6 worker's endpoint as well as an IPv4 one
        self._socket.connect(endpoint)
        self._waiting: dict[int, asyncio.Future[IntakeReply]] = {}
        self._unsent: list[tuple[IntakeRequest, bytes | None]] = []
        self._unsent_bytes = 0
        # each message sent and not answered yet: its rooms, oldest first (each holds an item in
        # flight until answered or timed out, so there are at most max_in_flight of them)
        self._unanswered: collections.deque[list[int]] = collections.deque(maxlen=max_in_flight)
        self._reader: asyncio.Task | None = None
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._watcher: asyncio.Task | None = None

    async def send(self, request: IntakeRequest, payload: bytes | None = None) -> IntakeReply:
        """Send one item (in this loop step's batch); its reply. Raises ``TimeoutError`` when the
        worker does not answer in time, ``IntakeRefused`` when too many items are in flight."""
        (reply,) = await self.send_all([(request, payload)])
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def send_all(
        self, items: list[tuple[IntakeRequest, bytes | None]]
    ) -> list[IntakeReply | IntakeRefused | TimeoutError]:
        """Send each item (in this loop step's batch) and wait for their replies together, with
        one timer: each item's reply, or why it has none (``IntakeRefused``; ``IntakeBusy`` when
        too many items are in flight; ``TimeoutError`` when the worker did not answer in
        time)."""
        loop = asyncio.get_running_loop()
        answers: list[IntakeReply | IntakeRefused | TimeoutError | asyncio.Future] = []
        queued: set[int] = set()
        for request, payload in items:
            room = request.encode_handshake.bootstrap_room
            if room in self._waiting:
                answers.append(IntakeRefused(f"room {room} already has a message in flight", room))
            elif len(self._waiting) >= self.max_in_flight:
                answers.append(
                    IntakeBusy(f"{self.max_in_flight} messages in flight to {self.endpoint}", room)
                )
            elif (payload is None) != (request.source == "shm"):  # one wrong item spoils no batch
                answers.append(
                    IntakeRefused(f"source {request.source!r} and the payload frame disagree", room)
                )
            else:
                answers.append(self._queue(loop, request, payload))
                queued.add(room)
        if not queued:
            return answers
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read_replies())
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch_connection())
        try:
            await self._all_answered([a for a in answers if isinstance(a, asyncio.Future)])
        finally:
            for room in queued:
                self._waiting.pop(room, None)
            if self._unsent:  # (their caller left before they went: they never go)
                self._unsent = [
                    (request, payload)
                    for request, payload in self._unsent
                    if request.encode_handshake.bootstrap_room not in queued
                ]
                self._unsent_bytes = sum(len(p) for _, p in self._unsent if p is not None)
        return [self._answer_of(answer) for answer in answers]

    def _queue(self, loop, request: IntakeRequest, payload: bytes | None) -> asyncio.Future:
        """The item into this loop step's batch: the future its reply resolves."""
        future = self._waiting[request.encode_handshake.bootstrap_room] = loop.create_future()
        if not self._unsent:
            loop.call_soon(self._send_unsent)
        self._unsent.append((request, payload))
        self._unsent_bytes += len(payload) if payload is not None else 0
        if len(self._unsent) >= MAX_BATCH_ITEMS or self._unsent_bytes >= MAX_BATCH_PAYLOAD_BYTES:
            self._send_unsent()
        return future

    async def _all_answered(self, futures: list[asyncio.Future]) -> None:
        """Once every future is done, or after ``timeout_s``: one timer and one wake-up."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        left = len(futures)

        def one_done(_: asyncio.Future) -> None:
            nonlocal left
            left -= 1
            if not left and not done.done():
                done.set_result(None)

        for future in futures:
            future.add_done_callback(one_done)
        timer = loop.call_later(self.timeout_s, lambda: done.done() or done.set_result(None))
        try:
            await done
        finally:
            timer.cancel()
            for future in futures:
                future.remove_done_callback(one_done)

    def _answer_of(self, answer) -> IntakeReply | IntakeRefused | TimeoutError:
        if not isinstance(answer, asyncio.Future):
            return answer
        if not answer.done():
            return TimeoutError(
                f"no answer from encode worker intake {self.endpoint} within {self.timeout_s} s"
            )
        return answer.exception() or answer.result()

    def _send_unsent(self) -> None:
        """The items sent since the last batch, as one message: a batch, or one item alone in the
        one-item form (which a worker that predates batches reads too)."""
        if not self._unsent:  # sent already, the batch full before the loop step ended
            return
        items, self._unsent, self._unsent_bytes = self._unsent, [], 0
        if len(items) == 1:
            ((request, payload),) = items
            frames = [request.model_dump_json(exclude_none=True).encode()]
        else:
            frames = [
                BATCH_MARKER,
                b'{"items":[%s]}'
                % b",".join(
                    request.model_dump_json(exclude_none=True).encode() for request, _ in items
                ),
            ]
        frames.extend(payload for _, payload in items if payload is not None)
        rooms = [request.encode_handshake.bootstrap_room for request, _ in items]
        self._unanswered.append(rooms)
        sent = self._socket.send_multipart(frames, copy=False)
        sent.add_done_callback(lambda sent: self._fail_unsent(sent, rooms))

    def _fail_unsent(self, sent: asyncio.Future, rooms: list[int]) -> None:
        """A message the socket could not send (closed, or failed): its items' callers learn why,
        as a refusal."""
        if sent.cancelled() or sent.exception() is None:
            return
        if rooms in self._unanswered:  # never sent: no answer will come for it
            self._unanswered.remove(rooms)
        refusal = f"cannot send to encode worker intake {self.endpoint}: {sent.exception()}"
        for room in rooms:
            future = self._waiting.get(room)
            if future is not None and not future.done():
                future.set_exception(IntakeRefused(refusal, room))

    async def _watch_connection(self) -> None:
        """Fail every item not answered yet when the connection to the worker closes: what was
        sent on it is lost with the worker (a DEALER would reconnect and wait for an answer
        that never comes)."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            parse_monitor_message(await self._monitor.recv_multipart())  # EVENT_DISCONNECTED
            self._unanswered.clear()
            lost = (
                f"the connection to encode worker intake {self.endpoint} closed before it "
                "answered (the worker stopped or died)"
            )
            for room, future in list(self._waiting.items()):
                if not future.done():
                    future.set_exception(IntakeLost(lost, room))

    async def _read_replies(self) -> None:
        while self._waiting:
            frames = await self._socket.recv_multipart()
            if frames[0] == BATCH_MARKER and len(frames) == 2:
                replies = IntakeBatchReply.model_validate_json(frames[1]).replies
            else:
                replies = [IntakeReply.model_validate_json(frames[0])]
            answered = self._unanswered.popleft() if self._unanswered else []
            for reply in replies:
                for room in [reply.room] if reply.room is not None else answered:
                    future = self._waiting.get(room)
                    if future is not None and not future.done():
                        future.set_result(reply)

    def close(self) -> None:
        """Close the socket; items not answered yet are refused at once, unsent ones dropped."""
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._unsent, self._unsent_bytes = [], 0
        for room, future in list(self._waiting.items()):
            if not future.done():
                future.set_exception(IntakeRefused(f"intake client {self.endpoint} closed", room))
        self._socket.disable_monitor()
        self._monitor.close(0)
        self._socket.close(0)
