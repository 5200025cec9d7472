"""The prefill-side receiver against a real encode worker: in-process over loopback, faults."""

import time

import pytest
import torch

from epdserve.data_plane.loopback import LoopbackFault
from epdserve.multimodal.items import Modality, MultimodalDataItem, MultimodalInputs
from epdserve.testing.receive_items import loopback_handshake, loopback_job_inputs
from epdserve.vision.images import image_from_bytes
from epdserve.vision.small_checkpoints import build_full
from epdserve.vision.tower import VisionTower
from epdserve.wire.intake import IntakeClient
from prefill_side import JobState, PrefillReceiver, ReceiverConfig
from tests.encode_helpers import loopback_stack, mp4, png
from tests.waiting import eventually


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    return VisionTower.load(build_full("qwen2_5_vl", str(tmp_path_factory.mktemp("q25"))))


@pytest.fixture
def stack(tower):
    with loopback_stack(
        tower,
        local_tower=tower,
        worker=dict(cache_bytes=0, write_timeout_s=2),
        receiver=dict(quarantine_s=1.0, fallback="local_tower"),
    ) as (worker, receiver, loopback):
        intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
        yield worker, receiver, intake, loopback
        intake.close()


@pytest.fixture
def no_segments_of_ours():
    """No /dev/shm segment this process created is left (other processes on the machine may
    create and remove theirs meanwhile: only names with this process's pid count)."""
    import glob
    import os

    yield
    left = glob.glob(f"/dev/shm/epd-*-{os.getpid()}-*")
    assert not left, f"leaked SHM segments: {left}"


def expected_rows(tower, image):
    inputs = tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
    return tower.encode_items(inputs["pixel_values"], inputs["image_grid_thw"])[0]


def make_request(worker, tower, images, keep_pixels=False):
    rooms = worker.table.mint(len(images), 60)
    items = []
    for room, image in zip(rooms, images):
        rows = expected_rows(tower, image).shape[0]
        items.append(
            MultimodalDataItem(
                Modality.IMAGE,
                offsets=[[10, 10 + rows - 1]],
                feature=image if keep_pixels else None,
                encode_handshake=loopback_handshake(room, worker.bootstrap_port),
            )
        )
    return MultimodalInputs(items), rooms


def small_receiver(tower, loopback, **config):
    """A receiver of its own beside the stack's: a 4 MiB pool of 64 KiB slots over loopback."""
    return PrefillReceiver(
        ReceiverConfig(
            width=tower.info.wire_width,
            dtype="float32",
            pool_bytes=4 << 20,
            slot_bytes=1 << 16,
            **config,
        ),
        transports={"loopback": loopback},
    )


def send(intake, worker, room, image, tag):
    reply = intake.send(
        {
            "request_id": tag,
            "source": "bytes",
            "encode_handshake": loopback_handshake(room, worker.bootstrap_port),
        },
        image,
    )
    assert reply.ok, reply


@pytest.mark.parametrize("receiver_first", [True, False])
def test_multi_item_request_is_byte_exact_in_either_order(stack, tower, receiver_first):
    worker, receiver, intake, _ = stack
    images = [png(64, 64, 1), png(300, 200, 2), png(128, 96, 3)]
    inputs, rooms = make_request(worker, tower, images)
    skipped_text = MultimodalDataItem(Modality.IMAGE, offsets=[[0, 3]])  # no handshake: left alone
    already = MultimodalDataItem(
        Modality.IMAGE,
        offsets=[[0, 3]],
        encoded=torch.ones(4, 2),
        encode_handshake=loopback_handshake(1, worker.bootstrap_port),
    )
    inputs.mm_items += [skipped_text, already]
    if receiver_first:
        job = receiver.start("req", inputs)
        eventually(
            lambda: all(worker.table.view(r).state.value == "REGISTERED" for r in rooms),
            "rooms registered",
        )
    for index, (room, image) in enumerate(zip(rooms, images)):
        send(intake, worker, room, image, f"r{index}")
    if not receiver_first:  # the rows of all three wait in the send ring
        eventually(
            lambda: worker.ring.stats()["leases"] == len(images), "rows staged in the send ring"
        )
        job = receiver.start("req", inputs)
    assert job.wait(20) is JobState.DONE, job.reasons
    for item, image in zip(inputs.mm_items, images):
        assert torch.equal(item.encoded, expected_rows(tower, image))
        grid = tower.processor(images=[image_from_bytes(image)], return_tensors="pt")[
            "image_grid_thw"
        ]
        assert torch.equal(item.image_grid_thw, grid)  # the commit carries the encoder's patch grid
    assert [o.state for o in job.outcomes] == ["DONE"] * 3 + ["SKIPPED"] * 2
    assert all(o.transport == "loopback" for o in job.outcomes[:3])
    assert torch.equal(already.encoded, torch.ones(4, 2)) and skipped_text.encoded is None
    assert receiver.pool.stats()["leased_slots"] == 0  # encoded is a copy: slots are free again


def test_a_video_without_a_grid_in_the_request_gets_the_encoders_video_grid(stack, tower):
    """The commit's grid is stored under the item's own modality's key."""
    from epdserve.vision.sizing import grid_rows, sample_and_size
    from epdserve.vision.video import read_header

    worker, receiver, intake, _ = stack
    video = mp4(30, 64, 64, seed=3)
    _, grid = sample_and_size(tower.video_processor, read_header(video), tower.sizing)
    rows = grid_rows(grid, tower.video_processor)
    (room,) = worker.table.mint(1, 60)
    handshake = loopback_handshake(room, worker.bootstrap_port)
    item = MultimodalDataItem(Modality.VIDEO, offsets=[[0, rows - 1]], encode_handshake=handshake)
    job = receiver.start("video", MultimodalInputs([item]))
    request = {"request_id": "v", "modality": "VIDEO", "source": "bytes"}
    assert intake.send({**request, "encode_handshake": handshake}, video).ok
    assert job.wait(20) is JobState.DONE, job.reasons
    assert item.video_grid_thw.tolist() == [list(grid)] and item.encoded.shape[0] == rows
    assert "image_grid_thw" not in item.model_specific_data


def test_zero_copy_encoded_is_the_slot_until_release(stack, tower):
    worker, _, intake, loopback = stack
    receiver = small_receiver(tower, loopback, item_timeout_s=10, zero_copy=True)
    try:
        images = [png(64, 64, 5), png(128, 96, 6)]
        inputs, rooms = make_request(worker, tower, images)
        job = receiver.start("zc", inputs)
        for index, (room, image) in enumerate(zip(rooms, images)):
            send(intake, worker, room, image, f"zc{index}")
        assert job.wait(20) is JobState.DONE, job.reasons
        pool_start = receiver.pool.region.tensor.data_ptr()
        pool_end = pool_start + receiver.pool.region.tensor.numel()
        for item, image in zip(inputs.mm_items, images):
            assert torch.equal(item.encoded, expected_rows(tower, image))
            assert (
                pool_start <= item.encoded.data_ptr() < pool_end
            )  # a view of the slot, not a copy
        leased = receiver.pool.stats()["leased_slots"]
        assert leased > 0  # held for the engine
        job.release()
        job.release()  # idempotent
        assert receiver.pool.stats()["leased_slots"] == 0
        assert all(item.encoded is None for item in inputs.mm_items)
    finally:
        receiver.close()


def test_an_item_whose_writer_never_comes_fails_at_its_deadline_beside_a_delivered_one(
    stack, tower
):
    """The receiver's long-poll answers with the rooms that ended only, so the deadline of a room
    that never moves is checked on every answer: the item nobody writes fails at its deadline (its
    room ended, its slot held back), while the other item of the request is delivered."""
    worker, _, intake, loopback = stack
    receiver = small_receiver(tower, loopback, item_timeout_s=1.5, poll_s=0.1, quarantine_s=60)
    try:
        images = [png(64, 64, 7), png(96, 64, 8)]
        inputs, rooms = make_request(worker, tower, images)
        job = receiver.start("late", inputs)
        send(intake, worker, rooms[0], images[0], "late0")
        assert job.wait(10) is JobState.FAILED
        assert torch.equal(inputs.mm_items[0].encoded, expected_rows(tower, images[0]))
        reason = job.reasons[1]
        assert 0 not in job.reasons
        assert "timed out waiting for the encode worker" in reason or "EXPIRED" in reason, reason
        assert worker.table.view(rooms[1]).state.value in ("CANCELLED", "EXPIRED")
        assert receiver.pool.stats()["leased_slots"] == 0, reason  # none held for a late item
    finally:
        receiver.close()


def test_poll_never_blocks_and_cancel_fails_fast(stack, tower):
    worker, receiver, intake, _ = stack
    images = [png(64, 64, 4)]
    inputs, rooms = make_request(worker, tower, images)
    job = receiver.start("req", inputs)
    assert job.poll() is JobState.PENDING  # (poll reads the job's future: it cannot block)
    time.sleep(0.2)
    job.cancel("user went away")
    assert job.wait(3) is JobState.FAILED  # its item's timeout is far longer
    assert "CANCELLED" in job.reasons[0]
    assert worker.table.view(rooms[0]).state.value == "CANCELLED"


def test_request_larger_than_the_pool_is_refused_at_once(stack, tower):
    worker, receiver, _, _ = stack
    (room,) = worker.table.mint(1, 60)
    huge = MultimodalDataItem(
        Modality.IMAGE,
        offsets=[[0, 100_000]],
        encode_handshake=loopback_handshake(room, worker.bootstrap_port),
    )
    job = receiver.start("big", MultimodalInputs([huge]))
    assert job.wait(2) is JobState.FAILED and "cannot reserve" in job.reasons[0]
    assert receiver.pool.stats()["leased_slots"] == 0


def test_failed_write_that_lands_late_is_quarantined_and_falls_back(stack, tower):
    worker, receiver, intake, loopback = stack
    image = png(96, 96, 5)
    inputs, rooms = make_request(worker, tower, [image], keep_pixels=True)
    loopback.inject(LoopbackFault("late", 0.4))  # the write "fails" now, its bytes land in 0.4 s
    job = receiver.start("late", inputs)
    send(intake, worker, rooms[0], image, "late")
    assert job.wait(10) is JobState.DONE
    outcome = job.outcomes[0]
    assert (
        outcome.fallback and outcome.transport == "local_tower" and "write failed" in outcome.reason
    )
    assert torch.equal(inputs.mm_items[0].encoded, expected_rows(tower, image))
    assert receiver.pool.stats()["quarantined_slots"] > 0  # the slot waits out the late write
    # the next tenant gets other slots, and its bytes are intact after the late write lands
    image2 = png(96, 96, 6)
    inputs2, rooms2 = make_request(worker, tower, [image2])
    job2 = receiver.start("next", inputs2)
    send(intake, worker, rooms2[0], image2, "next")
    assert job2.wait(10) is JobState.DONE, job2.reasons
    time.sleep(0.5)
    assert torch.equal(inputs2.mm_items[0].encoded, expected_rows(tower, image2))


def test_unreachable_endpoint_fails_within_a_second(tower):
    receiver = PrefillReceiver(
        ReceiverConfig(
            width=tower.info.wire_width,
            dtype="float32",
            pool_bytes=4 << 20,
            slot_bytes=1 << 16,
            transports=("loopback",),
        )
    )
    try:
        item = MultimodalDataItem(
            Modality.IMAGE,
            offsets=[[0, 15]],
            encode_handshake=loopback_handshake(5, 1),
        )
        started = time.monotonic()
        job = receiver.start("dead", MultimodalInputs([item]))
        assert job.wait(5) is JobState.FAILED
        assert time.monotonic() - started < 1.5 and "unreachable" in job.reasons[0]
        # the room stream never opened, so nothing was registered: the slot is free at once
        stats = receiver.pool.stats()
        assert stats["quarantined_slots"] == 0 and stats["leases"] == 0, stats
    finally:
        receiver.close()


def test_cancel_during_a_write_waits_for_the_writer_then_frees_the_slot(stack, tower):
    worker, receiver, intake, loopback = stack
    image = png(64, 64, 7)
    inputs, rooms = make_request(worker, tower, [image])
    loopback.inject(LoopbackFault("delay", 0.6))  # the write is in flight for 0.6 s
    job = receiver.start("req", inputs)
    send(intake, worker, rooms[0], image, "cw")
    eventually(lambda: worker.table.view(rooms[0]).state.value == "WRITING", "the write began")
    job.cancel("user went away")
    time.sleep(0.2)
    view = worker.table.view(rooms[0])
    assert (
        view.state.value == "WRITING" and view.cancel_requested
    )  # the cancel waits for the writer
    assert job.wait(10) is JobState.FAILED and "CANCELLED" in job.reasons[0]
    view = worker.table.view(rooms[0])
    assert view.state.value == "CANCELLED" and view.writer_settled
    assert (
        receiver.pool.stats()["leased_slots"] == 0
        and receiver.pool.stats()["quarantined_slots"] == 0
    )


def test_a_patch_grid_that_disagrees_with_the_request_fails_the_item(stack, tower):
    worker, receiver, intake, _ = stack
    image = png(64, 64, 8)
    inputs, rooms = make_request(worker, tower, [image])
    inputs.mm_items[0].model_specific_data["image_grid_thw"] = torch.tensor(
        [[1, 2, 8]]
    )  # same rows (4), other grid
    job = receiver.start("grid", inputs)
    send(intake, worker, rooms[0], image, "grid")
    assert job.wait(10) is JobState.FAILED and "image_grid_thw" in job.reasons[0]
    assert inputs.mm_items[0].encoded is None and receiver.pool.stats()["leased_slots"] == 0


@pytest.mark.parametrize("require_checksum", [True, False])
def test_a_commit_without_a_checksum_is_published_only_when_the_receiver_allows_it(
    tower, require_checksum
):
    with loopback_stack(
        tower,
        worker=dict(cache_bytes=0, checksum=False),
        receiver=dict(require_checksum=require_checksum),
    ) as (worker, receiver, _):
        intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
        try:
            image = png(64, 64, 41)
            inputs, (room,) = make_request(worker, tower, [image])
            job = receiver.start("no-checksum", inputs)
            send(intake, worker, room, image, "no-checksum")
            if require_checksum:
                assert job.wait(20) is JobState.FAILED
                assert (
                    "carries no checksum" in job.reasons[0] and inputs.mm_items[0].encoded is None
                )
            else:
                assert job.wait(20) is JobState.DONE, job.reasons
                assert torch.equal(inputs.mm_items[0].encoded, expected_rows(tower, image))
            assert receiver.pool.stats()["leased_slots"] == 0
        finally:
            intake.close()


def test_the_worker_reports_the_wait_for_the_receiver_apart_from_the_write(stack, tower):
    """``epd_encoder_transfer_seconds`` is the write alone; the wait for a late receiver has its
    own family. Both observe exactly the split the commit carries to the receiver."""
    worker, receiver, intake, _ = stack
    image = png(64, 64, 42)
    inputs, (room,) = make_request(worker, tower, [image])
    send(intake, worker, room, image, "late-receiver")
    time.sleep(0.3)  # the receiver comes late: the item waits in the send ring
    job = receiver.start("late-receiver", inputs)
    assert job.wait(20) is JobState.DONE, job.reasons
    timings = job.outcomes[0].encoder
    registry = worker.metrics.registry
    assert registry.get_sample_value("epd_encoder_receiver_wait_seconds_count") == 1
    assert registry.get_sample_value("epd_encoder_receiver_wait_seconds_sum") == timings.wait_s
    assert (
        registry.get_sample_value("epd_encoder_transfer_seconds_sum", {"transport": "loopback"})
        == timings.transfer_s
    )


@pytest.mark.parametrize(
    "address, why",
    [
        ({"bootstrap_room": 0}, "bootstrap_room"),
        ({"bootstrap_host": "["}, "Host '[' cannot contain '['"),
        ({"bootstrap_host": "a]b"}, "cannot contain ']'"),
        ({"bootstrap_port": 0}, "bootstrap_port"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_an_item_whose_room_address_cannot_exist_fails_alone_and_reserves_nothing(
    stack, tower, address, why
):
    """Room 0 passed the wire schema and failed the registration's, and a host that makes no URL
    failed the client: either crashed the job (a 500 in epd-prefill) with its slots leased for
    good, so a dozen such requests exhausted the pool. Now the item fails at once with why, nothing
    is reserved, and its siblings arrive."""
    worker, receiver, intake, _ = stack
    image = png(64, 64, 50)
    for attempt in range(12):
        inputs, (room,) = make_request(worker, tower, [image])
        bad = MultimodalDataItem(
            Modality.IMAGE,
            offsets=[[0, 3]],
            encode_handshake={
                **inputs.mm_items[0].encode_handshake,
                "bootstrap_room": room + 1,
                **address,
            },
        )
        inputs.mm_items.insert(0, bad)
        job = receiver.start(f"bad-{attempt}", inputs)
        send(intake, worker, room, image, f"bad-{attempt}")
        assert job.wait(20) is JobState.FAILED, job.outcomes
        assert (
            list(job.reasons) == [0]
            and "invalid encode_handshake" in job.reasons[0]
            and why in job.reasons[0]
        )
        assert job.outcomes[1].state == "DONE" and torch.equal(
            inputs.mm_items[1].encoded, expected_rows(tower, image)
        )
        assert (
            receiver.pool.stats()["leased_slots"] == 0
            and receiver.pool.stats()["quarantined_slots"] == 0
        )


def test_a_fallback_whose_rows_do_not_match_the_placeholders_is_refused(stack, tower):
    """The local tower's rows were published whatever the placeholders said (256 rows for a
    4-row span): the fallback keeps the row contract, and the grid the item carries."""
    worker, receiver, _, _ = stack
    image = png(448, 448, 51)
    assert expected_rows(tower, image).shape[0] == 256
    rooms = worker.table.mint(3, 60)
    for room in rooms:
        worker.table.cancel(room, "dropped by the gateway")  # every item falls back
    short = MultimodalDataItem(
        Modality.IMAGE,
        offsets=[[10, 13]],
        feature=image,
        encode_handshake=loopback_handshake(rooms[0], worker.bootstrap_port),
    )
    other_grid = MultimodalDataItem(
        Modality.IMAGE,
        offsets=[[0, 255]],
        feature=image,
        model_specific_data={"image_grid_thw": torch.tensor([[1, 16, 64]])},
        encode_handshake=loopback_handshake(rooms[1], worker.bootstrap_port),
    )
    right = MultimodalDataItem(
        Modality.IMAGE,
        offsets=[[0, 99], [200, 355]],
        feature=image,
        encode_handshake=loopback_handshake(rooms[2], worker.bootstrap_port),
    )
    job = receiver.start("fallback-rows", MultimodalInputs([short, other_grid, right]))
    assert job.wait(20) is JobState.FAILED
    assert (
        "the image makes 256 rows (grid [1, 32, 32]) but the item's placeholders hold 4"
        in job.reasons[0]
    )
    assert "local tower also failed" in job.reasons[0] and "CANCELLED" in job.reasons[0]
    assert "differs from the item's image_grid_thw [1, 16, 64]" in job.reasons[1]
    assert short.encoded is None and other_grid.encoded is None
    assert job.outcomes[2].state == "DONE" and job.outcomes[2].fallback
    assert torch.equal(right.encoded, expected_rows(tower, image))


def test_abort_settles_every_item_now_and_the_slots_still_come_back(stack, tower):
    """A caller that stops waiting (epd-prefill's timeout) gets every unsettled item FAILED at
    once, even while its write is in flight; the slot is released when the writer settles, and
    the late commit publishes nothing."""
    worker, receiver, intake, loopback = stack
    image = png(64, 64, 52)
    inputs, (room,) = make_request(worker, tower, [image])
    loopback.inject(LoopbackFault("delay", 1.0))
    job = receiver.start("abort", inputs)
    send(intake, worker, room, image, "abort")
    eventually(lambda: worker.table.view(room).state.value == "WRITING", "the write began")
    job.abort("timed out: caller gave up")
    assert job.wait(2) is JobState.FAILED and job.reasons == {0: "timed out: caller gave up"}
    assert (
        worker.table.view(room).state.value == "WRITING"
    )  # the answer did not wait for the writer
    eventually(lambda: worker.table.view(room).state.value == "CANCELLED", "the writer reported")
    eventually(lambda: receiver.pool.stats()["leased_slots"] == 0, "slot released")
    assert receiver.pool.stats()["quarantined_slots"] == 0  # the writer settled: freed, not held
    assert inputs.mm_items[0].encoded is None and job.outcomes[0].state == "FAILED"


def test_a_receive_pool_whose_segment_is_unlinked_stops_offering_shm_and_says_so(
    tower, caplog, no_segments_of_ours
):
    """Someone unlinked /dev/shm/epd-pool-...: SHM delivery to this receiver then failed for good
    ("segment ... is gone"), with no fallback and a healthy look. Now the receiver notices, logs it
    once, reports it in health(), and receives over its other transport."""
    import os

    from encode_worker.config import WorkerConfig
    from encode_worker.worker import EncodeWorker
    from epdserve.data_plane.loopback import LoopbackTransport
    from epdserve.data_plane.shm_transport import ShmTransport

    loopback = LoopbackTransport()
    worker = EncodeWorker(
        WorkerConfig(
            model=tower.model_id,
            transports=("shm", "loopback"),
            bootstrap_port=0,
            intake_port=0,
            bind="127.0.0.1",
            ring_bytes=8 << 20,
            ring_slot_bytes=1 << 16,
            receiver_wait_s=10,
            cache_bytes=0,
        ),
        tower=tower,
        transports={"shm": ShmTransport(), "loopback": loopback},
    ).start()
    receiver = PrefillReceiver(
        ReceiverConfig(
            width=tower.info.wire_width,
            dtype="float32",
            pool_bytes=4 << 20,
            slot_bytes=1 << 16,
            item_timeout_s=10,
            transports=("shm", "loopback"),
        ),
        transports={"shm": ShmTransport(), "loopback": loopback},
    )
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:

        def receive(tag, seed):
            image = png(64, 64, seed)
            inputs, (room,) = make_request(worker, tower, [image])
            job = receiver.start(tag, inputs)
            send(intake, worker, room, image, tag)
            assert job.wait(20) is JobState.DONE, job.reasons
            assert torch.equal(inputs.mm_items[0].encoded, expected_rows(tower, image))
            return job.outcomes[0].transport

        assert receive("before", 53) == "shm"
        assert (
            receiver.health()["transports"] == ["shm", "loopback"]
            and receiver.health()["lost"] == {}
        )
        os.unlink(f"/dev/shm/{receiver.pool.region.shm.name}")
        with caplog.at_level("WARNING", logger="prefill_side.receive_pool"):
            assert receive("after", 54) == "loopback"
            assert receive("again", 55) == "loopback"
            health = receiver.health()
        assert health["transports"] == ["loopback"] and health["cannot_receive"] is None
        assert "is gone from /dev/shm" in health["lost"]["shm"]
        warnings = [
            r.getMessage() for r in caplog.records if "is gone from /dev/shm" in r.getMessage()
        ]
        assert len(warnings) == 1 and "receiving over loopback" in warnings[0]
        assert (
            receiver.registry.get_sample_value(
                "epd_prefill_transport_offered", {"transport": "shm"}
            )
            == 0
        )
    finally:
        intake.close()
        receiver.close()
        worker.stop()


def test_an_shm_only_receiver_whose_segment_is_unlinked_says_it_cannot_receive(
    tower, no_segments_of_ours
):
    import os

    from epdserve.data_plane.shm_transport import ShmTransport

    receiver = PrefillReceiver(
        ReceiverConfig(
            width=tower.info.wire_width,
            dtype="float32",
            pool_bytes=1 << 20,
            slot_bytes=1 << 16,
            transports=("shm",),
        ),
        transports={"shm": ShmTransport()},
    )
    try:
        assert receiver.health()["cannot_receive"] is None
        os.unlink(f"/dev/shm/{receiver.pool.region.shm.name}")
        health = receiver.health()
        assert (
            health["transports"] == [] and "no transport left to offer" in health["cannot_receive"]
        )
        assert health["not_ready"] == health["cannot_receive"]
        item = MultimodalDataItem(
            Modality.IMAGE,
            offsets=[[0, 3]],
            encode_handshake=loopback_handshake(7, 1),
        )
        job = receiver.start("shm-gone", MultimodalInputs([item]))
        assert (
            job.wait(5) is JobState.FAILED and "cannot reserve: no transport left" in job.reasons[0]
        )
        assert receiver.pool.stats()["leased_slots"] == 0
    finally:
        receiver.close()


def test_offsets_that_are_not_numbers_fail_their_item_and_reserve_nothing(stack, tower):
    """``[[0, None]]`` raised a TypeError while the job reserved its items: the job crashed with
    the earlier items' slots leased for good."""
    worker, receiver, intake, _ = stack
    image = png(64, 64, 56)
    inputs, (room,) = make_request(worker, tower, [image])
    inputs.mm_items.append(
        MultimodalDataItem(
            Modality.IMAGE,
            offsets=[[0, None]],
            encode_handshake={**inputs.mm_items[0].encode_handshake, "bootstrap_room": room + 1},
        )
    )
    job = receiver.start("none-offsets", inputs)
    send(intake, worker, room, image, "none-offsets")
    assert job.wait(20) is JobState.FAILED
    assert list(job.reasons) == [1] and "cannot reserve" in job.reasons[1]
    assert torch.equal(inputs.mm_items[0].encoded, expected_rows(tower, image))
    assert receiver.pool.stats()["leased_slots"] == 0


@pytest.mark.parametrize("reservable", [True, False])
def test_a_request_of_more_rooms_than_one_call_holds_is_split_not_crashed(tower, reservable):
    """300 items at one endpoint made one register (or cancel) call of 300, over the API's 256 per
    call: the call's own validation crashed the job, leaving every slot leased (or, for items it
    could not reserve, their rooms never cancelled, so their workers waited for nobody)."""
    with loopback_stack(tower, receiver=dict(pool_bytes=2 << 20, slot_bytes=4096)) as (
        worker,
        receiver,
        _,
    ):
        rooms = worker.table.mint(300, 60)
        if reservable:
            for room in rooms:
                worker.table.cancel(room, "dropped by the gateway")
        rows = 4 if reservable else 10_000  # 10,000 rows are more than the whole pool
        job = receiver.start("many", loopback_job_inputs(rooms, rows, worker.bootstrap_port))
        assert job.wait(20) is JobState.FAILED
        expected = (
            "ended CANCELLED before this receiver registered" if reservable else "cannot reserve"
        )
        assert len(job.reasons) == 300 and all(
            expected in reason for reason in job.reasons.values()
        )
        assert (
            receiver.pool.stats()["leased_slots"] == 0
            and receiver.pool.stats()["quarantined_slots"] == 0
        )
        eventually(
            lambda: all(worker.table.view(room).state.value == "CANCELLED" for room in rooms),
            "every room cancelled",
        )


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("item_timeout_s", 7200, "item_timeout_s 7200 is not in (0, 3600.0]"),
        ("poll_s", 60, "poll_s 60 is not in (0, 30.0]"),
        ("width", 0, "width 0 is not in"),
        ("dtype", "float64", "dtype 'float64' is not one of"),
        ("deepstack_width", 96, "deepstack_width 96 is not in"),
        ("fallback", "local", "fallback 'local' is not"),
        ("transports", (), "no transport given"),
    ],
)
def test_a_receiver_config_that_would_fail_every_item_is_refused_at_once(field, value, why):
    """An item_timeout_s over a registration's deadline bound (3600 s) or a poll_s over a
    long-poll's (30 s) was accepted, and every item then failed at its first registration or
    watch."""
    with pytest.raises(
        ValueError, match=why.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        ReceiverConfig(**{"width": 96, field: value})
    ReceiverConfig(width=96)


def test_a_slow_fallback_holds_up_no_other_item_on_the_same_stream(stack, tower, monkeypatch):
    """A commit the receiver refuses (its grid differs from the request's) falls back to the
    local tower, which here takes 2.5 s, longer than the stream's ping timeout: meanwhile the
    stream's reader goes on reading, so another request's item on the same endpoint is delivered,
    and nobody takes the endpoint for a stalled one."""
    worker, receiver, intake, _ = stack
    slow_encode = receiver.local.encode

    def encode_slowly(item):
        time.sleep(2.5)
        return slow_encode(item)

    monkeypatch.setattr(receiver.local, "encode", encode_slowly)
    refused, other = png(64, 64, 21), png(96, 96, 22)
    inputs, rooms = make_request(worker, tower, [refused], keep_pixels=True)
    inputs.mm_items[0].model_specific_data["image_grid_thw"] = torch.tensor([[1, 2, 8]])
    job = receiver.start("refused", inputs)
    send(intake, worker, rooms[0], refused, "refused")
    eventually(lambda: worker.table.view(rooms[0]).state.value == "SUCCESS", "the refused commit")
    other_inputs, other_rooms = make_request(worker, tower, [other])
    other_job = receiver.start("other", other_inputs)
    send(intake, worker, other_rooms[0], other, "other")
    assert other_job.wait(10) is JobState.DONE, other_job.reasons
    assert torch.equal(other_inputs.mm_items[0].encoded, expected_rows(tower, other))
    assert job.wait(10) is JobState.FAILED and "image_grid_thw" in job.reasons[0]
    assert "unreachable" not in job.reasons[0]


def test_delivered_items_are_counted_by_offered_transport_and_any_other_name_as_other():
    from epdserve.data_plane.loopback import LoopbackTransport

    receiver = PrefillReceiver(
        ReceiverConfig(width=8, dtype="float32", pool_bytes=1 << 16, slot_bytes=1 << 12),
        transports={"loopback": LoopbackTransport()},
    )
    try:
        receiver.metrics.delivered("loopback", 100, 0.01)
        for name in ("made-up-1", "made-up-2", None):  # a writer's names, not this receiver's
            receiver.metrics.delivered(name, 10, 0.01)

        def sample(family, transport, **labels):
            return receiver.registry.get_sample_value(family, {"transport": transport, **labels})

        assert sample("epd_prefill_items_total", "loopback", outcome="done") == 1
        assert sample("epd_prefill_bytes_total", "loopback") == 100
        assert sample("epd_prefill_items_total", "other", outcome="done") == 3
        assert sample("epd_prefill_bytes_total", "other") == 30
        assert sample("epd_prefill_items_total", "made-up-1", outcome="done") is None
        assert receiver.registry.get_sample_value("epd_prefill_receive_seconds_count") == 4
    finally:
        receiver.close()
