"""Where the encode worker's writes run: a small SHM write on the handshake loop, so a receiver's
register-and-wait is answered with the commit in one round trip; a large one on a sender thread,
so the loop keeps serving."""

import contextlib
import threading

import pytest
import torch

from encode_worker.sender import Sender
from encode_worker.writes import StagedItem, stage
from epdserve.data_plane.commit import EmbeddingLayout, checksum, checksum_bytes
from epdserve.data_plane.pool import MemoryRegion, SlotPool
from epdserve.data_plane.shm_transport import ShmTransport
from epdserve.loop_threads import LoopThread
from epdserve.testing.receive_items import loopback_encode_handshake
from epdserve.wire.room_client import HandshakeClient, SyncHandshakeClient
from epdserve.wire.rooms import Registration, RoomState
from handshake.access import LocalRooms, RemoteRooms
from handshake.app import create_app
from handshake.rooms import RoomTable
from handshake.server import ThreadedServer
from tests.waiting import eventually


class RecordingShm(ShmTransport):
    """The real SHM transport, noting which thread ran each write."""

    def __init__(self):
        super().__init__()
        self.threads = []

    def _submit(self, src, nbytes, offer, deadline):
        self.threads.append(threading.current_thread().name)
        return super()._submit(src, nbytes, offer, deadline)


def _registration(room: int, slot, layout: EmbeddingLayout, shm, receive_pool) -> Registration:
    """The receiver's registration of ``slot`` for ``layout``, offering SHM."""
    return Registration(
        room=room,
        generation=slot.generation,
        rows=layout.rows,
        width=layout.width,
        dtype=layout.dtype,
        offers=[shm.offer(receive_pool, slot)],
    )


def _staged(ring, port: int, room: int, embedding: torch.Tensor) -> StagedItem:
    """``embedding`` staged in ``ring`` for room ``room`` of the room API on ``port``."""
    return StagedItem(
        "r",
        loopback_encode_handshake(room, port),
        stage(ring, embedding),
        EmbeddingLayout.of(embedding),
        checksum(embedding),
        {},
    )


class CountingTable(RoomTable):
    """The real table, noting how many rooms each batched begin and commit call carried."""

    def __init__(self):
        super().__init__()
        self.arrived, self.begun, self.committed = [], [], []

    def arrivals(self, listeners):
        self.arrived.append(len(listeners))
        return super().arrivals(listeners)

    def begin_writes(self, writes, **kwargs):
        self.begun.append(len(writes))
        return super().begin_writes(writes, **kwargs)

    def commit_all(self, commits, **kwargs):
        self.committed.append(len(commits))
        return super().commit_all(commits, **kwargs)


@contextlib.contextmanager
def _reporting_sender(table: RoomTable, shm, ring, name: str, **options):
    """A sender of its own (on a loop of its own) into ``table``'s rooms: it, and the list its
    items' outcomes go to."""
    loop = LoopThread(name)
    outcomes = []
    sender = Sender(
        ring,
        {"shm": shm},
        lambda handshake: LocalRooms(table),
        loop,
        on_outcome=outcomes.append,
        **options,
    )
    try:
        yield sender, outcomes
    finally:
        sender.close()
        loop.stop()


@pytest.fixture
def encode_side(no_new_segments):
    table = CountingTable()
    loop = LoopThread("handshake")
    server = ThreadedServer(create_app(table), loop=loop).start()
    shm = RecordingShm()
    ring = SlotPool(MemoryRegion.anonymous(16 << 20), 1 << 16, quarantine_s=5)
    sender = Sender(
        ring, {"shm": shm}, lambda handshake: LocalRooms(table), loop, inline_write_bytes=1 << 20
    )
    client = SyncHandshakeClient(server.url)
    receive_pool = SlotPool(MemoryRegion.shared(16 << 20), 1 << 16, quarantine_s=5)
    yield table, server, shm, ring, sender, client, receive_pool
    client.close()
    sender.close()
    server.stop()
    loop.stop()
    shm.close()
    ring.region.close()
    receive_pool.region.close()


@pytest.mark.parametrize(
    "rows, runs_on", [(64, "handshake"), (1024, "sender")]
)  # 256 KiB / 4 MiB of float32
def test_small_shm_writes_run_on_the_handshake_loop_and_large_ones_on_a_sender_thread(
    encode_side, rows, runs_on
):
    table, server, shm, ring, sender, client, receive_pool = encode_side
    embedding = torch.randn(rows, 1024)
    layout = EmbeddingLayout.of(embedding)
    (room,) = table.mint(1, 60)
    lease = stage(ring, embedding)
    handshake = loopback_encode_handshake(room, server.port)
    sender.submit(
        StagedItem("r", handshake, lease, layout, checksum(embedding), {})
    )  # staged before the receiver
    slot = receive_pool.lease(layout.nbytes)
    (answer,) = client.register([_registration(room, slot, layout, shm, receive_pool)], wait_s=5)
    view = answer.view
    while not view.state.terminal:
        (answer,) = client.watch({room: view.version}, 5)
        view = answer.view
    assert view.state is RoomState.SUCCESS
    received = receive_pool.view(slot).view(torch.float32).view(rows, 1024)
    assert torch.equal(received, embedding) and checksum(received) == view.commit.checksum
    assert [name.split("_")[0] for name in shm.threads] == [runs_on]


def test_a_small_write_is_committed_within_the_receivers_register_round_trip(encode_side):
    """The receiver comes last: its one register-and-wait call already answers SUCCESS (no
    WRITING answer and second long-poll in between)."""
    table, server, shm, ring, sender, client, receive_pool = encode_side
    embedding = torch.randn(16, 256)
    layout = EmbeddingLayout.of(embedding)
    for _ in range(5):
        (room,) = table.mint(1, 60)
        handshake = loopback_encode_handshake(room, server.port)
        sender.submit(
            StagedItem("r", handshake, stage(ring, embedding), layout, checksum(embedding), {})
        )
        slot = receive_pool.lease(layout.nbytes)
        (answer,) = client.register(
            [_registration(room, slot, layout, shm, receive_pool)], wait_s=5
        )
        assert answer.view.state is RoomState.SUCCESS, answer.view
        assert torch.equal(receive_pool.view(slot).view(torch.float32).view(16, 256), embedding)
        receive_pool.release(slot)


def test_a_room_of_this_table_is_marked_staged_whatever_name_its_item_gives(encode_side):
    """A worker reached by a name it does not know takes the room for another endpoint's and
    reaches it over its room stream (here: its own server); its rows are still staged in its own
    table, which is where a gateway watching the room looks, and the item is delivered."""
    table, server, shm, ring, _, client, receive_pool = encode_side
    loop = LoopThread("stranger")
    remote = RemoteRooms(loop, HandshakeClient(server.url))
    stranger = Sender(
        ring,
        {"shm": shm},
        lambda handshake: remote,
        loop,
        local_table=table,
    )
    try:
        embedding = torch.randn(16, 256)
        layout = EmbeddingLayout.of(embedding)
        (room,) = table.mint(1, 60)
        handshake = loopback_encode_handshake(room, server.port)
        stranger.submit(
            StagedItem("r", handshake, stage(ring, embedding), layout, checksum(embedding), {})
        )
        (answer,) = client.watch({room: 1}, 5)  # the first change: staged
        assert answer.view.state is RoomState.PENDING and answer.view.staged
        slot = receive_pool.lease(layout.nbytes)
        (answer,) = client.register(
            [_registration(room, slot, layout, shm, receive_pool)], wait_s=5, until_ended=True
        )
        assert answer.view.state is RoomState.SUCCESS, answer.view
        assert torch.equal(receive_pool.view(slot).view(torch.float32).view(16, 256), embedding)
    finally:
        stranger.close()
        remote.close().result(5)
        loop.stop()


def test_items_into_another_endpoints_rooms_go_over_its_room_stream(encode_side):
    """Rooms at a standalone room API: the writer waits for their receiver, begins and commits
    over one room stream to it (no REST call), eight items delivered bit-exact; a receiver
    that never comes fails its room at the wait's end, and the room API going away under a
    waiting item fails that item as unreachable."""
    _, _, shm, ring, _, _, receive_pool = encode_side
    rooms_table = RoomTable()
    app = create_app(rooms_table)
    standalone = ThreadedServer(app).start()
    loop = LoopThread("writer")
    remote = RemoteRooms(loop, HandshakeClient(standalone.url, timeout_s=5))
    outcomes = []
    sender = Sender(
        ring,
        {"shm": shm},
        lambda handshake: remote,
        loop,
        receiver_wait_s=2,
        on_outcome=outcomes.append,
    )
    client = SyncHandshakeClient(standalone.url)
    try:
        rooms = rooms_table.mint(9, 60)
        embeddings = [torch.randn(16, 256) for _ in rooms]
        layout = EmbeddingLayout.of(embeddings[0])
        sender.submit_all(
            [
                _staged(ring, standalone.port, room, embedding)
                for room, embedding in zip(rooms, embeddings)
            ]
        )
        slots = [receive_pool.lease(layout.nbytes) for _ in rooms[:8]]
        client.register(
            [
                _registration(room, slot, layout, shm, receive_pool)
                for room, slot in zip(rooms, slots)
            ]
        )
        eventually(lambda: len(outcomes) == 9, "every item's outcome")
        states = {outcome.room: outcome.state for outcome in outcomes}
        assert [states[room] for room in rooms[:8]] == [RoomState.SUCCESS] * 8
        for slot, embedding in zip(slots, embeddings):
            assert torch.equal(receive_pool.view(slot).view(torch.float32).view(16, 256), embedding)
        assert states[rooms[8]] is RoomState.FAILED
        assert "no receiver registered within 2 s" in rooms_table.view(rooms[8]).reason
        calls = {
            (sample.labels["route"], sample.labels["method"]): sample.value
            for metric in app.state.metrics.registry.collect()
            for sample in metric.samples
            if sample.name == "epd_handshake_request_seconds_count"
        }
        assert calls[("/v1/rooms/stream", "watch_registered")] >= 1
        assert calls[("/v1/rooms/stream", "begin_write")] >= 1
        assert calls[("/v1/rooms/stream", "commit")] >= 1
        assert not any(route in ("/v1/rooms/begin_write", "/v1/rooms/commit") for route, _ in calls)
        assert ("/v1/rooms/fail", "POST") in calls  # the room nobody registered

        (room,) = rooms_table.mint(1, 60)  # the room API goes away while the item waits
        sender.submit(_staged(ring, standalone.port, room, embeddings[0]))
        eventually(
            lambda: remote._open is not None and room in remote._open.calls,
            "the item to wait on the stream",
        )
        standalone.stop()
        eventually(lambda: len(outcomes) == 10, "the waiting item's outcome")
        assert outcomes[-1].state is RoomState.FAILED
        assert outcomes[-1].reason.startswith("room unusable: ")  # (not its 2 s wait's end)
    finally:
        client.close()
        sender.close()
        remote.close().result(5)
        loop.stop()
        standalone.stop()


def test_items_whose_receiver_registers_them_together_are_written_in_one_table_call_each(
    encode_side,
):
    """Eight items staged before their receiver wait without a task each; its one registration
    call wakes them into one drain: one begin call and one commit call for the eight, every row
    delivered."""
    table, server, shm, ring, sender, client, receive_pool = encode_side
    rooms = table.mint(8, 60)
    embeddings = [torch.randn(16, 256) for _ in rooms]
    layout = EmbeddingLayout.of(embeddings[0])
    sender.submit_all(
        [_staged(ring, server.port, room, embedding) for room, embedding in zip(rooms, embeddings)]
    )
    eventually(lambda: sender._waiting.keys() == set(rooms), "the items to listen")
    assert not sender._tasks
    slots = [receive_pool.lease(layout.nbytes) for _ in rooms]
    client.register(
        [_registration(room, slot, layout, shm, receive_pool) for room, slot in zip(rooms, slots)]
    )
    eventually(lambda: all(table.view(room).state.terminal for room in rooms), "every room's end")
    assert [table.view(room).state for room in rooms] == [RoomState.SUCCESS] * 8
    assert table.begun == [8] and table.committed == [8]
    for slot, embedding in zip(slots, embeddings):
        assert torch.equal(receive_pool.view(slot).view(torch.float32).view(16, 256), embedding)


def test_items_that_wait_from_one_drain_share_its_timer_and_each_ends_alone(encode_side):
    """Four items staged together are looked at in one table call, each room marked staged,
    and wait on one timer: the two whose receiver registers are written at once, the other two
    fail when the wait ends (the first two's wake-up does not cancel it)."""
    table, server, shm, ring, _, client, receive_pool = encode_side
    with _reporting_sender(table, shm, ring, "waiting", receiver_wait_s=1.5) as (sender, outcomes):
        rooms = table.mint(4, 60)
        embeddings = [torch.randn(16, 256) for _ in rooms]
        layout = EmbeddingLayout.of(embeddings[0])
        sender.submit_all(
            [_staged(ring, server.port, room, one) for room, one in zip(rooms, embeddings)]
        )
        eventually(lambda: sender._waiting.keys() == set(rooms), "the items to listen")
        assert table.arrived == [4]
        assert all(table.view(room).staged for room in rooms)
        slots = [receive_pool.lease(layout.nbytes) for _ in rooms[:2]]
        client.register(
            [
                _registration(room, slot, layout, shm, receive_pool)
                for room, slot in zip(rooms, slots)
            ]
        )
        eventually(lambda: len(outcomes) == 2, "the registered items' outcomes")
        assert {outcome.room for outcome in outcomes} == set(rooms[:2])
        assert all(outcome.state is RoomState.SUCCESS for outcome in outcomes)
        for slot, embedding in zip(slots, embeddings):
            assert torch.equal(receive_pool.view(slot).view(torch.float32).view(16, 256), embedding)
        eventually(lambda: len(outcomes) == 4, "the waiting items' outcomes")
        for outcome in outcomes[2:]:
            assert outcome.room in rooms[2:] and outcome.state is RoomState.FAILED
            assert outcome.reason == "no receiver registered within 1.5 s"
            assert table.view(outcome.room).state is RoomState.FAILED
        assert not sender._waiting


def test_a_room_twice_in_one_drain_goes_to_the_table_once(encode_side):
    """Two items for one room in one submit (an upstream bug): the first is written by the
    drain's one table call, the second goes on alone as a task; each item gets its outcome and
    none is left counted as in flight."""
    table, server, shm, ring, _, client, receive_pool = encode_side
    with _reporting_sender(table, shm, ring, "twice") as (sender, outcomes):
        (room,) = table.mint(1, 60)
        first, second = torch.randn(16, 256), torch.randn(16, 256)
        layout = EmbeddingLayout.of(first)
        slot = receive_pool.lease(layout.nbytes)
        client.register([_registration(room, slot, layout, shm, receive_pool)])
        sender.submit_all([_staged(ring, server.port, room, one) for one in (first, second)])
        eventually(lambda: len(outcomes) == 2, "both items' outcomes")
        assert table.arrived == [1]
        assert table.view(room).state is RoomState.SUCCESS
        assert torch.equal(receive_pool.view(slot).view(torch.float32).view(16, 256), first)
        assert sender._delivering == 0


@pytest.mark.parametrize("how", ["receiver_wait", "shutdown"])
def test_an_item_waiting_for_its_receiver_fails_at_its_wait_or_at_shutdown(encode_side, how):
    table, server, shm, ring, _, client, receive_pool = encode_side
    wait_s = 0.5 if how == "receiver_wait" else 60
    with _reporting_sender(table, shm, ring, "waiting", receiver_wait_s=wait_s) as (
        sender,
        outcomes,
    ):
        (room,) = table.mint(1, 60)
        embedding = torch.randn(16, 256)
        handshake = loopback_encode_handshake(room, server.port)
        sender.submit(
            StagedItem(
                "r", handshake, stage(ring, embedding), EmbeddingLayout.of(embedding), None, {}
            )
        )
        eventually(lambda: room in sender._waiting, "the item to listen")
        if how == "shutdown":
            sender.close()
        eventually(lambda: outcomes, "the item's outcome")
        (outcome,) = outcomes
        reason = (
            "no receiver registered within 0.5 s"
            if how == "receiver_wait"
            else "encode worker shutting down"
        )
        assert outcome.state is RoomState.FAILED and outcome.reason == reason
        assert table.view(room).state is RoomState.FAILED and table.view(room).reason == reason
        assert not sender._waiting


def test_an_item_waiting_on_a_stalled_room_stream_fails_with_why(encode_side):
    """The room API stops answering (its loop blocked) while an item waits for its receiver over
    the stream: the stream's guard pings it, hears nothing for the client's timeout, and ends
    it; the wait goes on over a new stream, which cannot open, and the item fails as unreachable
    long before its 30 s receiver wait ends."""
    _, _, shm, ring, _, _, _ = encode_side
    rooms_table = RoomTable()
    server_loop = LoopThread("stalling")
    standalone = ThreadedServer(create_app(rooms_table), loop=server_loop).start()
    loop = LoopThread("writer")
    remote = RemoteRooms(loop, HandshakeClient(standalone.url, timeout_s=1))
    outcomes = []
    sender = Sender(
        ring, {"shm": shm}, lambda handshake: remote, loop, on_outcome=outcomes.append
    )  # (the receiver wait: 30 s)
    unblock = threading.Event()
    try:
        embedding = torch.randn(16, 256)
        (room,) = rooms_table.mint(1, 60)
        handshake = loopback_encode_handshake(room, standalone.port)
        sender.submit(
            StagedItem(
                "r", handshake, stage(ring, embedding), EmbeddingLayout.of(embedding), None, {}
            )
        )
        eventually(
            lambda: remote._open is not None and room in remote._open.calls,
            "the item to wait on the stream",
        )
        server_loop.loop.call_soon_threadsafe(unblock.wait, 30)
        eventually(lambda: outcomes, "the waiting item's outcome")
        assert outcomes[0].state is RoomState.FAILED
        assert outcomes[0].reason.startswith("room unusable: ")
        assert "no receiver registered" not in outcomes[0].reason
    finally:
        unblock.set()
        sender.close()
        remote.close().result(5)
        loop.stop()
        standalone.stop()
        server_loop.stop()


@pytest.mark.parametrize(
    "rows",
    [
        torch.randn(16, 64).to(torch.bfloat16),
        torch.randn(64, 16).t(),  # not contiguous: copied first
        torch.arange(40, dtype=torch.int64).reshape(5, 8),
        torch.randn(3, 7, dtype=torch.float16),
    ],
    ids=["bfloat16", "transposed", "int64", "float16-odd-width"],
)
def test_staging_through_numpy_lands_the_rows_bytes_and_their_checksum(rows):
    """``stage`` copies through numpy views (``byte_array``, ``SlotPool.bytes_of``): the ring
    holds the rows' bytes as torch lays them out, and their checksum is the rows'."""
    ring = SlotPool(MemoryRegion.anonymous(1 << 20), 1 << 12, quarantine_s=5)
    lease = stage(ring, rows)
    expected = rows.contiguous().reshape(-1).view(torch.uint8)
    assert lease.nbytes == expected.numel()
    assert torch.equal(ring.view(lease), expected)
    assert checksum_bytes(ring.bytes_of(lease)) == checksum(rows)
