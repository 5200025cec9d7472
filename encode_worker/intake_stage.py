"""Intake, the encode worker's first stage: the ZMQ ROUTER loop. Each item of a message (one, or a
batch) is validated into an ``EncodeJob`` from what can be seen without decoding (the image's
header, the video's container header, the shape, the SHM name: ``encode_worker.intake_jobs``),
queued, and answered at once with an ``IntakeReply``: refused (room untouched), failed (a bad item:
its room fails) or accepted; a batch's items each alone, in one reply."""

from __future__ import annotations

import logging

import zmq

from encode_worker.intake_jobs import IntakeJobs
from encode_worker.room_clients import InFlightRooms, RateLimitedLog
from encode_worker.scheduler import EncodeJob
from encode_worker.stages import SHUTTING_DOWN, StageContext
from epdserve.process_settings import SettingError
from epdserve.vision.images import BadItem
from epdserve.wire.addresses import endpoint_url
from epdserve.wire.intake import (
    BATCH_MARKER,
    QUEUE_FULL_RETRY_S,
    IntakeBatchReply,
    IntakeGate,
    IntakeIncompatible,
    IntakeRefused,
    IntakeReply,
    IntakeRequest,
    IntakeStatus,
    parse_batch,
    parse_request,
)
from epdserve.wire.modality import Modality
from handshake.rooms import RoomConflict, RoomError, RoomsFull

log = logging.getLogger(__name__)
INTAKE_POLL_MS = 100  # how often the intake loop looks at the stop signal


class Intake:
    """The intake socket and its loop. Never waits on the network or the tower: each message is
    refused (room untouched), failed (a bad item: its room fails) or queued, and answered at
    once."""

    def __init__(
        self,
        context: StageContext,
        served_model: str,
        fingerprint: str,
        in_flight: InFlightRooms,
        item_log: RateLimitedLog,
    ):
        config = self.config = context.config
        self.gate = IntakeGate(
            max_payload_bytes=config.max_payload_bytes,
            token=config.intake_token,
            model=served_model,
            fingerprint=fingerprint,
        )
        self.tower = context.tower
        self.queue = context.queue
        self.in_flight = in_flight
        self.failer = context.failer
        self.health = context.health
        self.metrics = context.metrics
        self.item_log = item_log
        self.jobs = IntakeJobs(context.tower, config)
        self._stopping = context.stopping
        self._socket: zmq.Socket | None = None
        self.port: int | None = None

    def listen(self) -> None:
        """Bind the intake port (``SettingError``, one line, when it cannot be)."""
        config = self.config
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, config.max_payload_bytes + (1 << 20))
        self._socket.setsockopt(zmq.IPV6, 1)  # --bind may be an IPv6 address
        try:
            if config.intake_port:
                self._socket.bind(endpoint_url("tcp", config.bind, config.intake_port))
                self.port = config.intake_port
            else:
                self.port = self._socket.bind_to_random_port(endpoint_url("tcp", config.bind))
        except zmq.ZMQError as exc:
            raise SettingError(
                f"intake port: cannot listen on {config.bind}:{config.intake_port}: {exc.strerror}"
            ) from None

    def loop(self) -> None:
        """Answer messages until the worker stops; then close the socket (the loop's own)."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(INTAKE_POLL_MS):
                continue
            frames = self._socket.recv_multipart(copy=True)
            identity, body = frames[0], frames[1:]
            if body and body[0] == BATCH_MARKER:
                reply = self.accept_batch(body[1:])
            else:
                reply = [self.accept(body).frame()]
                self.metrics.message_items.observe(1)
            self._socket.send_multipart([identity, *reply])
        self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)

    def accept(self, frames: list[bytes]) -> IntakeReply:
        """One item's message (its frames)."""
        try:
            request, payload = parse_request(frames, self.gate)
        except IntakeRefused as exc:
            return self._refused(exc)
        return self._accept(request, payload)

    def accept_batch(self, frames: list[bytes]) -> list[bytes]:
        """A batch message's frames (after the marker): its reply's frames, one answer per item;
        a single refusal without a room when the frames cannot be matched to items."""
        try:
            parsed = parse_batch(frames, self.gate)
        except IntakeRefused as exc:
            return [self._refused(exc).frame()]
        self.metrics.message_items.observe(len(parsed))
        replies = [
            self._refused(item) if isinstance(item, IntakeRefused) else self._accept_alone(*item)
            for item in parsed
        ]
        return IntakeBatchReply(replies=replies).frames()

    def _accept_alone(self, request: IntakeRequest, payload: bytes | None) -> IntakeReply:
        """``_accept`` for one item of a batch: a fault of ours with it fails that item alone (the
        items before it are queued already, and the batch's reply must still go)."""
        try:
            return self._accept(request, payload)
        except Exception as exc:
            room = request.encode_handshake.bootstrap_room
            log.exception("intake failed on room %d", room)
            self.in_flight.release(room)
            return IntakeReply(
                status=IntakeStatus.REFUSED,
                room=room,
                reason=f"encode worker error at intake: {type(exc).__name__}",
            )

    def _refused(self, refusal: IntakeRefused) -> IntakeReply:
        """The reply to an item refused before it was read (its room untouched)."""
        self.metrics.count(Modality.IMAGE, IntakeStatus.REFUSED)
        self.item_log.warning("intake refused an item (room %s): %s", refusal.room, refusal)
        return IntakeReply(
            status=IntakeStatus.REFUSED,
            room=refusal.room,
            reason=str(refusal),
            incompatible=isinstance(refusal, IntakeIncompatible),
        )

    def _accept(self, request: IntakeRequest, payload: bytes | None) -> IntakeReply:
        room = request.encode_handshake.bootstrap_room
        if self.health.device_failure is not None:  # another worker can encode it
            return self._refuse(request, self.health.device_failure)
        # before the header, the hash and the room: a busy worker refuses cheaply
        if not self.queue.has_room(len(payload) if payload is not None else 0):
            return self._refuse(request, "queue full", retry_after_s=QUEUE_FULL_RETRY_S)
        predicted_wait_s = self.queue.wait_s()
        refusal = self._past_its_deadline(request, predicted_wait_s)
        if refusal is not None:
            return refusal
        if request.open_room_ttl_s is None:  # its room lives elsewhere: is that a room of ours?
            unvouched = self.failer.rooms.refusal(request.encode_handshake)
            if unvouched is not None:
                return self._refuse(request, unvouched, log_it=True)
        if not self.in_flight.claim(room):
            return self._refuse(
                request, f"room {room} already has an item in flight here", log_it=True
            )
        if request.open_room_ttl_s is not None:
            refusal = self._open_room(request)
            if refusal is not None:
                self.in_flight.release(room)
                return refusal
        try:
            job = self.job(request, payload)
        except BadItem as exc:
            self.failer.fail(request.encode_handshake, str(exc), request.modality, counted=False)
            self.metrics.count(request.modality, IntakeStatus.FAILED)
            return IntakeReply(status=IntakeStatus.FAILED, room=room, reason=str(exc))
        if predicted_wait_s is not None:
            job.timings["predicted_queue_s"] = predicted_wait_s
        if not self.queue.put(job):  # room was checked above: the queue closed meanwhile
            self.in_flight.release(room)
            if request.open_room_ttl_s is not None:
                self._close_opened_room(room)
            return self._refuse(request, SHUTTING_DOWN)
        self.metrics.count(request.modality, IntakeStatus.ACCEPTED)
        return IntakeReply(status=IntakeStatus.ACCEPTED, room=room)

    def _past_its_deadline(
        self, request: IntakeRequest, wait_s: float | None
    ) -> IntakeReply | None:
        """The refusal of an item that would wait ``wait_s`` for the tower (the work queued
        ahead at the measured pace; None: not measured yet) when that is longer than it may
        (``max_queue_wait_s`` and half its room's lifetime), with when the queue will have room
        for it; None when it may wait."""
        if wait_s is None:
            return None
        may_wait_s = self.config.max_queue_wait_s
        if request.open_room_ttl_s is not None:
            may_wait_s = min(may_wait_s, request.open_room_ttl_s / 2)
        if wait_s <= may_wait_s:
            return None
        return self._refuse(
            request,
            f"busy: about {wait_s:.1f} s of work queued ahead, over the {may_wait_s:g} s this "
            "item may wait",
            retry_after_s=max(QUEUE_FULL_RETRY_S, wait_s - may_wait_s),
        )

    def _refuse(
        self,
        request: IntakeRequest,
        reason: str,
        retry_after_s: float | None = None,
        log_it: bool = False,
    ) -> IntakeReply:
        room = request.encode_handshake.bootstrap_room
        self.metrics.count(request.modality, IntakeStatus.REFUSED)
        if log_it:
            self.item_log.warning("intake refused room %d: %s", room, reason)
        return IntakeReply(
            status=IntakeStatus.REFUSED, room=room, reason=reason, retry_after_s=retry_after_s
        )

    def _open_room(self, request: IntakeRequest) -> IntakeReply | None:
        """Open the room the sender named in this worker's table; the refusal, if it cannot be."""
        handshake = request.encode_handshake
        # The port must be this worker's bootstrap port; the host is the sender's name for this
        # worker, which it reached the intake by (a worker does not know every DNS name it has).
        if handshake.endpoint.port != self.failer.rooms.bootstrap_port:
            return self._refuse(
                request,
                f"open_room_ttl_s names a room at {handshake.endpoint}, not at this worker's "
                f"bootstrap port {self.failer.rooms.bootstrap_port}",
                log_it=True,
            )
        try:
            self.failer.rooms.table.open(handshake.bootstrap_room, request.open_room_ttl_s)
        except RoomsFull as exc:
            return self._refuse(request, f"room table full: {exc}", QUEUE_FULL_RETRY_S)
        except RoomError as exc:  # the id is in use here, or the TTL is over this table's maximum
            return self._refuse(request, f"cannot open the room: {exc}", log_it=True)
        return None

    def _close_opened_room(self, room: int) -> None:
        """The room intake opened for an item it then refused: gone without a trace, or (touched
        meanwhile by someone who guessed the id) cancelled."""
        table = self.failer.rooms.table
        try:
            table.discard(room)
        except RoomConflict:
            try:
                table.cancel(room, f"encode worker refused the item: {SHUTTING_DOWN}")
            except RoomError as exc:
                log.info("room %d not cancelled: %s", room, exc)

    def job(self, request: IntakeRequest, payload: bytes | None) -> EncodeJob:
        """The item as a job (``IntakeJobs.job``); ``BadItem`` for an item that must not go
        further."""
        return self.jobs.job(request, payload)
