"""`epd-bench handshake`: full room lifecycles through the project's client against a real server.

The server (`python -m handshake.server`, its default limits) runs in its own process on
loopback; the client here runs N concurrent lifecycles, each the production sequence with the
production calls:

1. the dispatcher opens the rooms (``stream``, as ``Dispatcher`` does with ``--rooms-url``: with
   ids it drew, over one room stream every lifecycle shares; ``rest``, as it did before: a mint
   call);
2. at once, concurrently: the receiver registers (``stream``, as ``PrefillReceiver`` does: over
   one room stream every lifecycle shares, the room's end pushed back; ``rest``, as it did
   before the stream: registers and long-polls in the same call, then long-polls
   ``/v1/rooms/watch`` until SUCCESS); the sender, an encode worker whose rooms are at a
   standalone handshake (``stream``, as ``Sender`` with ``RemoteRooms`` does: over one room
   stream every lifecycle shares, watching each room until registered; ``rest``, as it did before
   the stream: long-polls ``/v1/rooms/watch`` from version 0 until the receiver is there),
3. then begins the write and commits it (over the stream, or ``begin_write`` and ``commit`` over
   REST); the receiver hears SUCCESS.

The sender writes only once it has seen the registration, so the receiver is always waiting when
the write begins. The batch form does each call for 8 rooms at once (over the stream: 8 calls in
one loop step, one frame). Every (opener, receiver, sender, batch, concurrency) level runs once
per round, rounds interleaved (the order reversed every other round); per level: the median
throughput over the rounds and the latency percentiles of all its lifecycles. The goals are those
of the production path (``PATHS``: every step over a room stream); the same path with the mint
before it shows what the dispatcher's open over the stream changes, the REST sender runs with the
stream receiver, and the REST receiver with the REST sender (the path before the streams).
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.rounds import in_round
from epdserve.loop_threads import new_event_loop
from epdserve.wire.offers import LoopbackOffer, drawn_room_id
from epdserve.wire.room_client import HandshakeClient
from epdserve.wire.room_stream import RoomStreamClient
from epdserve.wire.rooms import BeginWrite, CommitBody, Registration, RoomState, RoomView
from handshake.access import RemoteRooms

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
BATCHES = (1, 8)
# (opener, receiver, sender): the production path, the same with the mint it made before, and the
# paths before the writer's and the receiver's streams
PATHS = (
    ("stream", "stream", "stream"),
    ("rest", "stream", "stream"),
    ("rest", "stream", "rest"),
    ("rest", "rest", "rest"),
)
POLL_S = 0.5  # the long-poll slice of both sides (ReceiverConfig.poll_s, Sender's wait)
WRITER = "epd-bench-sender"
# goals (issue 32): lifecycles/s at p99 <= 10 ms one room at a time; rooms/s in 8-room batches
GOAL_LIFECYCLES_PER_S, GOAL_P99_MS, GOAL_ROOMS_PER_S = 2500, 10.0, 15000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    process = subprocess.Popen(
        [sys.executable, "-m", "handshake.server", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
    )
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("handshake server did not start")


def _registration(room: int) -> Registration:
    return Registration(
        room=room,
        generation=1,
        rows=256,
        width=3584,
        dtype="bfloat16",
        offers=[LoopbackOffer(kind="loopback", region=1, offset=0, capacity=256 * 3584 * 2)],
    )


def _commit(room: int) -> CommitBody:
    return CommitBody(
        room=room,
        generation=1,
        transport="loopback",
        rows=256,
        width=3584,
        dtype="bfloat16",
        checksum=12345,
    )


def _views(results) -> dict:
    if not all(result.ok for result in results):
        raise RuntimeError(
            f"room calls refused: {[result.error for result in results if not result.ok]}"
        )
    return {result.room: result.view for result in results}


class StreamOpener:
    """The dispatcher as it opens rooms at a standalone handshake: ids it draws, opened over one
    room stream every lifecycle shares."""

    def __init__(self, url: str):
        self.rooms = RemoteRooms(None, HandshakeClient(url, timeout_s=10))  # the gateway's own

    async def __call__(self, client: HandshakeClient, batch: int) -> list[int]:
        rooms = [drawn_room_id() for _ in range(batch)]
        for answer in await self.rooms.open_rooms(rooms, 60):
            if not isinstance(answer, RoomView):
                raise RuntimeError(f"a room was not opened: {answer}")
        return rooms

    async def close(self) -> None:
        await self.rooms.aclose()


async def _rest_mint(client: HandshakeClient, batch: int) -> list[int]:
    return await client.mint(batch, ttl_s=60)


class StreamReceiver:
    """The receiver as ``PrefillReceiver`` runs it: one room stream for every lifecycle, each
    room's end pushed back."""

    def __init__(self, stream: RoomStreamClient):
        self.stream = stream
        self.waiting: dict[int, asyncio.Future] = {}
        self.reader = asyncio.ensure_future(self._read())

    async def __call__(self, client: HandshakeClient, rooms: list[int]) -> int:
        """Register, and wait for every room's end; returns the frames it sent."""
        loop = asyncio.get_running_loop()
        ends = [self.waiting.setdefault(room, loop.create_future()) for room in rooms]
        self.stream.register([_registration(room) for room in rooms])
        for result in await asyncio.gather(*ends):
            if not result.ok or result.view.state is not RoomState.SUCCESS:
                raise RuntimeError(f"lifecycle ended in {result}")
        return 1

    async def _read(self) -> None:
        while True:
            for result in await self.stream.receive():
                self.waiting.pop(result.room).set_result(result)

    async def close(self) -> None:
        self.reader.cancel()
        await self.stream.close()


async def _rest_receiver(client: HandshakeClient, rooms: list[int]) -> int:
    """Register and long-poll until every room is SUCCESS; returns the calls it made."""
    views = _views(await client.register([_registration(room) for room in rooms], wait_s=POLL_S))
    calls = 1
    while True:
        if any(
            view.state.terminal and view.state is not RoomState.SUCCESS for view in views.values()
        ):
            raise RuntimeError(
                f"lifecycle ended in {[view.state.value for view in views.values()]}"
            )
        live = {
            room: view.version
            for room, view in views.items()
            if view.state is not RoomState.SUCCESS
        }
        if not live:
            return calls
        views.update(_views(await client.watch(live, wait_s=POLL_S)))
        calls += 1


class StreamSender:
    """The sender as an encode worker whose rooms live elsewhere writes (``RemoteRooms``): one
    room stream for every lifecycle, each room watched until registered, then begun and
    committed; the calls of one loop step share a frame."""

    def __init__(self, url: str):
        self.rooms = RemoteRooms(None, HandshakeClient(url, timeout_s=10))  # the worker's own

    async def __call__(self, client: HandshakeClient, rooms: list[int]) -> int:
        """Returns the frames it sent."""
        for room, view in zip(rooms, await asyncio.gather(*map(self._registered, rooms))):
            if view.state is not RoomState.REGISTERED:
                raise RuntimeError(f"room {room} is {view.state.value} before the write")
        await asyncio.gather(
            *(
                self.rooms.begin_write_async(
                    BeginWrite(room=room, generation=1, transport="loopback", writer=WRITER)
                )
                for room in rooms
            )
        )
        await asyncio.gather(*(self.rooms.commit_async(_commit(room)) for room in rooms))
        return 3

    async def _registered(self, room: int):
        while True:
            view = await self.rooms.wait_registered(room, POLL_S)
            if view is not None:
                return view

    async def close(self) -> None:
        await self.rooms.aclose()


async def _rest_sender(client: HandshakeClient, rooms: list[int]) -> int:
    """Long-poll until every room has its receiver, then begin the write and commit; returns the
    calls it made."""
    waiting = {room: 0 for room in rooms}  # Sender._wait_for_receiver starts from version 0
    calls = 0
    while waiting:
        views = _views(await client.watch(waiting, wait_s=POLL_S))
        calls += 1
        for room, view in views.items():
            if view.state is RoomState.PENDING:
                waiting[room] = view.version
            elif view.state is RoomState.REGISTERED:
                del waiting[room]
            else:
                raise RuntimeError(f"room {room} is {view.state.value} before the write")
    _views(
        await client.begin_write(
            [
                BeginWrite(room=room, generation=1, transport="loopback", writer=WRITER)
                for room in rooms
            ]
        )
    )
    _views(await client.commit([_commit(room) for room in rooms]))
    return calls + 2


@dataclass
class Level:
    opener: str  # PATHS
    receiver: str
    sender: str
    batch: int
    concurrency: int
    lifecycles_per_s: list[float] = field(default_factory=list)  # one per round
    latencies_s: list[float] = field(default_factory=list)  # every lifecycle of every round
    receiver_calls: int = 0
    sender_calls: int = 0

    def summary(self) -> dict:
        latencies = sorted(self.latencies_s)
        count = len(latencies)
        lifecycles_per_s = statistics.median(self.lifecycles_per_s)
        row = {
            "opener": self.opener,
            "receiver": self.receiver,
            "sender": self.sender,
            "batch": self.batch,
            "concurrency": self.concurrency,
            "lifecycles": count,
            "lifecycles_per_s": lifecycles_per_s,
            "rooms_per_s": lifecycles_per_s * self.batch,
            "lifecycles_per_s_rounds": self.lifecycles_per_s,
            "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": latencies[min(count - 1, int(count * 0.99))] * 1e3,
            "receiver_calls_per_lifecycle": self.receiver_calls / count,
            "sender_calls_per_lifecycle": self.sender_calls / count,
        }
        if self.batch == 1:
            row["meets_goal"] = (
                row["lifecycles_per_s"] >= GOAL_LIFECYCLES_PER_S and row["p99_ms"] <= GOAL_P99_MS
            )
        else:
            row["meets_goal"] = row["rooms_per_s"] >= GOAL_ROOMS_PER_S
        return row


async def _lifecycle(
    client: HandshakeClient, opener, receiver, sender, batch: int
) -> tuple[int, int]:
    rooms = await opener(client, batch)
    return tuple(await asyncio.gather(receiver(client, rooms), sender(client, rooms)))


async def _load(url: str, level: Level, seconds: float) -> None:
    client = HandshakeClient(url, timeout_s=10)
    receiver = (
        StreamReceiver(await RoomStreamClient.open(client))
        if level.receiver == "stream"
        else _rest_receiver
    )
    sender = StreamSender(url) if level.sender == "stream" else _rest_sender
    opener = StreamOpener(url) if level.opener == "stream" else _rest_mint
    count = 0

    async def loop():
        nonlocal count
        while time.monotonic() < end:
            started = time.perf_counter()
            receiver_calls, sender_calls = await _lifecycle(
                client, opener, receiver, sender, level.batch
            )
            level.latencies_s.append(time.perf_counter() - started)
            level.receiver_calls += receiver_calls
            level.sender_calls += sender_calls
            count += 1

    try:
        for _ in range(5):  # warm the connection pool
            await _lifecycle(client, opener, receiver, sender, level.batch)
        started = time.monotonic()
        end = started + seconds
        await asyncio.gather(*(loop() for _ in range(level.concurrency)))
        level.lifecycles_per_s.append(count / (time.monotonic() - started))
    finally:
        if isinstance(receiver, StreamReceiver):
            await receiver.close()
        if isinstance(sender, StreamSender):
            await sender.close()
        if isinstance(opener, StreamOpener):
            await opener.close()
        await client.close()


def run(seconds: float = 1.0, rounds: int = 3, concurrency=CONCURRENCY, progress=print) -> dict:
    port = _free_port()
    server = start_server(port)
    url = f"http://127.0.0.1:{port}"
    levels = [
        Level(opener, receiver, sender, batch, level)
        for opener, receiver, sender in PATHS
        for batch in BATCHES
        for level in concurrency
    ]
    try:
        for round_index in range(rounds):
            for level in in_round(levels, round_index):
                with asyncio.Runner(loop_factory=new_event_loop) as runner:
                    runner.run(_load(url, level, seconds))
            progress(f"  round {round_index + 1}/{rounds} done")
    finally:
        server.terminate()
        server.wait(10)
    rows = [level.summary() for level in levels]
    return {
        "seconds_per_level_per_round": seconds,
        "rounds": rounds,
        "levels": rows,
        "goals": {
            f"batch 1: >= {GOAL_LIFECYCLES_PER_S} lifecycles/s at p99 <= {GOAL_P99_MS:.0f} ms": [
                r["concurrency"]
                for r in rows
                if r["opener"] == "stream" and r["batch"] == 1 and r["meets_goal"]
            ],
            f"batch 8: >= {GOAL_ROOMS_PER_S} rooms/s": [
                r["concurrency"]
                for r in rows
                if r["opener"] == "stream" and r["batch"] == 8 and r["meets_goal"]
            ],
        },
    }


def main(args) -> int:
    print(
        f"epd-bench handshake: {args.seconds:g} s per level and round, {args.rounds} rounds; "
        "server in its own "
        "process on loopback, default limits"
    )
    report = run(args.seconds, args.rounds)
    print(
        f"\n{'open':>6s} {'recv':>6s} {'send':>6s} {'batch':>5s} {'conc':>5s} "
        f"{'lifecycles/s':>13s} {'rooms/s':>8s} {'p50 ms':>7s} "
        f"{'p99 ms':>7s} "
        f"{'calls recv/send':>16s}  goal  per round"
    )
    for row in report["levels"]:
        rounds = " ".join(f"{v:.0f}" for v in row["lifecycles_per_s_rounds"])
        print(
            f"{row['opener']:>6s} {row['receiver']:>6s} {row['sender']:>6s} "
            f"{row['batch']:5d} {row['concurrency']:5d} "
            f"{row['lifecycles_per_s']:13.0f} "
            f"{row['rooms_per_s']:8.0f} "
            f"{row['p50_ms']:7.1f} {row['p99_ms']:7.1f} {row['receiver_calls_per_lifecycle']:8.2f}/"
            f"{row['sender_calls_per_lifecycle']:<7.2f}  "
            f"{'met ' if row['meets_goal'] else '-   '}  {rounds}"
        )
    for goal, levels in report["goals"].items():
        print(
            f"{goal} (the production path: stream opener, receiver and sender): "
            + (
                "met at concurrency " + ", ".join(map(str, levels))
                if levels
                else "not met at any level"
            )
        )
    write_json(args.json, report)
    return 0
