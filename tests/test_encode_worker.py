"""The encode worker with real (small) Qwen-VL towers, a real ZMQ intake and real byte moves."""

import asyncio
import json
import os
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from encode_worker.config import WorkerConfig
from encode_worker.worker import EncodeWorker
from epdserve.data_plane.loopback import LoopbackFault, LoopbackTransport
from epdserve.data_plane.shm import ShmTensorHandle
from epdserve.multimodal.hashing import hash_feature
from epdserve.testing.receive_items import loopback_encode_handshake
from epdserve.vision.families import FAMILIES
from epdserve.vision.images import image_from_bytes
from epdserve.vision.small_checkpoints import build_vision_only
from epdserve.vision.tower import TowerLoadError, VisionTower
from epdserve.wire.intake import (
    BATCH_MARKER,
    AsyncIntakeClient,
    IntakeBatchReply,
    IntakeClient,
    IntakeReply,
    IntakeRequest,
    IntakeStatus,
)
from epdserve.wire.rooms import RoomState
from handshake.rooms import RoomNotFound
from tests.encode_helpers import Receiver, png
from tests.waiting import eventually

FULL_CLASSES = {name: entry.vlm for name, entry in FAMILIES.items()}
SIZES = [(64, 64), (300, 200), (128, 96)]


def reference_rows(full_model, tower, image_png: bytes) -> torch.Tensor:
    """transformers' own get_image_features for this image alone, in the wire layout (its grid
    from the processor where the model takes one: none for Gemma 3's fixed-size images and
    InternVL's tiles, whose rows are its tiles' in order)."""
    inputs = tower.processor(images=[image_from_bytes(image_png)], return_tensors="pt")
    grid = {"image_grid_thw": inputs["image_grid_thw"]} if "image_grid_thw" in inputs else {}
    with torch.inference_mode():
        out = full_model.get_image_features(inputs["pixel_values"], **grid)
    if not FAMILIES[tower.info.family].packed_patches:
        return out.pooler_output.flatten(0, 1)
    (main,) = out.pooler_output
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack:
        return torch.cat([main, *[level[0] for level in deepstack]], dim=1)
    return main


def make_worker(checkpoint, tower=None, **overrides):
    loopback = LoopbackTransport()
    settings = dict(
        transports=("loopback",),
        dtype="float32",
        bootstrap_port=0,
        intake_port=0,
        bind="127.0.0.1",
        ring_bytes=8 << 20,
        ring_slot_bytes=1 << 16,
        cache_bytes=32 << 20,
        receiver_wait_s=10,
    )
    config = WorkerConfig(model=checkpoint, **{**settings, **overrides})
    worker = EncodeWorker(config, tower=tower, transports={"loopback": loopback}).start()
    return worker, Receiver(worker.table, {"loopback": loopback})


def handshake(worker, room):
    return loopback_encode_handshake(room, worker.bootstrap_port)


def request(worker, room, request_id="r1", content_hash=None):
    body = {
        "request_id": request_id,
        "encode_handshake": handshake(worker, room).model_dump(),
        "source": "bytes",
    }
    if content_hash is not None:
        body["content_hash"] = content_hash
    return body


@pytest.mark.parametrize("family", list(FULL_CLASSES))
def test_mixed_batch_rows_are_bit_identical_to_transformers(checkpoints, family):
    directory = checkpoints[family]
    full = FULL_CLASSES[family].from_pretrained(directory).eval()
    worker, receiver = make_worker(directory)
    try:
        images = [png(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
        expected = [reference_rows(full, worker.tower, image) for image in images]
        rooms = worker.table.mint(len(images), 60)
        for room, rows in zip(rooms, expected):
            receiver.reserve(room, rows.shape[0], rows.shape[1], rows.dtype)
        jobs = [
            worker.intake.job(_parse(request(worker, room)), image)
            for room, image in zip(rooms, images)
        ]
        encode_in_this_thread(worker, jobs)  # one mixed batch of three sizes
        for room, rows in zip(rooms, expected):
            state, got, view = receiver.wait(room)
            assert state is RoomState.SUCCESS, view.reason
            assert torch.equal(got, rows)
            if family == "qwen3_vl":
                info = worker.tower.info
                assert (
                    info.deepstack_levels == 2
                    and got.shape[1] == info.out_width * 3 == info.wire_width
                )
        assert worker.metrics.batch_items._sum.get() >= 3
    finally:
        worker.stop()
        receiver.close()


def test_fixed_size_images_are_sized_by_their_token_count_whatever_their_size(checkpoints):
    """Gemma 3's sizing: every image is ``mm_tokens_per_image`` rows (the processor's
    ``image_seq_length``, 16 here) as a ``(1, 4, 4)`` grid, from its header as from its pixels;
    pan-and-scan (several crops) and a token count that is no square are refused."""
    import copy

    from epdserve.vision.sizing import FIXED_SIZE

    tower = VisionTower.load(checkpoints["gemma3"])
    for height, width in [(64, 64), (300, 200), (2000, 90)]:
        grid = FIXED_SIZE.image_grid(tower.processor, height, width)
        inputs = tower.image_inputs(png(height, width, 1))
        assert grid == (1, 4, 4) == tuple(inputs["image_grid_thw"][0].tolist())
        assert tower.rows_per_item(inputs["image_grid_thw"]) == [16]
        assert tower.encode(inputs["pixel_values"], inputs["image_grid_thw"]).shape == (16, 96)
    for setting, value in (("do_pan_and_scan", True), ("image_seq_length", 15)):
        processor = copy.deepcopy(tower.processor)
        setattr(processor, setting, value)
        with pytest.raises(ValueError, match="pan-and-scan|not a square"):
            FIXED_SIZE.image_grid(processor, 64, 64)


def encode_in_this_thread(worker, jobs) -> None:
    """The worker's three stages over one known batch, in the test's thread."""
    worker.stage_and_send.send(worker.tower_stage.run(worker.prepare.run(jobs)).ready)


def _parse(body):
    return IntakeRequest.model_validate(body)


@pytest.fixture(scope="module")
def qwen25(checkpoints):
    return checkpoints["qwen2_5_vl"], VisionTower.load(checkpoints["qwen2_5_vl"])


def test_an_item_whose_room_ended_while_queued_is_never_encoded(qwen25):
    """Rooms cancelled after intake took their items (the client left, vLLM refused the request):
    the items are dropped before decoding and the tower, counted by how their rooms ended; an item
    beside them is delivered."""
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower)
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    sample = worker.metrics.registry.get_sample_value
    try:
        rooms = worker.table.mint(4, 60)
        for room in rooms[:3]:
            worker.table.cancel(room, "the client left")
        images = [png(96, 96, 40 + i) for i in range(4)]
        receiver.reserve(rooms[3], rows_for(tower, images[3]), tower.info.wire_width, tower.dtype)
        for index, (room, image) in enumerate(zip(rooms, images)):
            assert intake.send(request(worker, room, f"gone{index}"), image).ok
        assert receiver.wait(rooms[3])[0] is RoomState.SUCCESS
        labels = {"modality": "IMAGE"}
        eventually(
            lambda: sample("epd_encoder_items_total", {**labels, "outcome": "cancelled"}) == 3,
            "the three dropped items counted as cancelled",
        )
        assert sample("epd_encoder_batch_items_sum") == 1  # only the fourth reached the tower
    finally:
        intake.close()
        worker.stop()
        receiver.close()


def test_intake_to_delivery_with_cache_hit(qwen25):
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower)
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        image = png(200, 160, 7)
        got = []
        for attempt in range(2):
            (room,) = worker.table.mint(1, 60)
            reply = intake.send(request(worker, room, f"req{attempt}"), image)
            assert reply == IntakeReply(status=IntakeStatus.ACCEPTED, room=room)
            # the receiver learns rows from the same processor config the worker uses
            inputs = tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
            (rows,) = tower.rows_per_item(inputs["image_grid_thw"])
            receiver.reserve(room, rows, tower.info.wire_width, tower.dtype)
            state, data, view = receiver.wait(room)
            assert state is RoomState.SUCCESS, view.reason
            got.append(data)
        assert worker.cache.hits == 1 and worker.cache.misses == 1
        assert view.commit.grid_thw == tuple(
            inputs["image_grid_thw"][0].tolist()
        )  # a hit carries it too
        assert torch.equal(got[0], got[1])  # a hit ships the same bytes as the miss
    finally:
        intake.close()
        worker.stop()
        receiver.close()


def test_a_batch_message_answers_each_item_alone(qwen25):
    """Items sent in one loop step travel as one batch message; a wrong hash fails its own room,
    a wrong model is refused with its room untouched, and the good item beside them is delivered."""
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower)
    images = [png(64, 64, 11), png(64, 96, 12), png(96, 64, 13)]
    rooms = worker.table.mint(3, 60)
    bodies = [request(worker, room, f"batch{i}") for i, room in enumerate(rooms)]
    bodies[1]["content_hash"] = hash_feature(images[0])  # the hash of another item's bytes
    bodies[2]["model"] = "another-model"

    async def send_together():
        intake = AsyncIntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
        try:
            return await asyncio.gather(
                *(intake.send(_parse(body), image) for body, image in zip(bodies, images))
            )
        finally:
            intake.close()

    try:
        receiver.reserve(rooms[0], rows_for(tower, images[0]), tower.info.wire_width, tower.dtype)
        replies = asyncio.run(send_together())
        sample = worker.metrics.registry.get_sample_value
        assert sample("epd_encoder_intake_message_items_count") == 1  # one message
        assert sample("epd_encoder_intake_message_items_sum") == 3  # of the three items
        assert [reply.status for reply in replies] == [
            IntakeStatus.ACCEPTED,
            IntakeStatus.FAILED,
            IntakeStatus.REFUSED,
        ]
        assert [reply.room for reply in replies] == rooms
        assert "not the hash" in replies[1].reason and "another-model" in replies[2].reason
        assert receiver.wait(rooms[0])[0] is RoomState.SUCCESS
        assert worker.table.view(rooms[1]).state is RoomState.FAILED
        assert worker.table.view(rooms[2]).state is RoomState.PENDING
    finally:
        worker.stop()
        receiver.close()


def test_a_batch_whose_frames_do_not_match_its_items_is_refused_whole(qwen25):
    """Every item refused, each reply naming its room (the sender matches replies by room);
    metadata that cannot be read is one refusal naming none."""
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower)
    rooms = worker.table.mint(2, 60)
    metadata = json.dumps({"items": [request(worker, room) for room in rooms]}).encode()
    try:  # two items with a payload, three payload frames
        reply = worker.intake.accept_batch([metadata, *(png(64, 64, i) for i in range(3))])
        assert reply[0] == BATCH_MARKER
        refusals = IntakeBatchReply.model_validate_json(reply[1]).replies
        assert [refusal.room for refusal in refusals] == rooms
        for refusal in refusals:
            assert refusal.status is IntakeStatus.REFUSED and "3 payload frames" in refusal.reason
        assert [worker.table.view(room).state for room in rooms] == [RoomState.PENDING] * 2
        (unreadable,) = worker.intake.accept_batch([b"{not json", png(64, 64, 1)])
        refusal = IntakeReply.model_validate_json(unreadable)
        assert refusal.status is IntakeStatus.REFUSED and refusal.room is None
    finally:
        worker.stop()
        receiver.close()


def rows_for(tower, image):
    (rows,) = tower.rows_per_item(
        tower.processor(images=[image_from_bytes(image)], return_tensors="pt")["image_grid_thw"]
    )
    return rows


def test_one_corrupt_image_fails_only_its_room(qwen25):
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower)
    try:
        good = [png(64, 64, 1), png(96, 64, 2)]
        corrupt = png(64, 64, 3)[:200]  # a PNG header, then nothing
        rooms = worker.table.mint(3, 60)
        for room, image in ((rooms[0], good[0]), (rooms[2], good[1])):
            receiver.reserve(room, rows_for(tower, image), tower.info.wire_width, tower.dtype)
        jobs = [
            worker.intake.job(_parse(request(worker, room)), image)
            for room, image in zip(rooms, [good[0], corrupt, good[1]])
        ]
        encode_in_this_thread(worker, jobs)
        assert receiver.wait(rooms[0])[0] is RoomState.SUCCESS
        assert receiver.wait(rooms[2])[0] is RoomState.SUCCESS
        view = worker.table.view(rooms[1])
        assert view.state is RoomState.FAILED and "cannot decode" in view.reason
    finally:
        worker.stop()
        receiver.close()


def test_full_send_ring_stops_intake_instead_of_growing(qwen25):
    directory, tower = qwen25
    image = png(448, 448, 4)  # 256 rows x 96 x fp32 = 96 KiB: two 64 KiB slots of a three-slot ring
    worker, receiver = make_worker(
        directory, tower=tower, ring_bytes=3 << 16, queue_items=2, batch_items=1
    )
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    rooms = iter(worker.table.mint(40, 60))

    def send():  # a different image each time: every item is a cache miss
        room = next(rooms)
        return room, intake.send(request(worker, room, f"r{room}"), png(448, 448, room % (1 << 31)))

    try:
        # no receiver yet: items pile up in the ring, the stages and the bounded queue, then stop
        replies = []
        while len(replies) < 40 and not (
            len(replies) >= 6 and not any(r.ok for _, r in replies[-6:])
        ):
            replies.append(send())
            time.sleep(0.1)
        accepted = [(room, reply) for room, reply in replies if reply.ok]
        refused = replies[-6:]  # six in a row over 0.6 s: nothing is being pulled any more
        assert all(
            reply
            == IntakeReply(
                status=IntakeStatus.REFUSED, room=room, reason="queue full", retry_after_s=0.1
            )
            for room, reply in refused
        )
        # bounded: ring (1 item) + one batch held by each of the three stage threads + the two
        # hand-off queues (1 batch each) + the intake queue (2) = 8 items at most
        assert len(accepted) <= 8
        assert worker.ring.capacity == 3 << 16 and worker.ring.stats()["leased_slots"] == 2
        for room, _ in accepted:  # receivers arrive: everything accepted drains
            receiver.reserve(room, rows_for(tower, image), tower.info.wire_width, tower.dtype)
        for room, _ in accepted:
            assert receiver.wait(room)[0] is RoomState.SUCCESS
        eventually(
            lambda: worker.ring.stats()["leased_slots"] == 0, "the send ring drained", seconds=20
        )
    finally:
        intake.close()
        worker.stop()
        receiver.close()


def test_intake_opens_the_room_the_sender_names_and_leaves_none_behind_when_it_refuses(qwen25):
    """``open_room_ttl_s``: intake opens the named room in the worker's table with the item (no
    mint call). A refusal leaves no room behind; a bad item's room is opened and failed, so the
    other side reads why."""
    directory, tower = qwen25
    image = png(448, 448, 4)
    worker, receiver = make_worker(
        directory, tower=tower, ring_bytes=3 << 16, queue_items=2, batch_items=1
    )
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    next_room = iter(range(1000, 2000))

    def send(room, data=None, ttl_s=30.0, port=None):
        body = request(worker, room, f"r{room}")
        body["open_room_ttl_s"] = ttl_s
        if port is not None:
            body["encode_handshake"]["bootstrap_port"] = port
        return intake.send(body, data or png(448, 448, room % (1 << 31)))

    try:
        room = next(next_room)
        assert send(room).status is IntakeStatus.ACCEPTED
        assert worker.table.view(room).state is RoomState.PENDING  # opened, waiting for a receiver
        again = send(room)
        assert again.status is IntakeStatus.REFUSED and "in flight" in again.reason
        (minted,) = worker.table.mint(1, 60)
        taken = send(minted)
        assert taken.status is IntakeStatus.REFUSED and "exists already" in taken.reason
        elsewhere = send(next(next_room), port=worker.bootstrap_port + 1)
        assert elsewhere.status is IntakeStatus.REFUSED and "bootstrap port" in elsewhere.reason
        too_long = send(next(next_room), ttl_s=3600)  # the wire allows it, the table does not
        assert too_long.status is IntakeStatus.REFUSED and "ttl_s" in too_long.reason
        for reply in (elsewhere, too_long):
            with pytest.raises(RoomNotFound):
                worker.table.view(reply.room)
        bad = next(next_room)
        failed = send(bad, data=b"\x89PNG\r\n\x1a\n not an image")
        assert failed.status is IntakeStatus.FAILED
        view = worker.table.view(bad)
        assert view.state is RoomState.FAILED and view.reason == failed.reason
        # counted as intake's answer, not as an accepted item's end
        assert worker.metrics.intake.labels("IMAGE", "failed")._value.get() == 1
        assert worker.metrics.outcomes.labels("IMAGE", "failed")._value.get() == 0
        # no receiver: the pipeline fills and intake refuses "queue full", leaving no room behind
        accepted, refusal = [room], None
        while refusal is None:
            candidate = next(next_room)
            reply = send(candidate)
            if reply.ok:
                accepted.append(candidate)
            else:
                refusal = reply
        assert refusal.reason == "queue full" and refusal.retry_after_s == 0.1
        with pytest.raises(RoomNotFound):
            worker.table.view(refusal.room)
        for room in accepted:  # receivers arrive: everything accepted is delivered
            receiver.reserve(room, rows_for(tower, image), tower.info.wire_width, tower.dtype)
        for room in accepted:
            assert receiver.wait(room)[0] is RoomState.SUCCESS
    finally:
        intake.close()
        worker.stop()
        receiver.close()


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([b"not json"], "bad metadata"),
        ([b"{}", b"x", b"y"], "expected"),
        (
            [
                json.dumps(
                    {
                        "request_id": "a",
                        "source": "bytes",
                        "encode_handshake": {
                            "bootstrap_room": 1,
                            "bootstrap_host": "h",
                            "bootstrap_port": 1,
                        },
                    }
                ).encode()
            ],
            "needs a payload",
        ),
        (
            [
                json.dumps(
                    {
                        "request_id": "a",
                        "source": "pixels",
                        "shape": [2, 2, 3],
                        "encode_handshake": {
                            "bootstrap_room": 1,
                            "bootstrap_host": "h",
                            "bootstrap_port": 1,
                        },
                    }
                ).encode(),
                b"12345",
            ],
            "does not match shape",
        ),
        (
            [
                json.dumps(
                    {
                        "request_id": "a",
                        "source": "bytes",
                        "model": "some-other-model",
                        "encode_handshake": {
                            "bootstrap_room": 1,
                            "bootstrap_host": "h",
                            "bootstrap_port": 1,
                        },
                    }
                ).encode(),
                b"x",
            ],
            "unknown model",
        ),
        (
            [
                json.dumps(
                    {
                        "request_id": "a",
                        "source": "shm",
                        "shm": {"shm_name": "../x", "shape": [1, 1, 3], "dtype": "uint8"},
                        "encode_handshake": {
                            "bootstrap_room": 1,
                            "bootstrap_host": "h",
                            "bootstrap_port": 1,
                        },
                    }
                ).encode()
            ],
            "bad metadata",
        ),
    ],
)
def test_malformed_intake_is_refused_with_a_reason_and_the_worker_keeps_serving(
    qwen25, frames, reason
):
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower)
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        reply = intake.send_raw(frames)
        assert reply.ok is False and reason in reply.reason
        (room,) = worker.table.mint(1, 60)
        image = png(64, 64, 9)
        assert intake.send(request(worker, room), image).ok
        receiver.reserve(room, rows_for(tower, image), tower.info.wire_width, tower.dtype)
        assert receiver.wait(room)[0] is RoomState.SUCCESS
    finally:
        intake.close()
        worker.stop()
        receiver.close()


def test_tower_refuses_missing_weights(tmp_path):
    directory = build_vision_only("qwen2_5_vl", str(tmp_path / "v"))
    assert VisionTower.load(directory).info.family == "qwen2_5_vl"  # a vision-only checkpoint loads
    weights = load_file(os.path.join(directory, "model.safetensors"))
    dropped = sorted(weights)[0]
    del weights[dropped]
    save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TowerLoadError, match="missing"):
        VisionTower.load(directory)


def test_raw_pixels_and_shm_handles_encode_like_the_png(qwen25, no_new_segments):
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower, cache_bytes=0)
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    image = png(120, 90, 21)
    pixels = torch.from_numpy(np.array(image_from_bytes(image)))
    handle = ShmTensorHandle.publish(pixels, purpose="intake")
    try:
        sends = [  # room 1 stands for each item's own room, minted below
            (request(worker, 1, "png"), image),
            (
                {**request(worker, 1, "raw"), "source": "pixels", "shape": list(pixels.shape)},
                pixels.numpy().tobytes(),
            ),
            (
                {
                    **request(
                        worker, 1, "shm", content_hash=hash_feature(pixels.numpy().tobytes())
                    ),
                    "source": "shm",
                    "shm": handle.to_wire(),
                },
                None,
            ),
        ]
        results = []
        for body, payload in sends:
            (room,) = worker.table.mint(1, 60)
            body["encode_handshake"]["bootstrap_room"] = room
            assert intake.send(body, payload).ok
            receiver.reserve(room, rows_for(tower, image), tower.info.wire_width, tower.dtype)
            state, rows, view = receiver.wait(room)
            assert state is RoomState.SUCCESS, view.reason
            results.append(rows)
        assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
        assert not os.path.exists(f"/dev/shm/{handle.shm_name}")  # the worker consumed the handle
    finally:
        # a test that failed before the worker read it leaves no segment (else a no-op)
        handle.release()
        intake.close()
        worker.stop()
        receiver.close()


def test_a_lying_content_hash_is_refused_and_cannot_poison_the_cache(qwen25, no_new_segments):
    """The cache key is the hash of the bytes the worker encodes: a client that claims another
    image's hash gets its item refused, and the honest image's cached rows stay its own."""
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower)
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    honest, liar = png(120, 90, 31), png(120, 90, 32)
    pixels = torch.from_numpy(np.array(image_from_bytes(liar)))
    handle = ShmTensorHandle.publish(pixels, purpose="intake")
    try:
        room, lie_room, shm_room, again = worker.table.mint(4, 60)
        assert intake.send(request(worker, room, "honest"), honest).ok
        receiver.reserve(room, rows_for(tower, honest), tower.info.wire_width, tower.dtype)
        state, expected, _ = receiver.wait(room)
        assert state is RoomState.SUCCESS
        claimed = hash_feature(honest)
        reply = intake.send(request(worker, lie_room, "liar", content_hash=claimed), liar)
        assert reply.ok is False and "is not the hash of the item's bytes" in reply.reason
        assert worker.table.view(lie_room).state is RoomState.FAILED
        # SHM pixels are hashed once read: the lie fails the room with the same reason
        body = {
            **request(worker, shm_room, "shm-liar", content_hash=claimed),
            "source": "shm",
            "shm": handle.to_wire(),
        }
        receiver.reserve(shm_room, rows_for(tower, liar), tower.info.wire_width, tower.dtype)
        assert intake.send(body, None).ok
        state, _, view = receiver.wait(shm_room)
        assert state is RoomState.FAILED and "is not the hash of the item's bytes" in view.reason
        # the honest image still meets its own rows in the cache
        hits = worker.cache.hits
        assert intake.send(request(worker, again, "honest-again", content_hash=claimed), honest).ok
        receiver.reserve(again, rows_for(tower, honest), tower.info.wire_width, tower.dtype)
        state, rows, _ = receiver.wait(again)
        assert (
            state is RoomState.SUCCESS
            and torch.equal(rows, expected)
            and worker.cache.hits == hits + 1
        )
    finally:
        # a test that failed before the worker read it leaves no segment (else a no-op)
        handle.release()
        intake.close()
        worker.stop()
        receiver.close()


def test_items_waiting_for_their_receivers_do_not_hold_up_an_item_whose_receiver_is_there(qwen25):
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower, send_workers=2, receiver_wait_s=20)
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        late = worker.table.mint(6, 60)  # three times as many as there are sender threads
        for index, room in enumerate(late):
            assert intake.send(request(worker, room, f"late{index}"), png(64, 64, 40 + index)).ok
        (room,) = worker.table.mint(1, 60)
        image = png(64, 64, 50)
        processed = tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
        rows = tower.encode_items(processed["pixel_values"], processed["image_grid_thw"])[0]
        receiver.reserve(room, rows.shape[0], rows.shape[1], rows.dtype)
        assert intake.send(request(worker, room, "ready"), image).ok
        state, got, view = receiver.wait(room, timeout=10)
        assert state is RoomState.SUCCESS, view.reason
        # delivered within the wait above, long before the late ones' 20 s
        assert torch.equal(got, rows)
        assert all(
            worker.table.view(r).state is RoomState.PENDING for r in late
        )  # still waiting, as they may
    finally:
        intake.close()
        worker.stop()
        receiver.close()


def test_a_room_sent_to_two_workers_is_written_by_one_and_the_other_leaves_it_alone(qwen25):
    """A gateway bug sends one room to two workers: the first to begin the write owns the room,
    the other's begin_write is refused and it drops its item without failing the room."""
    directory, tower = qwen25
    loopback = LoopbackTransport()
    settings = dict(
        transports=("loopback",),
        dtype="float32",
        bootstrap_port=0,
        intake_port=0,
        bind="127.0.0.1",
        ring_bytes=8 << 20,
        ring_slot_bytes=1 << 16,
        cache_bytes=0,
        receiver_wait_s=10,
    )
    outcomes = []
    workers = [
        EncodeWorker(
            WorkerConfig(model=directory, **settings),
            tower=tower,
            transports={"loopback": loopback},
        ).start()
        for _ in range(2)
    ]
    for worker in workers:
        worker.sender.on_outcome = outcomes.append
    receiver = Receiver(workers[0].table, {"loopback": loopback})
    try:
        image = png(96, 128, 60)
        processed = tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
        rows = tower.encode_items(processed["pixel_values"], processed["image_grid_thw"])[0]
        (room,) = workers[0].table.mint(
            1, 60
        )  # the room lives at worker 0; worker 1 reaches it over REST
        receiver.reserve(room, rows.shape[0], rows.shape[1], rows.dtype)
        loopback.inject(
            LoopbackFault("delay", 1.5)
        )  # the first write is still in flight when the second comes
        body = request(workers[0], room)
        for worker in workers:
            intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
            assert intake.send(body, image).ok
            intake.close()
        state, got, view = receiver.wait(room)
        assert state is RoomState.SUCCESS and torch.equal(got, rows), view.reason
        deadline = time.monotonic() + 10
        while len(outcomes) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(o.state for o in outcomes) == ["FAILED", "SUCCESS"], outcomes
        (loser,) = [o for o in outcomes if o.state == "FAILED"]
        assert "another writer" in loser.reason
        assert workers[0].table.view(room).state is RoomState.SUCCESS  # the loser did not fail it
    finally:
        for worker in workers:
            worker.stop()
        receiver.close()


def _counting_tower_calls(monkeypatch, tower, fail=False):
    """Images the tower encodes, per call; ``fail``: every call raises, as a tower that cannot."""
    calls = []
    encode = tower.encode

    def counted(pixel_values, grid_thw):
        calls.append(grid_thw.shape[0])
        if fail:
            raise RuntimeError("tower out of order")
        return encode(pixel_values, grid_thw)

    monkeypatch.setattr(tower, "encode", counted)
    return calls


def test_identical_items_in_flight_are_encoded_once_and_each_room_gets_the_rows(
    qwen25, monkeypatch
):
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower, cache_bytes=0)  # coalescing alone
    try:
        same, other = png(200, 160, 11), png(120, 96, 12)
        images = [same, same, other, same, same]
        rooms = worker.table.mint(len(images), 60)
        for room, image in zip(rooms, images):
            receiver.reserve(room, rows_for(tower, image), tower.info.wire_width, tower.dtype)
        jobs = [
            worker.intake.job(_parse(request(worker, room, f"r{room}")), image)
            for room, image in zip(rooms, images)
        ]
        calls = _counting_tower_calls(monkeypatch, tower)
        first = worker.prepare.run(jobs[:3])  # same, same (waits), other
        second = worker.prepare.run(jobs[3:])  # both wait for the first batch's encode
        assert len(first.misses) == 2 and not second.misses and not second.ready
        worker.stage_and_send.send(worker.tower_stage.run(first).ready)
        assert calls == [2] and worker.encodes.coalesced == 3
        got = {}
        for room, image in zip(rooms, images):
            state, rows, view = receiver.wait(room)
            assert state is RoomState.SUCCESS, view.reason
            got.setdefault(image, []).append(rows)
        for image, delivered in got.items():
            inputs = tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
            alone = tower.encode_items(inputs["pixel_values"], inputs["image_grid_thw"])[0]
            assert all(torch.equal(rows, alone) for rows in delivered)
        # settled: the next identical item is encoded again (the cache is off), not left waiting
        (room,) = worker.table.mint(1, 60)
        again = worker.prepare.run(
            [worker.intake.job(_parse(request(worker, room, "again")), same)]
        )
        assert len(again.misses) == 1
    finally:
        worker.stop()
        receiver.close()


def test_a_shared_encode_that_fails_fails_every_waiting_room_at_once(qwen25, monkeypatch):
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower)
    try:
        image = png(200, 160, 13)
        rooms = worker.table.mint(3, 60)
        for room in rooms:
            receiver.reserve(room, rows_for(tower, image), tower.info.wire_width, tower.dtype)
        jobs = [
            worker.intake.job(_parse(request(worker, room, f"r{room}")), image) for room in rooms
        ]
        calls = _counting_tower_calls(monkeypatch, tower, fail=True)
        prepared = worker.prepare.run(jobs)
        assert len(prepared.misses) == 1
        assert worker.tower_stage.run(prepared).ready == []
        assert calls == [1]
        reasons = []
        for room in rooms:
            state, _, view = receiver.wait(room)
            assert state is RoomState.FAILED
            reasons.append(view.reason)
        assert "vision tower failed on this item" in reasons[0]
        assert all("identical item" in reason for reason in reasons[1:]), reasons
        # the key is free again: a later identical item leads its own encode
        monkeypatch.undo()
        (room,) = worker.table.mint(1, 60)
        again = worker.prepare.run(
            [worker.intake.job(_parse(request(worker, room, "again")), image)]
        )
        assert len(again.misses) == 1
    finally:
        worker.stop()
        receiver.close()


def test_the_worker_threads_carry_their_names_where_the_os_shows_them(qwen25):
    """``top -H``, perf and ``epd-bench cost`` (CPU per thread) see each stage by its name."""
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower)
    try:
        names = set()
        for task in os.listdir(f"/proc/{os.getpid()}/task"):
            with open(f"/proc/{os.getpid()}/task/{task}/comm") as f:
                names.add(f.read().strip())
        assert {"intake", "prepare", "encode", "stage", "handshake"} <= names
    finally:
        worker.stop()
        receiver.close()


def test_media_threads_yield_the_cpu_to_the_control_plane(qwen25):
    """--media-niceness: decode + preprocessing and the tower run at a higher nice value than
    intake, the sends and the room API (Linux schedules each thread by its own)."""
    directory, tower = qwen25
    base = os.getpriority(os.PRIO_PROCESS, 0)
    worker, receiver = make_worker(directory, tower=tower, media_niceness=3)
    try:
        nice = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in worker._threads}
        assert nice["prepare"] == nice["encode"] == min(19, base + 3)
        assert nice["intake"] == nice["stage"] == base
        assert os.getpriority(os.PRIO_PROCESS, worker.server.loop.thread.native_id) == base
    finally:
        worker.stop()
        receiver.close()


def _burst(worker, receiver, tower, count: int, seed: int):
    """``count`` distinct 448x448 items sent back to back to ``worker``'s intake, their
    receivers registered first: (room, reply) each."""
    images = [png(448, 448, seed + index) for index in range(count)]
    rooms = worker.table.mint(count, 120)
    for room in rooms:
        receiver.reserve(room, rows_for(tower, images[0]), tower.info.wire_width, tower.dtype)
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        return [
            (room, intake.send(request(worker, room, f"r{room}"), image))
            for room, image in zip(rooms, images)
        ]
    finally:
        intake.close()


def test_a_burst_beyond_the_old_queue_waits_for_the_tower_and_is_delivered(qwen25):
    """150 items at once, one per batch: far more than the tower clears while they arrive. They
    wait in the queue (their files only) within their deadline; none is refused, all delivered."""
    directory, tower = qwen25
    worker, receiver = make_worker(directory, tower=tower, batch_items=1, ring_bytes=32 << 20)
    try:
        replies = _burst(worker, receiver, tower, 150, seed=5000)
        assert [reply.status for _, reply in replies] == [IntakeStatus.ACCEPTED] * 150
        for room, _ in replies:
            assert receiver.wait(room, timeout=120)[0] is RoomState.SUCCESS
        # every item is delivered: the backlog's drain once the burst had arrived was measured
        # (asked before that, the tower may not have finished a batch yet on a busy machine)
        assert worker.queue.seconds_per_patch is not None
    finally:
        worker.stop()
        receiver.close()


def test_an_item_that_would_wait_past_its_deadline_is_refused_at_intake_with_when_to_retry(
    qwen25,
):
    """--max-queue-wait-s: once the measured pace says the work queued ahead takes longer, intake
    refuses (busy, with a retry-after of the excess) and leaves the room untouched; everything it
    accepted is delivered. A first burst, taken while the pace is not known yet, measures it."""
    directory, tower = qwen25
    worker, receiver = make_worker(
        directory, tower=tower, batch_items=1, ring_bytes=32 << 20, max_queue_wait_s=1e-3
    )
    try:
        first = _burst(worker, receiver, tower, 40, seed=6000)
        for room, reply in first:
            if reply.ok:
                assert receiver.wait(room, timeout=120)[0] is RoomState.SUCCESS
        assert worker.queue.seconds_per_patch is not None, "no backlog formed to measure the pace"
        replies = _burst(worker, receiver, tower, 40, seed=7000)
        refused = [(room, reply) for room, reply in replies if not reply.ok]
        assert refused, "no backlog formed: the tower kept up with intake"
        for room, reply in refused:
            assert reply.status is IntakeStatus.REFUSED
            assert reply.reason.startswith("busy: about ")
            assert reply.reason.endswith(
                " s of work queued ahead, over the 0.001 s this item may wait"
            )
            assert reply.retry_after_s >= 0.1
            view = worker.table.view(room)
            assert view.state is RoomState.REGISTERED and view.version == 2  # minted, registered
        for room, reply in replies:
            if reply.ok:
                assert receiver.wait(room, timeout=120)[0] is RoomState.SUCCESS
    finally:
        worker.stop()
        receiver.close()
