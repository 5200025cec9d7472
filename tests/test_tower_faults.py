"""A GPU fault costs one batch at most: out of memory splits the batch and tries each half again;
a lost device fails its batch, intake and readiness with the reason, and the worker keeps
answering. No GPU runs here, so the tower raises what CUDA raises (``torch.OutOfMemoryError``,
a sticky ``CUDA error``) and the device's own check says what a lost GPU's would; the items, the
rooms, the writes and the HTTP answers are the worker's real ones."""

import json
import urllib.error
import urllib.request

import pytest
import torch

from epdserve.wire.intake import IntakeClient, IntakeStatus
from epdserve.wire.rooms import RoomState
from tests.encode_helpers import png
from tests.test_encode_worker import (
    FULL_CLASSES,
    _parse,
    encode_in_this_thread,
    make_worker,
    reference_rows,
    request,
    rows_for,
)

LOST = "CUDA error: an illegal memory access was encountered"


def _tower_with_memory(monkeypatch, tower, patches: int) -> list[int]:
    """The tower raises CUDA's out-of-memory error on a batch of more than ``patches`` patches;
    returns the items per call it ran."""
    calls = []
    encode = tower.encode

    def bounded(pixel_values, grid_thw):
        if pixel_values.shape[0] > patches:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate for {pixel_values.shape[0]} patches"
            )
        calls.append(grid_thw.shape[0])
        return encode(pixel_values, grid_thw)

    monkeypatch.setattr(tower, "encode", bounded)
    return calls


@pytest.fixture
def qwen25_full(checkpoints):
    directory = checkpoints["qwen2_5_vl"]
    return directory, FULL_CLASSES["qwen2_5_vl"].from_pretrained(directory).eval()


def test_out_of_memory_splits_the_batch_and_every_item_is_delivered(qwen25_full, monkeypatch):
    directory, full = qwen25_full
    worker, receiver = make_worker(directory)
    try:
        images = [png(112, 112, seed) for seed in range(4)]  # 64 patches each
        expected = [reference_rows(full, worker.tower, image) for image in images]
        calls = _tower_with_memory(monkeypatch, worker.tower, patches=2 * 64)
        rooms = worker.table.mint(len(images), 60)
        for room, rows in zip(rooms, expected):
            receiver.reserve(room, rows.shape[0], rows.shape[1], rows.dtype)
        jobs = [
            worker.intake.job(_parse(request(worker, room, f"r{i}")), image)
            for i, (room, image) in enumerate(zip(rooms, images))
        ]
        encode_in_this_thread(worker, jobs)
        assert calls == [2, 2]  # 4 -> out of memory -> two halves of 2
        assert worker.metrics.oom_splits._value.get() == 1
        for room, rows in zip(rooms, expected):
            state, got, view = receiver.wait(room)
            assert state is RoomState.SUCCESS, view.reason
            assert torch.equal(got, rows)
        assert worker.not_ready() is None
    finally:
        worker.stop()
        receiver.close()


def test_an_item_too_large_for_the_device_alone_fails_only_its_room(qwen25_full, monkeypatch):
    directory, full = qwen25_full
    worker, receiver = make_worker(directory)
    try:
        small, large = png(112, 112, 1), png(448, 448, 2)  # 64 and 1024 patches
        expected = reference_rows(full, worker.tower, small)
        _tower_with_memory(monkeypatch, worker.tower, patches=512)
        rooms = worker.table.mint(3, 60)
        images = [small, large, small]
        receiver.reserve(rooms[0], expected.shape[0], expected.shape[1], expected.dtype)
        receiver.reserve(rooms[1], rows_for(worker.tower, large), expected.shape[1], expected.dtype)
        receiver.reserve(rooms[2], expected.shape[0], expected.shape[1], expected.dtype)
        jobs = [
            worker.intake.job(_parse(request(worker, room, f"r{i}")), image)
            for i, (room, image) in enumerate(zip(rooms, images))
        ]
        encode_in_this_thread(worker, jobs)
        state, _, view = receiver.wait(rooms[1])
        assert state is RoomState.FAILED
        assert "out of memory" in view.reason
        for room in (rooms[0], rooms[2]):  # the identical small one: cached, or encoded again
            state, got, view = receiver.wait(room)
            assert state is RoomState.SUCCESS, view.reason
            assert torch.equal(got, expected)
        assert worker.not_ready() is None  # out of memory is no lost device
    finally:
        worker.stop()
        receiver.close()


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_lost_device_fails_its_batch_intake_and_readiness_but_not_the_worker(
    checkpoints, monkeypatch
):
    directory = checkpoints["qwen2_5_vl"]
    worker, receiver = make_worker(directory)
    base = f"http://127.0.0.1:{worker.bootstrap_port}"
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        assert _get(base + "/readyz")[0] == 200
        calls = []

        def lost(pixel_values, grid_thw):
            calls.append(grid_thw.shape[0])
            raise RuntimeError(LOST)

        monkeypatch.setattr(worker.tower, "encode", lost)
        monkeypatch.setattr(worker.device, "failure", lambda: LOST)
        images = [png(112, 112, seed) for seed in range(3)]
        rooms = worker.table.mint(len(images), 60)
        for room, image in zip(rooms, images):
            receiver.reserve(
                room, rows_for(worker.tower, image), worker.tower.info.wire_width, torch.float32
            )
        jobs = [
            worker.intake.job(_parse(request(worker, room, f"r{i}")), image)
            for i, (room, image) in enumerate(zip(rooms, images))
        ]
        encode_in_this_thread(worker, jobs)
        assert calls == [3]  # one try of the batch: no item-by-item retry on a lost device
        for room in rooms:
            state, _, view = receiver.wait(room)
            assert state is RoomState.FAILED
            assert LOST in view.reason
        status, body = _get(base + "/readyz")
        assert status == 503 and LOST in body["reason"]
        assert _get(base + "/healthz")[0] == 200  # the process answers: its rooms fail fast
        # intake refuses (room untouched: the dispatcher places the item on another worker)
        (room,) = worker.table.mint(1, 60)
        reply = intake.send(request(worker, room, "after"), png(64, 64, 9))
        assert reply.status is IntakeStatus.REFUSED and LOST in reply.reason
        # a batch that reaches the tower stage anyway fails at once, without a tower call
        (room,) = worker.table.mint(1, 60)
        encode_in_this_thread(
            worker, [worker.intake.job(_parse(request(worker, room, "late")), png(64, 64, 8))]
        )
        assert calls == [3]
    finally:
        intake.close()
        worker.stop()
        receiver.close()
