"""The dispatcher in-process: the hash ring, worker health, and whole requests through a real
encode worker into a real receiver over the loopback transport (real HTTP rooms, real ZMQ)."""

import asyncio
import io
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from epdserve.dispatcher import Dispatcher, DispatchError, HashRing, WorkerAddress, WorkerSet
from epdserve.dispatcher.media import Media
from epdserve.multimodal.items import Modality, MultimodalInputs
from epdserve.testing.images import synthetic_image
from epdserve.vision.images import image_from_bytes
from epdserve.vision.small_checkpoints import build_full
from epdserve.vision.tower import VisionTower
from epdserve.wire.rooms import RoomState
from handshake.app import create_app
from handshake.rooms import RoomTable
from handshake.server import ThreadedServer
from prefill_side import ItemState, JobState
from tests.busy_worker import BusyWorker
from tests.encode_helpers import dispatch_to, loopback_stack, mp4
from tests.profiles import examples

# ---- the ring ----------------------------------------------------------------------------------


@settings(max_examples=examples(50), deadline=None)
@given(
    members=st.sets(st.text("abcdef0123456789:.", min_size=1, max_size=12), min_size=2, max_size=8),
    keys=st.lists(st.integers(0, (1 << 128) - 1), min_size=1, max_size=40),
)
def test_removing_a_member_moves_only_its_own_keys(members, keys):
    ring = HashRing(members, replicas=16)
    before = {key: ring.owner(key) for key in keys}
    gone = sorted(members)[0]
    ring.remove(gone)
    for key, owner in before.items():
        assert ring.owner(key) == owner if owner != gone else ring.owner(key) != gone
    ring.add(gone)
    assert {key: ring.owner(key) for key in keys} == before  # and it comes back to the same arcs


def test_walk_gives_every_member_once_owner_first():
    ring = HashRing(["a:1", "b:1", "c:1"])
    for key in (0, 1 << 63, (1 << 128) - 1):
        order = list(ring.walk(key))
        assert sorted(order) == ["a:1", "b:1", "c:1"] and order[0] == ring.owner(key)
    assert list(HashRing().walk(5)) == [] and HashRing().owner(5) is None


def test_worker_addresses_parse_or_refuse():
    assert WorkerAddress.parse("10.0.0.5") == WorkerAddress("10.0.0.5", 8990, 8999)
    assert WorkerAddress.parse("w-1:9000:9001").intake_endpoint == "tcp://w-1:9001"
    v6 = WorkerAddress.parse("[fd00::5]:9000:9001")
    assert v6 == WorkerAddress("fd00::5", 9000, 9001) and WorkerAddress.parse(
        "[::1]"
    ) == WorkerAddress("::1")
    assert (v6.url, v6.intake_endpoint) == ("http://[fd00::5]:9000", "tcp://[fd00::5]:9001")
    for bad in (
        "",
        ":8990",
        "h:x",
        "h:1:2:3",
        "h:70000",
        "my host",
        "bad/host:1",
        "-h",
        "fd00::5",
        "[fd00::5",
        "[not-v6]:1",
        "[::1]x",
        "[::1]:1:2:3",
    ):
        with pytest.raises(ValueError):
            WorkerAddress.parse(bad)


# ---- health ------------------------------------------------------------------------------------


def test_a_worker_leaves_the_ring_when_not_ready_and_rejoins_when_ready():
    ready = {"now": True}
    app = create_app(not_ready=lambda: None if ready["now"] else "not ready")
    server = ThreadedServer(app).start()
    address = WorkerAddress("127.0.0.1", server.port, 1)
    dead = WorkerAddress("127.0.0.1", 1, 1)  # nothing listens on port 1
    workers = WorkerSet([address, dead], check_timeout_s=0.5)

    async def rounds():
        states = []
        for value in (True, False, True):
            ready["now"] = value
            await workers.refresh()
            states.append((sorted(workers.ring.members), workers.status()[dead.name]))
        await workers.close()
        return states

    try:
        states = asyncio.run(rounds())
    finally:
        server.stop()
    assert states[0][0] == [address.name] and "unreachable" in states[0][1]
    assert states[1][0] == []
    assert states[2][0] == [address.name]


def test_dns_discovery_resolves_a_name_to_workers():
    server = ThreadedServer(create_app()).start()
    port = server.port
    workers = WorkerSet(dns_name="localhost", bootstrap_port=port, intake_port=1)

    async def once():
        await workers.refresh()
        await workers.close()

    try:
        asyncio.run(once())
    finally:
        server.stop()
    assert f"127.0.0.1:{port}" in workers.ring.members


# ---- whole requests over loopback --------------------------------------------------------------


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    return VisionTower.load(build_full("qwen2_5_vl", str(tmp_path_factory.mktemp("q25"))))


@pytest.fixture
def stack(tower):
    with loopback_stack(tower) as (worker, receiver, _):
        yield worker, receiver


def _dispatch(worker, tower, images, **options):
    return dispatch_to(worker, tower.processor, images, **options)


def _receive(receiver, items):
    inputs = MultimodalInputs(
        [item.to_mm_item(start) for item, start in zip(items, range(0, 10**6, 10**4))]
    )
    job = receiver.start("req-1", inputs)
    return job, job.wait(20), inputs


def test_a_request_arrives_byte_exact_with_rows_from_the_image_header(stack, tower):
    worker, receiver = stack
    images = [
        synthetic_image(448, 448, 1),
        synthetic_image(640, 480, 2, "JPEG"),
        synthetic_image(200, 340, 3),
    ]
    items = _dispatch(worker, tower, images)
    assert all(item.error is None and item.worker for item in items)
    job, state, inputs = _receive(receiver, items)
    assert state is JobState.DONE, job.reasons
    for image, item in zip(images, inputs.mm_items):
        processed = tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
        expected = tower.encode_items(processed["pixel_values"], processed["image_grid_thw"])[0]
        assert torch.equal(item.encoded, expected)  # rows, placement and bytes all agree
        assert item.image_grid_thw.tolist() == processed["image_grid_thw"].tolist()


def test_images_and_a_video_in_one_request_arrive_with_rows_from_their_headers(stack, tower):
    """The video's grid comes from its container header (frame count, rate, size) and the video
    processor config; the worker decodes its sampled frames; every item arrives byte-exact."""
    from tests.test_video import transformers_frames

    worker, receiver = stack
    video = mp4(30, 72, 120, seed=5)
    media = [synthetic_image(224, 160, 6), Media(video, Modality.VIDEO), synthetic_image(96, 96, 7)]
    items = _dispatch(worker, tower, media, video_processor=tower.video_processor)
    assert all(item.error is None and item.worker for item in items)
    assert items[1].modality is Modality.VIDEO and items[1].grid_thw[0] == 3  # 6 frames at 2 fps
    job, state, inputs = _receive(receiver, items)
    assert state is JobState.DONE, job.reasons
    frames = transformers_frames(tower.video_processor, video)
    processed = tower.video_processor(videos=[frames], return_tensors="pt")
    expected = tower.encode_items(processed["pixel_values_videos"], processed["video_grid_thw"])[0]
    assert torch.equal(inputs.mm_items[1].encoded, expected)
    assert inputs.mm_items[1].video_grid_thw.tolist() == processed["video_grid_thw"].tolist()
    for index in (0, 2):
        processed = tower.processor(images=[image_from_bytes(media[index])], return_tensors="pt")
        expected = tower.encode_items(processed["pixel_values"], processed["image_grid_thw"])[0]
        assert torch.equal(inputs.mm_items[index].encoded, expected)


def test_a_dispatcher_sizing_a_video_otherwise_is_refused_before_any_encode(stack, tower):
    """Another sampling rate on the dispatcher's side: the worker sizes the video otherwise and
    fails it at intake, before decoding or encoding it."""
    import copy

    worker, receiver = stack
    elsewhere = copy.deepcopy(tower.video_processor)
    elsewhere.fps = 1.0
    calls = worker.metrics.batch_items._sum.get()
    failed = worker.table.counts()[RoomState.FAILED]
    items = _dispatch(
        worker, tower, [Media(mp4(30, 64, 64, seed=8), Modality.VIDEO)], video_processor=elsewhere
    )
    (item,) = items
    # the dispatcher learns at once, and the item comes back without a room (the caller falls
    # back); the room intake opened with it failed with the reason
    assert item.worker is None and "disagree" in item.error and item.encode_handshake is None
    assert worker.table.counts()[RoomState.FAILED] == failed + 1
    assert worker.metrics.batch_items._sum.get() == calls  # no tower call
    assert len(worker.queue) == 0


def test_mm_processor_kwargs_size_items_alike_on_both_sides_or_the_item_is_refused(tower):
    """``--mm-processor-kwargs`` (vLLM's name and meaning: keyword arguments over the processors'
    configs) given to the worker and to the dispatcher: items are sized to the smaller grid and
    delivered byte-exact; given to one side only, every item is refused at intake with the
    reason, before any encode."""
    from encode_worker.config import WorkerConfig
    from epdserve.dispatcher.cli import DispatchSettings

    kwargs = '{"max_pixels": 50176}'  # 448x448 -> a 16x16 grid instead of 32x32
    config = WorkerConfig.from_command_line(
        ["--model", tower.model_id, "--bind", "127.0.0.1", "--mm-processor-kwargs", kwargs]
    )
    settings = DispatchSettings.from_command_line(
        [
            "--model",
            tower.model_id,
            "--workers",
            "127.0.0.1",
            "--mm-processor-kwargs",
            kwargs,
            "x.png",
        ]
    )
    assert config.mm_processor_kwargs == settings.mm_processor_kwargs == {"max_pixels": 50176}
    assert settings.image_processor().size["longest_edge"] == 50176  # what the gateway sizes by
    assert settings.video_processor().size["longest_edge"] == 50176
    small = VisionTower.load(tower.model_id, processor_kwargs=config.mm_processor_kwargs)
    image = synthetic_image(448, 448, 21)
    with loopback_stack(small) as (worker, receiver, _):
        (item,) = _dispatch(worker, small, [image])
        assert item.error is None and item.grid_thw == (1, 16, 16) and item.rows == 64
        job, state, inputs = _receive(receiver, [item])
        assert state is JobState.DONE, job.reasons
        processed = small.processor(images=[image_from_bytes(image)], return_tensors="pt")
        expected = small.encode_items(processed["pixel_values"], processed["image_grid_thw"])[0]
        assert torch.equal(inputs.mm_items[0].encoded, expected)
        calls = worker.metrics.batch_items._sum.get()
        (other,) = _dispatch(worker, tower, [image])  # a dispatcher without the kwargs
        assert other.worker is None and "disagree" in other.error
        assert worker.metrics.batch_items._sum.get() == calls  # no tower call for it


def test_a_refused_item_comes_back_without_a_room_and_leaves_none_behind(stack, tower):
    worker, receiver = stack
    live = worker.table.live_rooms
    counts = worker.table.counts()
    items = _dispatch(worker, tower, [synthetic_image(224, 224, 4)], served_model="another-model")
    (item,) = items
    assert item.worker is None and "unknown model" in item.error
    assert item.encode_handshake is None
    assert worker.table.live_rooms == live and worker.table.counts() == counts  # none opened
    job, state, _ = _receive(receiver, items)  # the prefill side has no room to wait for
    assert state is JobState.DONE and job.outcomes[0].state is ItemState.SKIPPED


def test_no_healthy_worker_leaves_items_without_a_room(tower):
    async def run():
        workers = WorkerSet([WorkerAddress("127.0.0.1", 1, 1)], check_timeout_s=0.5)
        await workers.refresh()
        dispatcher = Dispatcher(workers, tower.processor)
        try:
            return await dispatcher.dispatch("req-2", [synthetic_image(224, 224, 5)])
        finally:
            await dispatcher.close()
            await workers.close()

    (item,) = asyncio.run(run())
    assert item.encode_handshake is None
    # why, per worker
    assert item.error.startswith("no healthy encode worker (127.0.0.1:1: /readyz unreachable")


def _tiff() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buffer, format="TIFF")
    return buffer.getvalue()


@pytest.mark.parametrize(
    "images, message",
    [
        ([], "1..64 images"),
        (
            [b"not an image"],
            "image 0: not an image encode workers read .*: UnidentifiedImageError$",
        ),
        (
            [synthetic_image(1, 400, 6)],
            "image 0: 1x400 cannot be resized for the tower",
        ),  # too thin for the processor
        ([synthetic_image(64, 64, 7), _tiff()], "image 1: image format 'TIFF' is not accepted"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_minted(tower, images, message):
    workers = WorkerSet([WorkerAddress("127.0.0.1", 1, 1)])
    with pytest.raises(DispatchError, match=message):
        asyncio.run(Dispatcher(workers, tower.processor).dispatch("req-3", images))
    with pytest.raises(DispatchError, match="request id"):
        asyncio.run(
            Dispatcher(workers, tower.processor).dispatch("bad id!", [synthetic_image(64, 64, 7)])
        )
    with pytest.raises(
        DispatchError, match="^photos/b.bin: not an image"
    ) as refused:  # named as the caller names it
        asyncio.run(
            Dispatcher(workers, tower.processor).dispatch(
                "req-4", [synthetic_image(64, 64, 7), b"x"], names=["photos/a.png", "photos/b.bin"]
            )
        )
    assert "BytesIO" not in str(refused.value)


def test_workers_near_the_prefill_engine_come_first_and_the_rest_stay_as_fallback():
    servers = [ThreadedServer(create_app()).start() for _ in range(3)]
    hosts = ["localhost", "127.0.0.1", "127.0.0.1"]  # two "hosts": the same machine by two names
    workers = WorkerSet(
        [WorkerAddress(host, server.port, 1) for host, server in zip(hosts, servers)]
    )

    async def check():
        await workers.refresh()
        await workers.close()

    try:
        asyncio.run(check())
    finally:
        for server in servers:
            server.stop()
    for key in (1, 1 << 40, 1 << 100):
        near = workers.candidates(key, near="127.0.0.1")
        assert [a.host for a in near] == ["127.0.0.1", "127.0.0.1", "localhost"]
        assert [a for a in workers.candidates(key) if a.host == "127.0.0.1"] == near[
            :2
        ]  # ring order kept


def test_a_busy_worker_is_left_alone_and_its_items_go_elsewhere(stack, tower):
    """Items whose first worker refuses "queue full" are placed on the other; the busy one is sent
    nothing more during its retry-after (its first refusals answer for it)."""
    worker, _ = stack
    busy = BusyWorker()
    images = [synthetic_image(64, 64, 100 + i) for i in range(8)]

    async def run():
        workers = WorkerSet(
            [busy.address, WorkerAddress("127.0.0.1", worker.bootstrap_port, worker.intake_port)]
        )
        await workers.refresh()
        dispatcher = Dispatcher(workers, tower.processor, intake_timeout_s=2.0)
        try:
            return await dispatcher.dispatch("req-busy", images)
        finally:
            await dispatcher.close()
            await workers.close()

    try:
        items = asyncio.run(run())
    finally:
        busy.stop()
    first_on_busy = [item for item in items if item.attempts[0] == busy.address.name]
    assert first_on_busy, "the ring sent no item to the busy worker first: pick other images"
    assert all(item.worker == f"127.0.0.1:{worker.bootstrap_port}" for item in items)
    assert busy.items == len(first_on_busy)  # one refusal each, sent together; then none


def _dispatch_to_busy(busy: BusyWorker, tower, intake_timeout_s: float, seed: int):
    """Three images dispatched with ``busy`` as the only worker (stopped afterwards)."""

    async def run():
        workers = WorkerSet([busy.address])
        await workers.refresh()
        dispatcher = Dispatcher(workers, tower.processor, intake_timeout_s=intake_timeout_s)
        try:
            return await dispatcher.dispatch(
                f"req-{seed}", [synthetic_image(64, 64, seed + i) for i in range(3)]
            )
        finally:
            await dispatcher.close()
            await workers.close()

    try:
        return asyncio.run(run())
    finally:
        busy.stop()


def test_items_no_worker_takes_fail_with_the_reason_after_bounded_retries(tower):
    busy = BusyWorker()
    items = _dispatch_to_busy(busy, tower, intake_timeout_s=1.0, seed=200)
    assert all(item.worker is None and "queue full" in item.error for item in items)
    assert all(item.encode_handshake is None for item in items)  # the caller falls back
    # backing off (0.1 s doubling to 1 s) within 1 s: a few rounds of 3 messages, not a retry
    # every 0.1 s per item (30)
    assert busy.items <= 18
    assert busy.table.counts() == RoomTable().counts()  # no room minted there, none left


def test_items_a_worker_cannot_take_within_the_intake_timeout_fail_at_once(tower):
    """A busy refusal whose retry-after is past the intake timeout (the worker's queue holds more
    than the item's deadline allows) ends the item's dispatch at once, with the worker's reason
    and its retry-after: one message per item, no backing off for the whole timeout."""
    busy = BusyWorker("busy: about 40.0 s of work queued ahead", retry_after_s=20.0)
    items = _dispatch_to_busy(busy, tower, intake_timeout_s=5.0, seed=300)
    assert busy.items == 3
    assert all(
        item.worker is None and "about 40.0 s of work queued" in item.error for item in items
    )
    assert all(item.retry_after_s == 20.0 for item in items)


def test_a_gateway_learns_when_the_worker_holds_the_rows_or_failed_the_item(stack, tower):
    """``StagedWatch`` over the worker's room stream: a good image comes back staged (the worker
    holds its rows, no receiver yet), one whose header sizes it but whose pixels do not decode
    comes back with the worker's reason; the staged item is then delivered as ever."""
    from epdserve.dispatcher.staged import StagedWatch

    worker, receiver = stack
    good = synthetic_image(96, 96, 11)
    broken = synthetic_image(200, 120, 12)[:120]  # the header is whole, the pixels are cut
    items = _dispatch(worker, tower, [good, broken])
    assert all(item.error is None and item.worker for item in items)

    async def watch():
        staged = StagedWatch(token=None)
        try:
            return await staged.until_staged(items, wait_s=20)
        finally:
            await staged.close()

    ended = asyncio.run(watch())
    assert list(ended) == [1] and "FAILED" in ended[1] and "truncated" in ended[1], ended
    room = items[0].encode_handshake.bootstrap_room
    view = worker.table.view(room)
    assert view.state is RoomState.PENDING and view.staged
    job, state, inputs = _receive(receiver, items[:1])
    assert state is JobState.DONE, job.reasons


def _intake_worker():
    """A bare ROUTER socket standing for a worker's intake, and its port."""
    import zmq

    worker = zmq.Context.instance().socket(zmq.ROUTER)
    worker.setsockopt(zmq.LINGER, 0)
    return worker, worker.bind_to_random_port("tcp://127.0.0.1")


def _intake_request(room: int, source: str = "bytes"):
    from epdserve.wire.addresses import EncodeHandshake, Endpoint
    from epdserve.wire.intake import IntakeRequest

    return IntakeRequest(
        request_id=f"r{room}",
        encode_handshake=EncodeHandshake.at(Endpoint("127.0.0.1", 9), room),
        source=source,
    )


def _rooms_of(metadata: bytes) -> list[int]:
    """The rooms of a batch message's items, in order."""
    return [item["encode_handshake"]["bootstrap_room"] for item in json.loads(metadata)["items"]]


def test_a_closed_intake_client_keeps_no_caller_waiting():
    """An intake client closed while its items wait for a silent worker refuses them at once (a
    dispatcher dropping a gone worker's client), instead of leaving them to their timeout."""
    from epdserve.wire.intake import AsyncIntakeClient, IntakeRefused

    silent, port = _intake_worker()

    async def run():
        client = AsyncIntakeClient(f"tcp://127.0.0.1:{port}", timeout_s=30)
        waiting = asyncio.ensure_future(client.send(_intake_request(5), b"image"))
        await asyncio.sleep(0.1)
        client.close()
        with pytest.raises(IntakeRefused, match="closed"):
            await asyncio.wait_for(waiting, 2)

    try:
        asyncio.run(run())
    finally:
        silent.close(0)


def test_a_reply_naming_no_room_fails_only_the_message_it_answers():
    """Two messages in flight to one worker; it could not read the first (a reply naming no room)
    and answers the second: the first's items get that refusal, the second's their own replies
    (a room-less reply used to fail every item in flight)."""
    import threading

    from epdserve.wire.intake import (
        BATCH_MARKER,
        AsyncIntakeClient,
        IntakeBatchReply,
        IntakeReply,
        IntakeStatus,
    )

    worker, port = _intake_worker()

    def answer_two_messages():
        unreadable = IntakeReply(status=IntakeStatus.REFUSED, reason="bad metadata")
        identity, *_ = worker.recv_multipart()
        worker.send_multipart([identity, unreadable.frame()])
        identity, marker, metadata, *_ = worker.recv_multipart()
        assert marker == BATCH_MARKER
        replies = [
            IntakeReply(status=IntakeStatus.ACCEPTED, room=room) for room in _rooms_of(metadata)
        ]
        worker.send_multipart([identity, *IntakeBatchReply(replies=replies).frames()])

    async def run():
        client = AsyncIntakeClient(f"tcp://127.0.0.1:{port}", timeout_s=10)
        try:
            first = asyncio.ensure_future(client.send(_intake_request(1), b"image"))
            await asyncio.sleep(0.05)  # the next loop steps: a message of its own
            second = [
                asyncio.ensure_future(client.send(_intake_request(r), b"image")) for r in (2, 3)
            ]
            return await asyncio.gather(first, *second)
        finally:
            client.close()

    answering = threading.Thread(target=answer_two_messages, daemon=True)
    answering.start()
    try:
        first, *second = asyncio.run(run())
    finally:
        answering.join(10)
        worker.close(0)
    assert first.status is IntakeStatus.REFUSED and first.reason == "bad metadata"
    assert [(reply.status, reply.room) for reply in second] == [
        (IntakeStatus.ACCEPTED, 2),
        (IntakeStatus.ACCEPTED, 3),
    ]


def test_items_sent_together_get_their_own_answers_in_order_within_one_timeout():
    """``send_all``: one message for the items the client can send, each item's answer in order
    (the worker's reply, a refusal of the client's own, or a timeout for the one the worker never
    answered), and nothing left in flight after it (the timed-out room can be sent again)."""
    import threading

    from epdserve.wire.intake import (
        BATCH_MARKER,
        AsyncIntakeClient,
        IntakeBatchReply,
        IntakeRefused,
        IntakeReply,
        IntakeStatus,
    )

    worker, port = _intake_worker()
    seen: list[list[int]] = []

    def answer_all_but_room_3():
        identity, marker, metadata, *payloads = worker.recv_multipart()
        assert marker == BATCH_MARKER and len(payloads) == 3
        seen.append(_rooms_of(metadata))
        replies = [
            IntakeReply(status=IntakeStatus.ACCEPTED, room=1),
            IntakeReply(status=IntakeStatus.REFUSED, room=2, reason="queue full", retry_after_s=1),
        ]
        worker.send_multipart([identity, *IntakeBatchReply(replies=replies).frames()])

    async def run():
        client = AsyncIntakeClient(f"tcp://127.0.0.1:{port}", timeout_s=0.5)
        try:
            answers = await client.send_all(
                [
                    (_intake_request(1), b"a"),
                    (_intake_request(2), b"b"),
                    (_intake_request(2), b"again"),  # a room already in flight
                    (_intake_request(3), b"c"),
                    (_intake_request(4, "shm"), b"d"),  # the payload disagrees with the source
                ]
            )
            again = await client.send_all([(_intake_request(3, "shm"), b"c")])
            return answers, again
        finally:
            client.close()

    answering = threading.Thread(target=answer_all_but_room_3, daemon=True)
    answering.start()
    try:
        answers, again = asyncio.run(run())
    finally:
        answering.join(10)
        worker.close(0)
    assert seen == [[1, 2, 3]]
    accepted, refused, duplicate, timed_out, mismatched = answers
    assert accepted.status is IntakeStatus.ACCEPTED and accepted.room == 1
    assert refused.status is IntakeStatus.REFUSED and refused.retry_after_s == 1
    assert isinstance(duplicate, IntakeRefused) and "already has a message" in str(duplicate)
    assert isinstance(timed_out, TimeoutError) and "within 0.5 s" in str(timed_out)
    assert isinstance(mismatched, IntakeRefused) and "disagree" in str(mismatched)
    (retried,) = again
    assert isinstance(retried, IntakeRefused) and "disagree" in str(retried)  # not "in flight"


def test_items_placed_with_a_standalone_handshake_open_their_rooms_over_its_stream(
    stack, tower, monkeypatch
):
    """With ``rooms_url`` (a standalone handshake), the dispatcher opens each placement's rooms
    there over one room stream (no mint call), the worker writes into them, and the request
    arrives; an item whose drawn id is in use there fails alone, with why, and is not sent."""
    from epdserve.dispatcher import dispatch as dispatch_module

    class CountingTable(RoomTable):
        def __init__(self):
            super().__init__()
            self.minted, self.opened = 0, []

        def mint(self, count, ttl_s):
            self.minted += count
            return super().mint(count, ttl_s)

        def open_all(self, room_ids, ttl_s):
            self.opened.append(len(room_ids))
            return super().open_all(room_ids, ttl_s)

    worker, receiver = stack
    table = CountingTable()
    server = ThreadedServer(create_app(table)).start()
    (in_use,) = table.mint(1, 60)
    drawn = iter([in_use, 1001, 1002, 1003])
    monkeypatch.setattr(dispatch_module, "drawn_room_id", lambda: next(drawn))
    try:
        images = [synthetic_image(64 + 16 * i, 64, i) for i in range(4)]
        clash, *items = _dispatch(worker, tower, images, rooms_url=server.url, room_ttl_s=60)
        assert clash.worker is None and "exists already" in clash.error
        assert all(item.error is None and item.worker for item in items)
        assert {item.encode_handshake.url for item in items} == {server.url}
        assert table.minted == 1 and table.opened == [4]  # (the test's own mint) one frame
        job, state, _ = _receive(receiver, items)
        assert state is JobState.DONE, job.reasons
        rooms = [item.encode_handshake.bootstrap_room for item in items]
        assert rooms == [1001, 1002, 1003]
        assert [table.view(room).state for room in rooms] == [RoomState.SUCCESS] * 3
    finally:
        server.stop()
