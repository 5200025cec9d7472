"""Video items in the encode worker: sized from the container header, the sampled frames decoded
with PyAV, encoded by the real (small) towers beside images, rows bit-exact against transformers'
own reader, video processor and ``get_video_features``; bad videos fail only their rooms."""

import functools
import io

import numpy as np
import pytest
import torch
from transformers.video_utils import read_video_pyav

from epdserve.vision.families import FAMILIES
from epdserve.vision.sizing import DEFAULT_FPS, video_grid
from epdserve.vision.video import BadVideo, read_header
from epdserve.wire.intake import IntakeRequest, IntakeStatus
from epdserve.wire.rooms import RoomState
from tests.encode_helpers import mp4, png, video_frames
from tests.test_encode_worker import (
    FULL_CLASSES,
    encode_in_this_thread,
    handshake,
    make_worker,
    reference_rows,
)
from tests.waiting import eventually

# The families that take video (a video processor in the registry).
VIDEO_FAMILIES = [name for name, entry in FAMILIES.items() if entry.small_video_processor]


def wire_rows(out) -> torch.Tensor:
    """One item's features from transformers' ``get_*_features`` in the wire layout."""
    (main,) = out.pooler_output
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack:
        return torch.cat([main, *[level[0] for level in deepstack]], dim=1)
    return main


def transformers_video_rows(full_model, processor, frames: np.ndarray) -> torch.Tensor:
    inputs = processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
    with torch.inference_mode():
        return wire_rows(
            full_model.get_video_features(
                inputs["pixel_values_videos"], video_grid_thw=inputs["video_grid_thw"]
            )
        )


def transformers_frames(processor, video: bytes) -> np.ndarray:
    """The frames transformers' own PyAV reader gives for the processor's sampling."""
    sample = functools.partial(processor.sample_frames, fps=processor.fps or DEFAULT_FPS)
    frames, _ = read_video_pyav(io.BytesIO(video), sample_indices_fn=sample)
    return frames


def video_request(worker, room, source="bytes", shape=None, **extra) -> IntakeRequest:
    return IntakeRequest.model_validate(
        {
            "request_id": f"v{room}",
            "modality": "VIDEO",
            "encode_handshake": handshake(worker, room).model_dump(),
            "source": source,
            **({"shape": list(shape)} if shape is not None else {}),
            **extra,
        }
    )


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_videos_and_images_in_one_batch_are_bit_identical_to_transformers(checkpoints, family):
    directory = checkpoints[family]
    full = FULL_CLASSES[family].from_pretrained(directory).eval()
    worker, receiver = make_worker(directory)
    try:
        tower = worker.tower
        video_file = mp4(20, 64, 96, seed=1)  # 2 s at 10 fps: 4 frames sampled at 2 fps
        frames = video_frames(6, 56, 84, seed=2)  # decoded and sampled by the sender
        image = png(64, 64, seed=3)
        expected = [
            transformers_video_rows(
                full, tower.video_processor, transformers_frames(tower.video_processor, video_file)
            ),
            transformers_video_rows(full, tower.video_processor, frames),
            reference_rows(full, tower, image),
        ]
        rooms = worker.table.mint(3, 60)
        for room, rows in zip(rooms, expected):
            receiver.reserve(room, rows.shape[0], rows.shape[1], rows.dtype)
        jobs = [
            worker.intake.job(video_request(worker, rooms[0]), video_file),
            worker.intake.job(
                video_request(worker, rooms[1], "pixels", frames.shape), frames.tobytes()
            ),
            worker.intake.job(
                IntakeRequest.model_validate(
                    {
                        "request_id": "image",
                        "encode_handshake": handshake(worker, rooms[2]).model_dump(),
                        "source": "bytes",
                    }
                ),
                image,
            ),
        ]
        encode_in_this_thread(worker, jobs)  # one batch, one tower call: two videos, one image
        assert worker.metrics.batch_items._sum.get() == 3
        assert worker.metrics.encode_cpu_seconds._value.get() > 0  # the tower thread's CPU
        assert worker.metrics.preprocess_cpu_seconds._value.get() > 0  # decode + processors
        for room, rows in zip(rooms, expected):
            state, got, view = receiver.wait(room)
            assert state is RoomState.SUCCESS, view.reason
            assert torch.equal(got, rows)
        assert jobs[0].grid_thw[0] == 2 and jobs[1].grid_thw[0] == 3  # temporal patches of 2
        assert worker.tower.rows_per_item(torch.tensor([jobs[0].grid_thw])) == [
            expected[0].shape[0]
        ]
    finally:
        worker.stop()
        receiver.close()


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
@pytest.mark.parametrize("capped", [False, True])
def test_the_grid_from_sizes_alone_is_the_processors(family, capped):
    """What a dispatcher computes from a header equals what the processor makes of the frames."""
    processor = FAMILIES[family].small_video_processor()
    processor.cap_pixels_per_frame = capped
    processor.max_video_tokens = 48  # small enough for the cap to bind on these sizes
    for frames, height, width in [(2, 64, 64), (4, 90, 160), (5, 33, 200), (8, 300, 40)]:
        video = np.zeros((frames, height, width, 3), dtype=np.uint8)
        made = processor(videos=[video], do_sample_frames=False, return_tensors="pt")
        assert video_grid(processor, frames, height, width) == tuple(
            made["video_grid_thw"][0].tolist()
        ), (frames, height, width)


def test_the_header_gives_frames_rate_and_size_without_decoding():
    header = read_header(mp4(30, 48, 80, seed=4, fps=15))
    assert (header.frames, header.fps, header.width, header.height) == (30, 15.0, 80, 48)
    assert header.duration_s == 2.0
    with pytest.raises(BadVideo, match="cannot read video"):
        read_header(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64)


def webm(frames: int = 10) -> bytes:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="webm") as container:
        stream = container.add_stream("libvpx", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for frame in video_frames(frames, 64, 64, seed=5):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def test_bad_videos_fail_only_their_rooms(checkpoints):
    directory = checkpoints["qwen2_vl"]
    worker, receiver = make_worker(
        directory, max_video_seconds=5, max_video_frames=16, max_video_pixels=40_000
    )
    try:
        tower = worker.tower
        good = mp4(20, 64, 64, seed=6)
        whole = mp4(40, 64, 64, seed=7)
        start = whole.find(b"mdat") + 8  # the frames' data: the header (at the end) stays intact
        zeroed = whole[:start] + bytes(len(whole) // 2) + whole[start + len(whole) // 2 :]
        bad = {
            "frames zeroed": (zeroed, "cannot decode video"),  # sized at intake, fails decoding
            "truncated": (whole[: len(whole) // 2], "cannot read video"),
            "garbage": (b"\x00" * 4096, "cannot read video"),
            "too long": (mp4(60, 32, 32, seed=8), "longer than this worker decodes"),
            "webm": (webm(), "is not accepted"),
            "too many pixels": (mp4(20, 128, 128, seed=9), "more pixels than this worker"),
        }
        rooms = worker.table.mint(len(bad) + 2, 60)
        good_frames = transformers_frames(tower.video_processor, good)
        (expected_rows,) = tower.rows_per_item(
            tower.video_processor(videos=[good_frames], return_tensors="pt")["video_grid_thw"]
        )
        receiver.reserve(rooms[0], expected_rows, tower.info.wire_width, tower.dtype)
        replies = {}
        jobs = [worker.intake.job(video_request(worker, rooms[0]), good)]
        for room, (name, (payload, _)) in zip(rooms[1:], bad.items()):
            # one sized fine from its header is queued: the worker's own stages fail it
            reply = worker.intake.accept([video_request(worker, room).model_dump_json(), payload])
            replies[name] = (room, reply)
        too_many = video_frames(20, 16, 16, seed=10)  # 20 decoded frames, 16 allowed
        over = worker.intake.accept(
            [
                video_request(worker, rooms[-1], "pixels", too_many.shape).model_dump_json(),
                too_many.tobytes(),
            ]
        )
        assert over.status is IntakeStatus.FAILED and "more than this worker encodes" in over.reason
        encode_in_this_thread(worker, jobs)
        state, got, view = receiver.wait(rooms[0])
        assert state is RoomState.SUCCESS, view.reason
        assert got.shape[0] == expected_rows
        for name, (payload, reason) in bad.items():
            room, reply = replies[name]
            eventually(lambda: worker.table.view(room).state.terminal, f"{name}'s room ended")
            view = worker.table.view(room)
            assert view.state is RoomState.FAILED, name
            assert reason in view.reason, (name, view.reason)
        assert worker.table.view(rooms[-1]).state is RoomState.FAILED
    finally:
        worker.stop()
        receiver.close()


def test_a_grid_the_sender_computed_otherwise_is_refused_before_any_encode(checkpoints):
    worker, receiver = make_worker(checkpoints["qwen2_vl"])
    try:
        (room,) = worker.table.mint(1, 60)
        reply = worker.intake.accept(
            [
                # the worker sizes it [2, 4, 4]
                video_request(worker, room, grid_thw=[2, 4, 6]).model_dump_json(),
                mp4(20, 64, 64, seed=11),
            ]
        )
        assert reply.status is IntakeStatus.FAILED and "disagree" in reply.reason
        assert len(worker.queue) == 0
        assert worker.table.view(room).state is RoomState.FAILED
    finally:
        worker.stop()
        receiver.close()
