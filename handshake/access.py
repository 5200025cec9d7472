"""How either side reaches a room: in-process (the encode worker's own table, no HTTP to itself)
or over REST (any other endpoint). Both raise ``RoomError`` subclasses or ``HandshakeError``.
Waiting for a room to change (``wait_async``) runs on the caller's event loop and holds no thread;
the other calls are quick and blocking."""

from __future__ import annotations

import asyncio

from handshake.rooms import RoomError, RoomNotFound, RoomTable
from wire.room_client import SyncHandshakeClient
from wire.rooms import BeginWrite, CommitBody, FailBody, RoomView


class LocalRooms:
    in_process = True  # calls never leave this process (they cannot block on a peer)

    def __init__(self, table: RoomTable):
        self.table = table

    async def wait_async(self, room: int, after_version: int, wait_s: float) -> RoomView:
        (view,) = await self.table.watch({room: after_version}, wait_s)
        if isinstance(view, RoomError):
            raise view
        return view

    def begin_write(self, write: BeginWrite) -> RoomView:
        return self.table.begin_write(write)

    def commit(self, commit: CommitBody) -> RoomView:
        return self.table.commit(commit)

    def fail(self, room: int, reason: str, settled: bool, writer: str | None = None) -> RoomView:
        return self.table.fail(room, reason, settled, writer)


class RemoteRooms:
    in_process = False

    def __init__(self, client: SyncHandshakeClient):
        self.client = client

    @staticmethod
    def _one(results) -> RoomView:
        (result,) = results
        if not result.ok:
            error = RoomNotFound if result.status == 404 else RoomError
            raise error(result.error)
        return result.view

    async def wait_async(self, room: int, after_version: int, wait_s: float) -> RoomView:
        return self._one(
            await asyncio.wrap_future(self.client.submit("watch", {room: after_version}, wait_s))
        )

    def begin_write(self, write: BeginWrite) -> RoomView:
        return self._one(self.client.begin_write([write]))

    def commit(self, commit: CommitBody) -> RoomView:
        return self._one(self.client.commit([commit]))

    def fail(self, room: int, reason: str, settled: bool, writer: str | None = None) -> RoomView:
        return self._one(
            self.client.fail(
                [FailBody(room=room, reason=reason[:500], settled=settled, writer=writer)]
            )
        )
