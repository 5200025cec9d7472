"""The room stream (``/v1/rooms/stream``) against a real uvicorn server on loopback, through the
receiver's client: registrations in, each registered room's end pushed out, rooms that end
together in one frame; refusals at once; auth; a malformed or oversized frame closes the stream
and nothing else."""

import asyncio

import aiohttp
import pytest

from epdserve.wire.room_client import HandshakeClient, HandshakeError, SyncHandshakeClient
from epdserve.wire.room_stream import RoomStreamClient
from epdserve.wire.rooms import STREAM_PATH, RoomState
from handshake.app import create_app
from handshake.rooms import RoomNotFound, RoomTable
from handshake.server import ThreadedServer
from tests.handshake_helpers import begin, commit, registration

TOKEN = "stream-secret"


@pytest.fixture(scope="module")
def served():
    table = RoomTable()
    server = ThreadedServer(create_app(table, token=TOKEN)).start()
    yield server, table
    server.stop()


async def _open(server) -> tuple[HandshakeClient, RoomStreamClient]:
    client = HandshakeClient(server.url, token=TOKEN, timeout_s=5)
    return client, await RoomStreamClient.open(client)


async def _results(stream: RoomStreamClient, count: int) -> dict:
    """The next ``count`` rooms' results by room, and how many frames carried them."""
    by_room, frames = {}, 0
    async with asyncio.timeout(10):
        while len(by_room) < count:
            frames += 1
            for result in await stream.receive():
                by_room[result.room] = result
    return by_room, frames


def _write(table: RoomTable, *rooms: int) -> None:
    for room in rooms:
        table.begin_write(begin(room))


def test_rooms_that_end_together_come_in_one_frame_and_a_refusal_comes_at_once(served):
    server, table = served
    rooms = table.mint(3, 30)

    async def scenario():
        client, stream = await _open(server)
        try:
            unknown = rooms[-1] + 1 if rooms[-1] < 2**62 else 1
            stream.register([registration(room) for room in rooms] + [registration(unknown)])
            refused, _ = await _results(stream, 1)
            assert not refused[unknown].ok and refused[unknown].status == 404
            assert "unknown" in refused[unknown].error
            # the table changes from another thread (as the encode worker's stages change it)
            await asyncio.to_thread(_write, table, *rooms)
            await asyncio.to_thread(
                lambda: (
                    [table.commit(commit(room)) for room in rooms[:2]]
                    + [table.fail(rooms[2], "tower out of memory", settled=True)]
                )
            )
            ended, frames = await _results(stream, 3)
            assert frames <= 2  # ended within one step of the loop: one frame (two at most)
            assert [ended[room].view.state for room in rooms] == [
                RoomState.SUCCESS,
                RoomState.SUCCESS,
                RoomState.FAILED,
            ]
            assert ended[rooms[0]].view.commit.checksum == 7
            assert ended[rooms[0]].view.registration is None  # the receiver has its own
            assert ended[rooms[2]].view.reason == "tower out of memory"
        finally:
            await stream.close()
            await client.close()

    asyncio.run(scenario())


def test_a_cancel_over_the_stream_ends_a_registered_room_and_a_retry_changes_nothing(served):
    server, table = served
    (room,) = table.mint(1, 30)

    async def scenario():
        client, stream = await _open(server)
        try:
            stream.register([registration(room)])
            stream.register([registration(room)])  # a retry: the same registration, one end
            stream.cancel([room], "user went away")
            ended, _ = await _results(stream, 1)
            assert ended[room].view.state is RoomState.CANCELLED
            assert ended[room].view.reason == "user went away"
            with pytest.raises(TimeoutError):  # nothing more for this room
                async with asyncio.timeout(0.3):
                    await stream.receive()
        finally:
            await stream.close()
            await client.close()

    asyncio.run(scenario())


def test_a_room_whose_stream_closed_goes_on_without_it(served):
    server, table = served
    (room,) = table.mint(1, 30)

    async def scenario():
        client, stream = await _open(server)
        stream.register([registration(room)])
        async with asyncio.timeout(10):
            while table.view(room).state is not RoomState.REGISTERED:
                await asyncio.sleep(0.01)
        await stream.close()
        await client.close()

    asyncio.run(scenario())
    _write(table, room)
    assert table.commit(commit(room)).state is RoomState.SUCCESS
    rest = SyncHandshakeClient(server.url, token=TOKEN)
    try:
        (result,) = rest.watch({room: 0})
        assert result.view.state is RoomState.SUCCESS
    finally:
        rest.close()


def test_the_stream_needs_the_bearer_token(served):
    server, _ = served

    async def scenario():
        for token in (None, "wrong"):
            client = HandshakeClient(server.url, token=token, timeout_s=5)
            try:
                with pytest.raises(HandshakeError, match="room stream refused") as refused:
                    await RoomStreamClient.open(client)
                assert refused.value.status == 403
            finally:
                await client.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "frame, code",
    [
        ('{"op": "register", "receivers": []}', 1007),  # empty: malformed
        ('{"op": "drop_table"}', 1007),
        ("not json", 1007),
        ('{"op": "cancel", "rooms": [' + ",".join(["1"] * 600_000) + "]}", 1009),  # over 1 MiB
    ],
)
def test_a_malformed_or_oversized_frame_closes_that_stream_only(served, frame, code):
    server, table = served

    async def scenario():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(
                server.url + STREAM_PATH, headers={"Authorization": f"Bearer {TOKEN}"}
            ) as websocket:
                await websocket.send_str(frame)
                async with asyncio.timeout(10):
                    message = await websocket.receive()
                assert message.type is aiohttp.WSMsgType.CLOSE, message
                assert websocket.close_code == code, (websocket.close_code, message.extra)
        # the server serves on: a new stream registers and hears the end
        (room,) = table.mint(1, 30)
        client, stream = await _open(server)
        try:
            stream.register([registration(room)])
            stream.cancel([room], "done")
            ended, _ = await _results(stream, 1)
            assert ended[room].view.state is RoomState.CANCELLED
        finally:
            await stream.close()
            await client.close()

    asyncio.run(scenario())


def test_a_watched_room_comes_back_once_staged_or_ended(served):
    """A gateway's watch: a room comes back when its writer holds the rows (still PENDING), one
    staged before the watch comes back at once, one that fails before it is staged comes back
    with its end; a registration or a begun write alone is no news."""
    server, table = served
    early, later, failing = table.mint(3, 30)
    table.mark_staged(early)

    async def scenario():
        client, stream = await _open(server)
        try:
            stream.watch_staged([early, later, failing])
            first, _ = await _results(stream, 1)
            assert first[early].view.staged and first[early].view.state is RoomState.PENDING
            await asyncio.to_thread(table.mark_staged, later)
            await asyncio.to_thread(table.fail, failing, "cannot decode", True)
            rest, _ = await _results(stream, 2)
            assert rest[later].view.staged and rest[later].view.state is RoomState.PENDING
            assert rest[failing].view.state is RoomState.FAILED and not rest[failing].view.staged
        finally:
            await stream.close()
            await client.close()

    asyncio.run(scenario())
    assert table.mark_staged(failing) is None  # an ended room is not staged


def test_a_writer_waits_begins_and_commits_over_the_stream(served):
    """A writer's calls: a room watched until registered comes back once its receiver registers it
    (with the registration), one registered already at once (once, though asked for twice),
    one unknown as refused (404); a
    frame of begins and a frame of commits are answered per room, a stale generation refused
    alone (409); the rooms end as they would over REST."""
    server, table = served
    waiting, ready = table.mint(2, 30)
    table.register(registration(ready))
    unknown = max(waiting, ready) + 1

    async def scenario():
        client, stream = await _open(server)
        try:
            stream.watch_registered([waiting, ready, ready, unknown])  # (ready: twice)
            first, _ = await _results(stream, 2)
            assert first[ready].view.state is RoomState.REGISTERED
            assert first[ready].view.registration == registration(ready)
            assert not first[unknown].ok and first[unknown].status == 404
            await asyncio.to_thread(table.register, registration(waiting))
            second, _ = await _results(stream, 1)
            assert second[waiting].view.registration == registration(waiting)
            stream.begin_write([begin(waiting), begin(ready, generation=2)])
            begun, frames = await _results(stream, 2)
            assert frames == 1 and begun[waiting].view.state is RoomState.WRITING
            assert begun[ready].status == 409 and "stale generation" in begun[ready].error
            stream.begin_write([begin(ready)])
            await _results(stream, 1)
            stream.commit([commit(waiting), commit(ready, checksum=9)])
            committed, frames = await _results(stream, 2)
            assert frames == 1
            assert [committed[room].view.state for room in (waiting, ready)] == [
                RoomState.SUCCESS
            ] * 2
        finally:
            await stream.close()
            await client.close()

    asyncio.run(scenario())
    assert table.view(ready).commit.checksum == 9


def test_a_dispatcher_opens_rooms_with_the_ids_it_drew_over_the_stream():
    """An open is answered per room in one frame: each new room's view (PENDING, at the TTL asked
    for), an id in use refused alone (409), a TTL over the table's maximum refused for every room
    (400); ``RemoteRooms`` gives each room's answer in order, a full table's refusal among them."""
    from epdserve.wire.rooms import MAX_ROOM_ID
    from handshake.access import RemoteRooms
    from handshake.rooms import RoomConflict, RoomLimits, RoomsFull

    table = RoomTable(RoomLimits(max_live_rooms=4, max_ttl_s=60))
    server = ThreadedServer(create_app(table, token=TOKEN)).start()
    (used,) = table.mint(1, 30)
    fresh = [used + 1 if used < MAX_ROOM_ID else 1, used - 1 if used > 1 else 2]

    async def scenario():
        client, stream = await _open(server)
        try:
            stream.open_rooms([*fresh, used], 30)
            opened, frames = await _results(stream, 3)
            assert frames == 1
            assert [opened[room].view.state for room in fresh] == [RoomState.PENDING] * 2
            assert 29 < opened[fresh[0]].view.expires_in_s <= 30
            assert opened[used].status == 409 and "exists already" in opened[used].error
            stream.open_rooms([7, 8], 61)  # over this table's 60 s
            too_long, _ = await _results(stream, 2)
            assert {result.status for result in too_long.values()} == {400}
        finally:
            await stream.close()
            await client.close()
        rooms = RemoteRooms(None, HandshakeClient(server.url, token=TOKEN, timeout_s=5))
        try:
            with pytest.raises(ValueError, match="TTL"):  # refused before it is sent
                await rooms.open_rooms([9], 3601)
            in_use, twice, again = await rooms.open_rooms([used, 9, 9], 30)
            (over,) = await rooms.open_rooms([10], 30)  # one live room was left of four
        finally:
            await rooms.aclose()
        assert isinstance(in_use, RoomConflict) and "exists already" in str(in_use)
        assert twice.state is RoomState.PENDING and twice.room == 9
        assert isinstance(again, RoomConflict) and "in flight" in str(again)
        assert isinstance(over, RoomsFull) and "live rooms" in str(over)

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
    assert table.view(fresh[0]).state is RoomState.PENDING and table.live_rooms == 4


def test_closing_remote_rooms_leaves_no_task_of_a_stream_the_server_ended():
    """A stream the server ended (it stopped) is closed by its reader, and ``aclose`` ends what
    is left of it (the guard's sleep): no task of theirs outlives the close."""
    from handshake.access import RemoteRooms

    server = ThreadedServer(create_app(RoomTable(), token=TOKEN)).start()

    async def scenario():
        rooms = RemoteRooms(None, HandshakeClient(server.url, token=TOKEN, timeout_s=5))
        (opened,) = await rooms.open_rooms([5], 30)
        assert opened.state is RoomState.PENDING
        server.stop()
        (gone,) = await rooms.open_rooms([6], 30)  # answered by the stream's end, or no stream
        assert isinstance(gone, HandshakeError), gone
        await rooms.aclose()
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    try:
        assert asyncio.run(scenario()) == []
    finally:
        server.stop()


def test_opens_whose_stream_ended_before_their_answer_are_cancelled_and_again_while_unknown(
    monkeypatch,
):
    """The server applies an open frame and ends the stream before it answers: the rooms are
    answered as not open, and cancelled over REST with no further call (those that were opened
    end CANCELLED with why; one the table refused, full, is unknown there); an id whose open was
    lost is refused if asked for again; the freed rooms take new opens; and the cancel goes out
    again while a room is unknown, so that an open landing late (a stalled connection's) is
    cancelled too."""
    from handshake import access
    from handshake import stream as room_stream
    from handshake.access import LOST_OPEN_REASON, RemoteRooms
    from handshake.rooms import RoomConflict, RoomLimits

    monkeypatch.setattr(access, "LOST_OPEN_CANCEL_AT_S", (0.0, 1.0))
    table = RoomTable(RoomLimits(max_live_rooms=2))
    server = ThreadedServer(create_app(table, token=TOKEN)).start()
    answer, dropped = room_stream.RoomStream._answer, []

    def end_before_the_first_answer(stream, rooms, statuses):
        if dropped:
            return answer(stream, rooms, statuses)
        dropped.append(list(zip(rooms, [type(status).__name__ for status in statuses])))
        stream._closing = asyncio.ensure_future(stream.websocket.close())

    monkeypatch.setattr(room_stream.RoomStream, "_answer", end_before_the_first_answer)

    async def until(condition, what: str):
        try:
            async with asyncio.timeout(10):
                while not condition():
                    await asyncio.sleep(0.01)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}") from None

    def cancelled(room: int) -> bool:
        try:
            return table.view(room).state is RoomState.CANCELLED
        except RoomNotFound:
            return False

    async def scenario():
        rooms = RemoteRooms(None, HandshakeClient(server.url, token=TOKEN, timeout_s=5))
        try:
            lost = await rooms.open_rooms([11, 12, 13], 30)
            assert all(isinstance(answer, HandshakeError) for answer in lost), lost
            await until(lambda: cancelled(11) and cancelled(12), "the lost opens' cancels")
            table.open(13, 30)  # the open the table refused lands now, as a stalled one would
            assert table.view(13).state is RoomState.PENDING
            (again,) = await rooms.open_rooms([11], 30)
            (opened,) = await rooms.open_rooms([15], 30)
            await until(lambda: cancelled(13), "the cancel sent again")
            return again, opened
        finally:
            await rooms.aclose()

    try:
        again, opened = asyncio.run(scenario())
    finally:
        server.stop()
    # (an opened room's answer is the room as the open left it: its view's JSON goes out)
    assert dropped == [[(11, "RoomStatus"), (12, "RoomStatus"), (13, "RoomsFull")]]
    assert table.view(11).reason == table.view(12).reason == table.view(13).reason
    assert table.view(11).reason == LOST_OPEN_REASON
    assert isinstance(again, RoomConflict) and "lost" in str(again)
    assert opened.state is RoomState.PENDING


@pytest.mark.parametrize("count", [0, 1, 8, 9, 16, 17, 40, 512, 513, 1000])
def test_a_steps_calls_go_in_two_frames_for_the_peer_to_answer_the_first_early(count):
    """Every call is sent once and in order: up to ``FRAME_ROOMS_WHOLE`` in one frame, more in two
    halves (so that the peer can answer the first while the caller sends the second: one frame per
    step puts callers in lockstep), none over the server's ``MAX_BATCH``."""
    from epdserve.wire.room_stream import FRAME_ROOMS_WHOLE, step_frames
    from epdserve.wire.rooms import MAX_BATCH

    pending = list(range(count))
    frames = []
    for frame in step_frames(pending):
        frames.append(frame)
        pending.append("later")  # (a call made while a frame is sent: the next pass's)
    assert pending == ["later"] * len(frames)
    assert [call for frame in frames for call in frame] == list(range(count))
    assert all(1 <= len(frame) <= MAX_BATCH for frame in frames)
    if count <= FRAME_ROOMS_WHOLE:
        assert len(frames) == min(count, 1)
    elif count <= 2 * MAX_BATCH:
        assert len(frames) == 2 and abs(len(frames[0]) - len(frames[1])) <= 1
