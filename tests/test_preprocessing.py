"""Decode and preprocessing in parallel (``--preprocess-workers``) and on the tower's device
(``--preprocess-device tower``): the same rows, bit for bit, as one thread on the CPU; the threads
named and niced as the media stages; one item's failure its own."""

import os
import threading

import pytest
import torch

from encode_worker.config import WorkerConfig
from epdserve.wire.intake import IntakeClient
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

SIZES = [(64, 64), (300, 200), (128, 96), (448, 448), (77, 91)]


@pytest.fixture(scope="module")
def qwen25_full(checkpoints):
    directory = checkpoints["qwen2_5_vl"]
    return directory, FULL_CLASSES["qwen2_5_vl"].from_pretrained(directory).eval()


@pytest.mark.parametrize(
    "settings",
    [dict(preprocess_workers=3), dict(preprocess_device="tower"), dict(preprocess_workers=2)],
    ids=["three-workers", "on-the-tower-device", "two-workers"],
)
def test_parallel_or_on_device_preprocessing_gives_the_same_rows_bit_for_bit(qwen25_full, settings):
    directory, full = qwen25_full
    worker, receiver = make_worker(directory, media_niceness=2, **settings)
    try:
        images = [png(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
        expected = [reference_rows(full, worker.tower, image) for image in images]
        rooms = worker.table.mint(len(images), 60)
        for room, rows in zip(rooms, expected):
            receiver.reserve(room, rows.shape[0], rows.shape[1], rows.dtype)
        jobs = [
            worker.intake.job(_parse(request(worker, room, f"r{i}")), image)
            for i, (room, image) in enumerate(zip(rooms, images))
        ]
        encode_in_this_thread(worker, jobs)
        for room, rows in zip(rooms, expected):
            state, got, view = receiver.wait(room)
            assert state is RoomState.SUCCESS, view.reason
            assert torch.equal(got, rows)
        if settings.get("preprocess_workers", 1) > 1:
            nice = _thread_nice("preprocess")
            assert 0 < len(nice) <= settings["preprocess_workers"]
            assert set(nice) == {min(19, os.getpriority(os.PRIO_PROCESS, 0) + 2)}
    finally:
        worker.stop()
        receiver.close()
    assert _thread_nice("preprocess") == []  # the pool stopped with the worker


def _thread_nice(name: str) -> list[int]:
    """The nice values of this process's pool threads named ``name`` (Python's ``name_N``), each
    checked to carry ``name`` where the OS shows it too. Threads those start inherit the OS name
    (OpenMP's, at a thread's first torch call), so the OS's list alone would count them."""
    values = []
    for thread in threading.enumerate():
        if not thread.name.startswith(name + "_") or thread.native_id is None:
            continue
        try:
            with open(f"/proc/{os.getpid()}/task/{thread.native_id}/comm") as f:
                assert f.read().strip() == name, thread.name
            values.append(os.getpriority(os.PRIO_PROCESS, thread.native_id))
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return values


def test_an_unexpected_preprocessing_error_fails_only_its_item(qwen25_full, monkeypatch):
    """A processor that raises something no one expected (not a bad image) on one item: that
    room fails with the reason, the batch's other item is delivered, and the worker's own
    threads go on serving."""
    directory, full = qwen25_full
    worker, receiver = make_worker(directory, preprocess_workers=2)
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        good, odd, later = png(64, 64, 1), png(77, 91, 2), png(96, 64, 3)
        expected = reference_rows(full, worker.tower, good)
        odd_rows = rows_for(worker.tower, odd)
        later_rows = reference_rows(full, worker.tower, later)
        processor = worker.tower.processor

        class Broken:  # the processor (its sizes too), with a bug for one image's size
            def __getattr__(self, name):
                return getattr(processor, name)

            def __call__(self, images, **kwargs):
                if images[0].size == (91, 77):
                    raise KeyError("a processor bug")
                return processor(images=images, **kwargs)

        monkeypatch.setattr(worker.tower, "processor", Broken())
        rooms = worker.table.mint(3, 60)
        receiver.reserve(rooms[0], expected.shape[0], expected.shape[1], expected.dtype)
        receiver.reserve(rooms[1], odd_rows, expected.shape[1], expected.dtype)
        receiver.reserve(rooms[2], later_rows.shape[0], later_rows.shape[1], later_rows.dtype)
        jobs = [
            worker.intake.job(_parse(request(worker, room, f"r{i}")), image)
            for i, (room, image) in enumerate(zip(rooms[:2], [good, odd]))
        ]
        encode_in_this_thread(worker, jobs)
        state, got, view = receiver.wait(rooms[0])
        assert state is RoomState.SUCCESS, view.reason
        assert torch.equal(got, expected)
        state, _, view = receiver.wait(rooms[1])
        assert state is RoomState.FAILED
        assert "encode worker error while preprocessing" in view.reason
        assert "KeyError" in view.reason
        assert intake.send(request(worker, rooms[2], "later"), later).ok
        state, got, view = receiver.wait(rooms[2])
        assert state is RoomState.SUCCESS, view.reason
        assert torch.equal(got, later_rows)
    finally:
        intake.close()
        worker.stop()
        receiver.close()


def test_device_defaults_fill_a_gpu_and_keep_the_cpu_s(tmp_path):
    cpu = WorkerConfig(model=str(tmp_path), bind="127.0.0.1")
    assert (cpu.batch_patches, cpu.batch_items, cpu.queue_items, cpu.preprocess_workers) == (
        16384,
        8,
        4096,
        1,
    )
    gpu = WorkerConfig(model=str(tmp_path), bind="127.0.0.1", device="cuda:1")
    assert (gpu.batch_patches, gpu.batch_items, gpu.queue_items) == (32768, 64, 16384)
    assert 1 <= gpu.preprocess_workers <= 8
    told = WorkerConfig(
        model=str(tmp_path), bind="127.0.0.1", device="cuda", batch_items=16, preprocess_workers=3
    )
    assert (told.batch_items, told.preprocess_workers, told.batch_patches) == (16, 3, 32768)
    assert WorkerConfig(model=str(tmp_path), bind="127.0.0.1").vision_attention == "auto"
