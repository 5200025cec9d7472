"""The encode worker against hostile and careless input (issue 15): SHM names it must not touch,
receivers that never come, room endpoints that never answer, decompression bombs. Real worker,
real ZMQ intake, real HTTP rooms, real /dev/shm."""

import io
import os
import socket
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import torch

from encode_worker.config import WorkerConfig
from encode_worker.scheduler import BatchQueue, EncodeJob
from encode_worker.worker import EncodeWorker
from epdserve.data_plane.loopback import LoopbackTransport
from epdserve.data_plane.pool import MemoryRegion
from epdserve.data_plane.shm import ShmError, ShmSegment, ShmTensorHandle
from epdserve.multimodal.hashing import hash_feature
from epdserve.vision.images import image_from_bytes
from epdserve.vision.small_checkpoints import build_full
from epdserve.vision.tower import VisionTower
from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.intake import IntakeClient
from epdserve.wire.rooms import RoomState
from handshake.rooms import RoomConflict
from tests.encode_helpers import Receiver, png
from tests.waiting import eventually


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    return VisionTower.load(build_full("qwen2_5_vl", str(tmp_path_factory.mktemp("q25"))))


@pytest.fixture
def make(tower):
    """Start workers (config overrides); each is stopped, and its receiver closed, at the end."""
    started = []

    def make_worker(**overrides):
        loopback = LoopbackTransport()
        settings = dict(
            transports=("loopback",),
            bootstrap_port=0,
            intake_port=0,
            bind="127.0.0.1",
            ring_bytes=8 << 20,
            ring_slot_bytes=1 << 16,
            cache_bytes=0,
            receiver_wait_s=10,
        )
        worker = EncodeWorker(
            WorkerConfig(model=tower.model_id, **{**settings, **overrides}),
            tower=tower,
            transports={"loopback": loopback},
        ).start()
        receiver = Receiver(worker.table, {"loopback": loopback})
        intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
        started.append((worker, receiver, intake))
        return worker, receiver, intake

    yield make_worker
    for worker, receiver, intake in started:
        intake.close()
        worker.stop()
        receiver.close()


def request(worker, room, request_id="r1", host="127.0.0.1", port=None, **fields):
    handshake = EncodeHandshake(
        bootstrap_room=room, bootstrap_host=host, bootstrap_port=port or worker.bootstrap_port
    )
    return {
        "request_id": request_id,
        "encode_handshake": handshake.model_dump(),
        "source": "bytes",
        **fields,
    }


def rows_for(tower, image):
    (rows,) = tower.rows_per_item(
        tower.processor(images=[image_from_bytes(image)], return_tensors="pt")["image_grid_thw"]
    )
    return rows


def wait_terminal(table, room, seconds=30):
    """The room's view once it is terminal; ``TimeoutError`` if it is not within ``seconds``."""
    end = time.monotonic() + seconds
    while True:
        view = table.view(room)
        if view.state.terminal:
            return view
        if time.monotonic() >= end:
            raise TimeoutError(f"room {room} still {view.state.value} after {seconds} s")
        time.sleep(0.02)


def deliver(tower, worker, receiver, intake, image, request_id):
    """Send one image to a room of the worker's own table with its receiver there: the room's
    view."""
    (room,) = worker.table.mint(1, 60)
    receiver.reserve(room, rows_for(tower, image), tower.info.wire_width, tower.dtype)
    reply = intake.send(request(worker, room, request_id), image)
    assert reply.ok, reply
    state, _, view = receiver.wait(room)
    assert state is RoomState.SUCCESS, view.reason
    return view


# ---- 1. intake SHM handles -----------------------------------------------------------------------


def test_intake_never_opens_a_segment_that_is_not_an_intake_handle(no_new_segments, tower, make):
    """A client naming a prefill's receive pool (or the seed's handoff handle) used to make the
    worker map, copy and unlink it: now it is refused on the name alone, the room fails with the
    reason, and the segment is untouched."""
    worker, receiver, intake = make()
    pixels = torch.from_numpy(np.array(image_from_bytes(png(16, 16, 1))))
    pool = MemoryRegion.shared(1 << 16)  # what a prefill process receives into
    pool.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    handoff = ShmTensorHandle.publish(pixels)  # the seed's kind: between an engine's ranks
    try:
        for name in (pool.shm.name, handoff.shm_name):
            (room,) = worker.table.mint(1, 60)
            body = request(
                worker,
                room,
                source="shm",
                content_hash=hash_feature(pixels.numpy().tobytes()),
                shm={"shm_name": name, "shape": [16, 16, 3], "dtype": "uint8"},
            )
            reply = intake.send(body)
            assert reply.ok is False and "is not an intake handle" in reply.reason, reply
            view = worker.table.view(room)
            assert view.state is RoomState.FAILED and "is not an intake handle" in view.reason
            assert os.path.exists(f"/dev/shm/{name}")
        assert pool.tensor[:4].tolist() == [1, 2, 3, 4]
        # what a local producer publishes for intake is read, and consumed
        handle = ShmTensorHandle.publish(pixels, purpose="intake")
        assert handle.shm_name.startswith("epd-in-")
        (room,) = worker.table.mint(1, 60)
        receiver.reserve(room, rows_for(tower, png(16, 16, 1)), tower.info.wire_width, tower.dtype)
        body = request(
            worker,
            room,
            source="shm",
            content_hash=hash_feature(pixels.numpy().tobytes()),
            shm=handle.to_wire(),
        )
        assert intake.send(body).ok
        state, _, view = receiver.wait(room)
        assert state is RoomState.SUCCESS, view.reason
        assert not os.path.exists(f"/dev/shm/{handle.shm_name}")
    finally:
        handoff.release()
        pool.close()


def test_intake_handle_names_are_reserved_and_sizes_exact(no_new_segments):
    """Only publish(..., purpose="intake") makes epd-in-* names; a handle that claims fewer bytes
    than its segment holds (a name reused for another tensor) is refused."""
    with pytest.raises(ValueError, match="reserved"):
        ShmSegment.create(4096, kind="in")
    with pytest.raises(ValueError, match="reserved"):
        ShmSegment.create(4096, name="epd-in-1-abc")
    with pytest.raises(ValueError, match="purpose"):
        ShmTensorHandle.publish(torch.ones(3), purpose="anything")
    with pytest.raises(ValueError, match="not an intake handle"):
        ShmTensorHandle.for_intake("epd-pool-1-abc", (1, 1, 3), torch.uint8)
    published = ShmTensorHandle.publish(torch.zeros(8, 8, 3, dtype=torch.uint8), purpose="intake")
    smaller = ShmTensorHandle.for_intake(published.shm_name, (4, 4, 3), torch.uint8)
    with pytest.raises(ShmError, match="exactly"):
        smaller.attach()
    same = ShmTensorHandle.for_intake(published.shm_name, (8, 8, 3), torch.uint8)
    same.attach()
    assert same.consume().shape == (8, 8, 3)


# ---- 2. a receiver that never comes --------------------------------------------------------------


def test_a_receiver_that_never_comes_fails_the_room_when_the_worker_stops_waiting(tower, make):
    worker, receiver, intake = make(receiver_wait_s=0.5)
    image = png(64, 64, 2)
    (room,) = worker.table.mint(1, 60)
    assert intake.send(request(worker, room), image).ok
    view = wait_terminal(worker.table, room)
    assert view.state is RoomState.FAILED and "no receiver registered within 0.5 s" in view.reason
    eventually(
        lambda: worker.ring.stats()["leased_slots"] == 0, "the ring slot released", seconds=30
    )
    # the receiver that comes later is told at once, with the reason
    with pytest.raises(RoomConflict, match="no receiver registered within"):
        receiver.reserve(room, rows_for(tower, image), tower.info.wire_width, tower.dtype)


# ---- 3. a room endpoint that never answers -------------------------------------------------------


class SilentEndpoint:
    """A TCP listener that never accepts: connections complete in the kernel, no byte comes back."""

    def __init__(self):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(64)
        self.port = self.socket.getsockname()[1]

    def close(self):
        self.socket.close()


def test_a_silent_room_endpoint_does_not_hold_up_intake(tower, make):
    """A bad item whose room lives on an endpoint that never answers used to block the intake
    loop for the whole fail call (~24 s) and give each new endpoint a thread; now the room is
    failed by a bounded call off the intake path, and other items go through meanwhile."""
    worker, receiver, intake = make(room_timeout_s=120)
    silent = [SilentEndpoint() for _ in range(4)]
    try:
        threads = threading.active_count()
        for index, endpoint in enumerate(silent):
            reply = intake.send(
                request(worker, 7 + index, f"bad{index}", port=endpoint.port), b"not an image"
            )
            assert reply.ok is False and "cannot read image header" in reply.reason
        assert threading.active_count() == threads  # no thread per endpoint
        for index in range(3):  # items to a healthy room complete while those calls are pending
            deliver(tower, worker, receiver, intake, png(64, 64, 10 + index), f"good{index}")
        assert worker.pending_room_fails == len(silent)
    finally:
        for endpoint in silent:
            endpoint.close()
    eventually(
        lambda: worker.pending_room_fails == 0,
        "the fail calls ended once the endpoints closed",
        seconds=30,
    )


# ---- 4. decompression bombs ----------------------------------------------------------------------


def png_bomb(width: int, height: int) -> bytes:
    """A real, valid PNG of black pixels: small on the wire, ``width * height`` pixels decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    compressor = zlib.compressobj(9)
    row = b"\x00" * (1 + 3 * width)
    body = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")
    )


def test_a_decompression_bomb_is_refused_at_intake_from_its_header(tower, make):
    worker, receiver, intake = make()
    bomb = png_bomb(16384, 4096)
    assert len(bomb) < 300 << 10
    (room,) = worker.table.mint(1, 60)
    reply = intake.send(request(worker, room, "bomb"), bomb)
    assert (
        reply.ok is False and "16384x4096 pixels is larger than this worker decodes" in reply.reason
    )
    assert worker.table.view(room).state is RoomState.FAILED
    # raw pixels and SHM handles are held to the same bound, from their shape
    small, _, small_intake = make(max_image_pixels=32 * 32, batch_pixels=32 * 32)
    (room,) = small.table.mint(1, 60)
    reply = small_intake.send(
        request(small, room, "raw", source="pixels", shape=[64, 64, 3]), bytes(64 * 64 * 3)
    )
    assert reply.ok is False and "64x64 pixels is larger" in reply.reason
    (room,) = small.table.mint(1, 60)
    body = request(
        small,
        room,
        "shm",
        source="shm",
        content_hash=1,
        shm={"shm_name": "epd-in-1-0123456789abcdef", "shape": [64, 64, 3], "dtype": "uint8"},
    )
    assert "64x64 pixels is larger" in small_intake.send(body).reason
    deliver(tower, worker, receiver, intake, png(64, 64, 3), "after")  # and it keeps serving


def test_a_tiff_is_refused_at_intake_not_after_queueing(tower, make):
    from PIL import Image

    worker, _, intake = make()
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buffer, format="TIFF")
    (room,) = worker.table.mint(1, 60)
    reply = intake.send(request(worker, room, "tiff"), buffer.getvalue())
    assert reply.ok is False and "'TIFF' is not accepted" in reply.reason


def test_a_batch_decodes_at_most_its_pixel_budget():
    queue = BatchQueue(max_items=8, patch_budget=10**6, batch_items=8, pixel_budget=100)
    for index, pixels in enumerate((60, 30, 20, 150, 10)):
        handshake = EncodeHandshake(bootstrap_room=index + 1, bootstrap_host="h", bootstrap_port=1)
        assert queue.put(
            EncodeJob(f"r{index}", handshake, index, "bytes", b"", patches=4, pixels=pixels)
        )
    assert [[job.pixels for job in queue.take_batch(0)] for _ in range(3)] == [
        [60, 30],
        [20],
        [150],
    ]
    assert [job.pixels for job in queue.take_batch(0)] == [
        10
    ]  # one alone may exceed it: its own batch


def test_the_queue_holds_at_most_its_payload_bytes():
    """queue_items x max_payload_bytes was the only bound on payloads waiting for the tower (4 GiB
    by default); the queue now refuses ("queue full") past max_bytes of them."""
    queue = BatchQueue(max_items=8, patch_budget=10**6, batch_items=1, max_bytes=100)

    def job(index, nbytes):
        handshake = EncodeHandshake(bootstrap_room=index + 1, bootstrap_host="h", bootstrap_port=1)
        return EncodeJob(f"r{index}", handshake, index, "bytes", b"", patches=4, nbytes=nbytes)

    assert queue.put(job(1, 60)) and not queue.put(job(2, 50)) and queue.put(job(3, 40))
    assert [j.nbytes for j in queue.take_batch(0)] == [60]
    assert queue.put(job(4, 50)) and queue.nbytes == 90
    queue.take_batch(0), queue.take_batch(0)
    assert queue.nbytes == 0 and queue.put(
        job(5, 500)
    )  # alone, a larger one (already received) is taken


# ---- a receiver's offer naming a segment that is not a receive pool ------------------------------


def test_a_receiver_offer_naming_another_segment_is_not_written(no_new_segments, tower):
    """A registration whose SHM offer names an intake handle (or any segment of ours that is not a
    receive pool) used to have the rows written into it: the write is refused, the room fails
    with the reason, and the segment's bytes stay as they were."""
    from epdserve.data_plane.shm import namespace_id
    from epdserve.data_plane.shm_transport import ShmTransport
    from epdserve.wire.offers import ShmOffer
    from epdserve.wire.rooms import Registration

    settings = dict(
        transports=("shm",),
        bootstrap_port=0,
        intake_port=0,
        bind="127.0.0.1",
        ring_bytes=8 << 20,
        ring_slot_bytes=1 << 16,
        cache_bytes=0,
        receiver_wait_s=10,
    )
    worker = EncodeWorker(
        WorkerConfig(model=tower.model_id, **settings),
        tower=tower,
        transports={"shm": ShmTransport()},
    ).start()
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    victim = ShmTensorHandle.publish(torch.full((1 << 16,), 7, dtype=torch.uint8), purpose="intake")
    try:
        image = png(64, 64, 5)
        rows = rows_for(tower, image)
        (room,) = worker.table.mint(1, 60)
        offer = ShmOffer(
            kind="shm",
            namespace=namespace_id(),
            segment=victim.shm_name,
            offset=0,
            capacity=1 << 16,
        )
        worker.table.register(
            Registration(
                room=room,
                generation=1,
                rows=rows,
                width=tower.info.wire_width,
                dtype="float32",
                offers=[offer],
            )
        )
        assert intake.send(request(worker, room), image).ok
        view = wait_terminal(worker.table, room)
        assert view.state is RoomState.FAILED and "which is not a receive pool" in view.reason
        victim.attach()
        assert torch.equal(victim.consume(), torch.full((1 << 16,), 7, dtype=torch.uint8))
    finally:
        intake.close()
        worker.stop()
