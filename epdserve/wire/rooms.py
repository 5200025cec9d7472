"""Request and response bodies of the handshake API (pydantic 2; every field range-checked)."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from epdserve.wire.fingerprint import CompactFingerprint
from epdserve.wire.json_fields import JsonBool, json_float, json_int
from epdserve.wire.offers import (
    DTYPE_NAMES,
    MAX_OFFERS,
    MAX_ROOM_ID,
    MAX_ROWS,
    MAX_WIDTH,
    Offer,
    TransportName,
)

MAX_BATCH = 256
MAX_ROOM_TTL_S = 3600  # a room's TTL on the wire, at most (a table may allow less)
MAX_DEADLINE_S = 3600.0  # a registration's deadline
MAX_WAIT_S = 30.0  # a long-poll
DTYPE_PATTERN = "^(" + "|".join(DTYPE_NAMES) + ")$"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1, "int32": 4, "int64": 8}
assert tuple(DTYPE_BYTES) == DTYPE_NAMES

RoomId = json_int(ge=1, le=MAX_ROOM_ID)
WriterId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+$")]


class RoomState(str, enum.Enum):
    PENDING = "PENDING"  # minted, no receiver yet
    REGISTERED = "REGISTERED"  # a receiver reserved a slot and said where to write
    WRITING = "WRITING"  # the sender started writing into that slot
    SUCCESS = "SUCCESS"  # committed: the receiver may publish after its own checks
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({RoomState.SUCCESS, RoomState.FAILED, RoomState.CANCELLED, RoomState.EXPIRED})


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_room_ttl(ttl_s: float) -> None:
    """``ValueError`` for a room TTL the wire cannot carry (``MintRequest``'s and ``StreamOpen``'s
    bound), for a caller to learn before it sends."""
    if not 0 < ttl_s <= MAX_ROOM_TTL_S:
        raise ValueError(f"a room's TTL is in (0, {MAX_ROOM_TTL_S}] s, not {ttl_s}")


class MintRequest(_Body):
    count: json_int(ge=1, le=MAX_BATCH) = 1
    # the wire's bound; a table refuses a TTL over its own maximum (RoomLimits.max_ttl_s)
    ttl_s: json_float(gt=0, le=MAX_ROOM_TTL_S) = 120.0


class MintResponse(_Body):
    rooms: list[int]
    ttl_s: float


class Registration(_Body):
    """A receiver's reservation for one room: what it expects and where to write it."""

    room: RoomId
    generation: json_int(ge=0, lt=1 << 63)
    rows: json_int(gt=0, le=MAX_ROWS)
    width: json_int(gt=0, le=MAX_WIDTH)
    dtype: str = Field(pattern=DTYPE_PATTERN)
    offers: list[Offer] = Field(min_length=1, max_length=MAX_OFFERS)
    deadline_s: json_float(gt=0, le=MAX_DEADLINE_S) | None = None
    # the receiving engine's model (its compact fingerprint): a writer of another model's rows
    # fails the room instead of writing
    fingerprint: CompactFingerprint | None = None

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * DTYPE_BYTES[self.dtype]

    @model_validator(mode="after")
    def _fits_its_offers(self) -> Registration:
        """What one registration can be checked against itself: the rows fit every offer, one
        offer per transport, and no offer runs past the end of its address space."""
        kinds = [offer.kind for offer in self.offers]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"one offer per transport, got {kinds}")
        for offer in self.offers:
            if offer.capacity < self.nbytes:
                raise ValueError(
                    f"[{self.rows}, {self.width}] {self.dtype} is {self.nbytes} bytes, more than "
                    f"the {offer.kind} offer's capacity of {offer.capacity}"
                )
            start, end = offer.span()
            if start + offer.capacity > end:
                raise ValueError(
                    f"the {offer.kind} offer [{start}, +{offer.capacity}) runs past {end}"
                )
        return self


class RegisterRequest(_Body):
    receivers: list[Registration] = Field(min_length=1, max_length=MAX_BATCH)
    # > 0: after registering, long-poll (as /watch) until one of these rooms changes again, so
    # a receiver whose rows are already staged learns of the commit in the same round trip.
    wait_s: json_float(ge=0, le=MAX_WAIT_S) = 0.0
    until_ended: JsonBool = False  # as /watch's


class BeginWrite(_Body):
    room: RoomId
    generation: json_int(ge=0, lt=1 << 63)
    transport: TransportName
    write_timeout_s: json_float(gt=0, le=600) = 30.0
    # who writes (an encode worker's id): the first writer owns the room's one write; another
    # writer's begin_write is refused, so two workers never write one slot
    writer: WriterId | None = None


class BeginWriteRequest(_Body):
    writes: list[BeginWrite] = Field(min_length=1, max_length=MAX_BATCH)


class EncodeTimings(_Body):
    """Where an item's time went on the encode worker (seconds); informational, for latency
    splits."""

    queue_s: json_float(ge=0, le=86400) = (
        0.0  # intake -> the tower started its batch (or a cache hit)
    )
    encode_s: json_float(ge=0, le=86400) = (
        0.0  # the tower's time for the item's batch; 0 on a cache hit
    )
    wait_s: json_float(ge=0, le=86400) = 0.0  # rows staged -> the item's receiver registered
    transfer_s: json_float(ge=0, le=86400) = 0.0  # the write itself
    cache_hit: JsonBool = False
    # intake's estimate of queue_s (the work queued ahead at the measured pace); None: the pace
    # was not measured yet
    predicted_queue_s: json_float(ge=0, le=86400) | None = None


class CommitBody(_Body):
    room: RoomId
    generation: json_int(ge=0, lt=1 << 63)
    transport: TransportName
    rows: json_int(gt=0, le=MAX_ROWS)
    width: json_int(gt=0, le=MAX_WIDTH)
    dtype: str = Field(pattern=DTYPE_PATTERN)
    checksum: json_int(ge=0, lt=1 << 64) | None = None
    # the (t, h, w) patch grid the rows came from, so the receiver can check it placed as many
    # placeholders as the encoder's image processor produced rows
    grid_thw: (
        tuple[json_int(ge=1, le=65536), json_int(ge=1, le=65536), json_int(ge=1, le=65536)] | None
    ) = None
    shm_segment: str | None = Field(default=None, pattern=r"^epd-[A-Za-z0-9_-]{1,100}$")
    timings: EncodeTimings | None = None
    # the writer that began the write; a commit naming another writer is refused
    writer: WriterId | None = None
    # the model that computed the rows (the writer's compact fingerprint): a receiver whose engine
    # runs another refuses them
    fingerprint: CompactFingerprint | None = None


class CommitRequest(_Body):
    commits: list[CommitBody] = Field(min_length=1, max_length=MAX_BATCH)


class FailBody(_Body):
    room: RoomId
    reason: str = Field(min_length=1, max_length=500)
    # True: the writer knows no byte of it can still land (nothing was sent, or the write ended).
    settled: JsonBool = False
    # who fails it; during a write, a failure naming another writer than the room's is refused
    writer: WriterId | None = None


class FailRequest(_Body):
    failures: list[FailBody] = Field(min_length=1, max_length=MAX_BATCH)


class CancelRequest(_Body):
    rooms: list[RoomId] = Field(min_length=1, max_length=MAX_BATCH)
    reason: str = Field(default="cancelled by the receiver", min_length=1, max_length=500)


class WatchItem(_Body):
    room: RoomId
    after_version: json_int(ge=0, lt=1 << 63) = 0


class WatchRequest(_Body):
    rooms: list[WatchItem] = Field(min_length=1, max_length=MAX_BATCH)
    wait_s: json_float(ge=0, le=MAX_WAIT_S) = 0.0
    # True: answer when one of the rooms ends (or wait_s passes), not at every change: a receiver
    # has nothing to do when a write begins, and would spend a round trip on it.
    until_ended: JsonBool = False
    # True: the answer holds only the rooms past their after_version (or unknown); the others are
    # as the caller last saw them. A receiver watching a request's N rooms parses each view once
    # instead of N at every answer.
    changed_only: JsonBool = False


class RoomView(BaseModel):
    """A room as the API reports it. ``version`` grows on every change: long-polls wait past it."""

    room: int
    state: RoomState
    version: int
    registration: Registration | None = None
    transport: str | None = None
    commit: CommitBody | None = None
    reason: str | None = None
    # the writer holds the rows and waits for a receiver (set once, while the room is PENDING): a
    # gateway forwards the request then, so that the engine waits for a write, not an encode
    staged: bool = False
    cancel_requested: bool = False
    writer_settled: bool = False  # no byte of the writer can still land in the slot
    expires_in_s: float


class RoomResult(BaseModel):
    """One room's answer in a batch: its view, or why the call was refused for it."""

    room: int
    ok: bool
    view: RoomView | None = None
    error: str | None = None
    status: int = 200

    @classmethod
    def of_view(cls, room: int, view: RoomView) -> RoomResult:
        return cls(room=room, ok=True, view=view)

    @classmethod
    def refusal(cls, room: int, error: str, status: int) -> RoomResult:
        return cls(room=room, ok=False, error=error, status=status)


class BatchResponse(BaseModel):
    results: list[RoomResult]


# ---- the room stream (``/v1/rooms/stream``, a WebSocket): a receiver's registrations in, each
# registered room's end out; a writer's waits, begins and commits in, their answers out; one frame
# per batch either way --------------------------------------------------------------------------

STREAM_PATH = "/v1/rooms/stream"
MAX_FRAME_BYTES = 1 << 20  # either way: the REST bodies' limit


class StreamOpen(_Body):
    """Open rooms with the ids the caller drew (a dispatcher's, for the rooms of a standalone
    handshake: as ``/v1/rooms/mint``, without an HTTP request per placement): each room answered in
    the next frame (its view), or refused (an id in use: 409; the table full: 503)."""

    op: Literal["open"] = "open"
    rooms: list[RoomId] = Field(min_length=1, max_length=MAX_BATCH)
    ttl_s: json_float(gt=0, le=MAX_ROOM_TTL_S) = 120.0  # as MintRequest's


class StreamRegister(_Body):
    """Register receivers (as ``/v1/rooms/register``); the stream then pushes each room's end."""

    op: Literal["register"] = "register"
    receivers: list[Registration] = Field(min_length=1, max_length=MAX_BATCH)


class StreamCancel(_Body):
    """Cancel rooms (as ``/v1/rooms/cancel``); a room registered on the stream pushes its end."""

    op: Literal["cancel"] = "cancel"
    rooms: list[RoomId] = Field(min_length=1, max_length=MAX_BATCH)
    reason: str = Field(default="cancelled by the receiver", min_length=1, max_length=500)


class StreamWatchStaged(_Body):
    """Push each room once its writer holds the rows (``RoomView.staged``) or once it ends,
    whichever comes first: a gateway waits for it before it forwards a request (no
    registration)."""

    op: Literal["watch_staged"] = "watch_staged"
    rooms: list[RoomId] = Field(min_length=1, max_length=MAX_BATCH)


class StreamWatchRegistered(_Body):
    """Push each room, with its registration, once a receiver has registered it or once it has
    ended, whichever comes first: a writer whose rooms live elsewhere waits for it before it
    begins the write."""

    op: Literal["watch_registered"] = "watch_registered"
    rooms: list[RoomId] = Field(min_length=1, max_length=MAX_BATCH)


class StreamBeginWrite(_Body):
    """Begin writes (as ``/v1/rooms/begin_write``): each room answered in the next frame (its view
    without the registration and the commit, which the writer has)."""

    op: Literal["begin_write"] = "begin_write"
    writes: list[BeginWrite] = Field(min_length=1, max_length=MAX_BATCH)


class StreamCommit(_Body):
    """Commit writes (as ``/v1/rooms/commit``): each room answered as ``StreamBeginWrite``'s."""

    op: Literal["commit"] = "commit"
    commits: list[CommitBody] = Field(min_length=1, max_length=MAX_BATCH)


# The status of a registered room whose end the stream cannot tell (its tombstone is gone): a
# writer may have landed bytes, unlike a registration refused (4xx) before any writer saw it.
LOST_AFTER_REGISTRATION = 410

# A frame a dispatcher, a receiver, a gateway or a writer sends; the stream answers with
# ``BatchResponse`` frames: a call refused for a room (``ok`` false, at once), an opened room (its
# view), a registered room that ended (its view, without the registration the receiver sent), a
# watched room once it has what was watched for, a writer's begun or committed room (its view). A
# caller has one call in flight per room, so a room's result answers it.
STREAM_FRAME = TypeAdapter(
    Annotated[
        StreamOpen
        | StreamRegister
        | StreamCancel
        | StreamWatchStaged
        | StreamWatchRegistered
        | StreamBeginWrite
        | StreamCommit,
        Field(discriminator="op"),
    ]
)
