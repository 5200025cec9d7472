"""The room stream's and the REST API's answers as JSON, encoded without a pydantic model per room:
a room's view (``RoomView``'s fields), one room's result (``RoomResult``'s) and a frame of them
(``BatchResponse``'s). The wire's models stay what a client parses; these are the same documents,
made at a sixth of the cost (a validated ``RoomView`` and ``RoomResult``, then their dump, cost ~6
us a room, five times in a room's life at a standalone handshake). A room's registration and commit
are serialized once, when the room takes them (``Room.registration_json``, ``Room.commit_json``),
and spliced in as they are. ``tests/test_room_answers.py`` holds each struct's fields to its
model's, and each document to the model's own parse."""

from __future__ import annotations

import msgspec

from epdserve.wire.rooms import RoomState

_encode = msgspec.json.Encoder().encode


class ViewJson(msgspec.Struct):
    """``wire.rooms.RoomView``, its fields in its order."""

    room: int
    state: RoomState
    version: int
    registration: msgspec.Raw | None
    transport: str | None
    commit: msgspec.Raw | None
    reason: str | None
    staged: bool
    cancel_requested: bool
    writer_settled: bool
    expires_in_s: float


class ResultJson(msgspec.Struct):
    """``wire.rooms.RoomResult``: a room's view (as JSON already), or why the call was refused for
    it."""

    room: int
    ok: bool
    view: msgspec.Raw | None = None
    error: str | None = None
    status: int = 200


class FrameJson(msgspec.Struct):
    """``wire.rooms.BatchResponse``."""

    results: list[ResultJson]


def view(fields: ViewJson) -> msgspec.Raw:
    return msgspec.Raw(_encode(fields))


def viewed(room: int, view_json: msgspec.Raw) -> ResultJson:
    return ResultJson(room, True, view_json)


def refused(room: int, error: str, status: int) -> ResultJson:
    return ResultJson(room, False, None, error, status)


def frame(results: list[ResultJson]) -> str:
    return _encode(FrameJson(results)).decode()
