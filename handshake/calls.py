"""The room API's batch calls over one table: a typed body in, per-room results out. What the REST
app (``handshake.app``) and the room socket (``handshake.room_socket``) both serve, so the two
faces answer alike."""

from __future__ import annotations

from collections.abc import Callable

from handshake.models import (
    BeginWriteRequest,
    CancelRequest,
    CommitRequest,
    FailRequest,
    RegisterRequest,
    RoomResult,
    RoomView,
    WatchRequest,
)
from handshake.rooms import RoomError, RoomTable

# Each batch call's name (its REST path under /v1/rooms/, its route on the room socket) and body.
BATCH_BODIES = {
    "register": RegisterRequest,
    "begin-write": BeginWriteRequest,
    "commit": CommitRequest,
    "fail": FailRequest,
    "cancel": CancelRequest,
    "watch": WatchRequest,
}


def ok(room: int, view: RoomView) -> RoomResult:
    return RoomResult.model_construct(room=room, ok=True, view=view, error=None, status=200)


def refused(room: int, error: RoomError) -> RoomResult:
    return RoomResult.model_construct(
        room=room, ok=False, view=None, error=str(error), status=error.status
    )


def _result(room: int, call: Callable[[], RoomView]) -> RoomResult:
    try:
        return ok(room, call())
    except RoomError as exc:
        return refused(room, exc)


def _watch_results(versions: dict[int, int], views: list) -> list[RoomResult]:
    return [
        refused(room, v) if isinstance(v, RoomError) else ok(room, v)
        for room, v in zip(versions, views)
    ]


class RoomCalls:
    def __init__(self, table: RoomTable):
        self.table = table

    async def call(self, name: str, body) -> list[RoomResult]:
        """The batch call ``name`` (a key of ``BATCH_BODIES``) with its validated ``body``."""
        return await getattr(self, name.replace("-", "_"))(body)

    async def register(self, body: RegisterRequest) -> list[RoomResult]:
        table = self.table
        results = [_result(r.room, lambda r=r: table.register(r)) for r in body.receivers]
        if body.wait_s > 0:
            versions = {
                r.room: r.view.version for r in results if r.ok and not r.view.state.terminal
            }
            if len(versions) == len(results):
                results = _watch_results(versions, await table.watch(versions, body.wait_s))
        return results

    async def begin_write(self, body: BeginWriteRequest) -> list[RoomResult]:
        return [_result(w.room, lambda w=w: self.table.begin_write(w)) for w in body.writes]

    async def commit(self, body: CommitRequest) -> list[RoomResult]:
        return [_result(c.room, lambda c=c: self.table.commit(c)) for c in body.commits]

    async def fail(self, body: FailRequest) -> list[RoomResult]:
        return [
            _result(f.room, lambda f=f: self.table.fail(f.room, f.reason, f.settled, f.writer))
            for f in body.failures
        ]

    async def cancel(self, body: CancelRequest) -> list[RoomResult]:
        return [
            _result(room, lambda room=room: self.table.cancel(room, body.reason))
            for room in body.rooms
        ]

    async def watch(self, body: WatchRequest) -> list[RoomResult]:
        versions = {item.room: item.after_version for item in body.rooms}
        return _watch_results(versions, await self.table.watch(versions, body.wait_s))
