"""Video items: what a container says about itself, which frames the model's video processor
samples, and decoding those frames alone.

Decoding is PyAV's (FFmpeg ships in its wheel), read the way transformers' own PyAV reader
(``transformers.video_utils.read_video_pyav``) reads: the frame count and rate the container's
header states, frames numbered in decode order, RGB24. So the frames an encode worker feeds the
tower are the frames transformers would, for the same sampling.

Sampling is the checkpoint's video processor's (``sample_frames``: by fps, clamped to its
``min_frames`` / ``max_frames`` and rounded to its temporal patch size), at the processor's ``fps``
or ``DEFAULT_FPS``. ``video_grid`` sizes the sampled frames as the processor's ``resize`` and
``patchify`` will, so a dispatcher computes a video's rows from its header alone, without
decoding it, and agrees with the worker that decodes it (tests check the two against the
processor's own output).

Accepted containers state their frame count in the header (MP4 / MOV and relatives); one that
does not (WebM, Matroska) is refused, since neither side could size it without decoding.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

# qwen-vl-utils' sampling rate, for a video processor whose config names none (Qwen2-VL's).
DEFAULT_FPS = 2.0
# FFmpeg's demuxer name for the ISO base media family (MP4, MOV, M4V, 3GP).
ALLOWED_CONTAINERS = {"mov,mp4,m4a,3gp,3g2,mj2": "MP4/MOV"}
MAX_SIDE = 8192


class BadVideo(ValueError):
    """The video cannot be read, sized or decoded as it claims; only its item fails."""


@dataclass(frozen=True)
class VideoHeader:
    """What the container states about its first video stream (nothing decoded)."""

    frames: int
    fps: float
    width: int
    height: int

    @property
    def duration_s(self) -> float:
        return self.frames / self.fps


def load_video_processor(directory: str, processor_kwargs: dict | None = None):
    """The checkpoint's video processor (its ``video_preprocessor_config.json``, else one built
    from the image processor's config, as transformers does), with ``processor_kwargs`` (the
    ``--mm-processor-kwargs``) over its config; None, logged, when there is none: video items are
    then refused with the reason."""
    from transformers import AutoVideoProcessor

    try:
        return AutoVideoProcessor.from_pretrained(
            directory, local_files_only=True, **(processor_kwargs or {})
        )
    except (OSError, ValueError, ImportError) as exc:
        log.warning("no video processor in %s (%s): video items will be refused", directory, exc)
        return None


def read_header(data: bytes) -> VideoHeader:
    """The header of an encoded video; ``BadVideo`` for one that is not a readable MP4/MOV with a
    stated frame count, rate and size."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if container.format.name not in ALLOWED_CONTAINERS:
                raise BadVideo(
                    f"video container {container.format.name!r} is not accepted "
                    f"({', '.join(ALLOWED_CONTAINERS.values())})"
                )
            if not container.streams.video:
                raise BadVideo("the container holds no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate
            header = VideoHeader(
                int(stream.frames),
                float(rate) if rate else 0.0,
                int(stream.codec_context.width),
                int(stream.codec_context.height),
            )
    except BadVideo:
        raise
    except Exception as exc:  # PyAV raises many types for corrupt data
        raise BadVideo(f"cannot read video: {type(exc).__name__}: {exc}") from None
    if header.frames <= 0 or not math.isfinite(header.fps) or header.fps <= 0:
        raise BadVideo(
            f"the video states {header.frames} frames at {header.fps} fps: "
            "a frame count and rate are needed"
        )
    if not (0 < header.width <= MAX_SIDE and 0 < header.height <= MAX_SIDE):
        raise BadVideo(f"video frames of {header.width}x{header.height} are out of range")
    return header


def sampled_indices(processor, frames: int, fps: float) -> list[int]:
    """The frame indices ``processor`` (a Qwen-VL video processor) samples from a video of
    ``frames`` frames at ``fps``; ``BadVideo`` when it cannot sample it (too few frames)."""
    from transformers.video_utils import VideoMetadata

    metadata = VideoMetadata(total_num_frames=frames, fps=fps)
    try:
        indices = processor.sample_frames(metadata, fps=processor.fps or DEFAULT_FPS)
    except ValueError as exc:
        raise BadVideo(f"cannot sample {frames} frames at {fps} fps: {exc}") from None
    indices = [int(i) for i in np.asarray(indices).tolist()]
    if not indices:
        raise BadVideo(f"sampling {frames} frames at {fps} fps leaves none")
    return indices


def sample_and_size(processor, header: VideoHeader) -> tuple[list[int], tuple[int, int, int]]:
    """The frames ``processor`` samples from a video with this header, and the grid it makes of
    them: a video file's size, as the dispatcher and the encode worker both take it."""
    indices = sampled_indices(processor, header.frames, header.fps)
    return indices, video_grid(processor, len(indices), header.height, header.width)


def decode_frames(data: bytes, indices: list[int]) -> np.ndarray:
    """The frames at ``indices`` (decode order, as the header numbers them): uint8
    ``[len(indices), H, W, 3]``. Decoding stops after the last one; ``BadVideo`` when the stream
    ends first or cannot be decoded."""
    import av

    wanted = set(indices)
    last = max(indices)
    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            for number, frame in enumerate(container.decode(video=0)):
                if number in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if number >= last:
                    break
    except Exception as exc:  # PyAV raises many types for corrupt data
        raise BadVideo(f"cannot decode video: {type(exc).__name__}: {exc}") from None
    if len(frames) != len(wanted):
        raise BadVideo(
            f"the video decoded to fewer frames than its header states (frame {last} needed)"
        )
    shapes = {frame.shape for frame in frames}
    if len(shapes) != 1:
        raise BadVideo(f"the video's frames change size ({sorted(shapes)})")
    by_index = dict(zip(sorted(wanted), frames))
    return np.stack([by_index[i] for i in indices])


def video_grid(processor, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """The ``(t, h, w)`` patch grid ``processor`` makes of ``frames`` sampled frames of
    ``height x width`` (its ``video_grid_thw``), from the sizes alone; rows =
    ``t * h * w // merge_size**2``. ``BadVideo`` for a video it cannot resize."""
    from transformers import Qwen2VLVideoProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize as resize_2
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as resize_3

    patch, merge = processor.patch_size, processor.merge_size
    temporal = processor.temporal_patch_size
    factor = patch * merge
    min_pixels, max_pixels = processor.size["shortest_edge"], processor.size["longest_edge"]
    capped = bool(processor.cap_pixels_per_frame)
    try:
        if isinstance(processor, Qwen3VLVideoProcessor):
            if capped:  # as Qwen3VLVideoProcessor.resize caps it
                per_frame = max(
                    min(processor.max_video_tokens * factor * factor, max_pixels // frames),
                    int(min_pixels * 1.05),
                )
                max_pixels = per_frame * frames
            resized_h, resized_w = resize_3(
                frames, height, width, temporal, factor, min_pixels, max_pixels
            )
        elif isinstance(processor, Qwen2VLVideoProcessor):
            if capped:  # as Qwen2VLVideoProcessor.resize caps it
                total = int(processor.max_video_tokens * factor * factor * 0.9)
                max_pixels = max(
                    min(max_pixels, total * temporal // frames), int(min_pixels * 1.05)
                )
            resized_h, resized_w = resize_2(height, width, factor, min_pixels, max_pixels)
        else:
            raise BadVideo(f"no video sizing for {type(processor).__name__}")
    except ValueError as exc:
        if isinstance(exc, BadVideo):
            raise
        raise BadVideo(f"a {width}x{height} video cannot be resized for the tower: {exc}") from None
    return -(-frames // temporal), resized_h // patch, resized_w // patch
