"""Video items: what a container says about itself, which frames the model's video processor
samples, and decoding those frames alone.

Decoding is PyAV's (FFmpeg ships in its wheel), read the way transformers' own PyAV reader
(``transformers.video_utils.read_video_pyav``) reads: the frame count and rate the container's
header states, frames numbered in decode order, RGB24. So the frames an encode worker feeds the
tower are the frames transformers would, for the same sampling.

Which frames are sampled, and the grid they make, are the family's sizing rules
(``vision.sizing``): a dispatcher computes a video's rows from its header alone, without decoding
it, and agrees with the worker that decodes it.

Accepted containers state their frame count in the header (MP4 / MOV and relatives); one that
does not (WebM, Matroska) is refused, since neither side could size it without decoding.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from epdserve.vision.images import BadItem
from epdserve.vision.limits import MAX_VIDEO_SIDE, VIDEO_CONTAINERS

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class BadVideo(BadItem):
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


@dataclass(frozen=True)
class VideoPlan:
    """A video as intake sizes it, before any decode: the frames to decode (None: the frames came
    decoded and sampled), and the grid the video processor will make of them."""

    frame_indices: tuple[int, ...] | None
    grid_thw: tuple[int, int, int]
    pixels: int  # decoded pixels of the frames the tower gets


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


class ContainerNotTaken(BadVideo):
    """A video PyAV reads, in a container encode workers do not decode (``VIDEO_CONTAINERS``);
    ``header``: what it states about its first video stream (None: it has none), for a process
    that leaves the decoding to vLLM."""

    def __init__(self, container: str, header: VideoHeader | None):
        super().__init__(
            f"video container {container!r} is not accepted "
            f"({', '.join(VIDEO_CONTAINERS.values())})"
        )
        self.container, self.header = container, header


NO_VIDEO_STREAM = "the container holds no video stream"


def _probe(data: bytes) -> tuple[str, VideoHeader | None]:
    """The container's name and what it states about its first video stream (None: none);
    ``BadVideo`` when PyAV cannot read it."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                return container.format.name, None
            stream = container.streams.video[0]
            rate = stream.average_rate
            return container.format.name, VideoHeader(
                int(stream.frames),
                float(rate) if rate else 0.0,
                int(stream.codec_context.width),
                int(stream.codec_context.height),
            )
    except Exception as exc:  # PyAV raises many types for corrupt data
        raise BadVideo(f"cannot read video: {type(exc).__name__}: {exc}") from None


def frame_size(header: VideoHeader | None) -> tuple[int, int]:
    """The frames' width and height a header states; ``BadVideo`` for a container without a
    video stream or a size out of range."""
    if header is None:
        raise BadVideo(NO_VIDEO_STREAM)
    if not (0 < header.width <= MAX_VIDEO_SIDE and 0 < header.height <= MAX_VIDEO_SIDE):
        raise BadVideo(f"video frames of {header.width}x{header.height} are out of range")
    return header.width, header.height


def read_header(data: bytes) -> VideoHeader:
    """The header of an encoded video; ``BadVideo`` for one that is not a readable MP4/MOV with a
    stated frame count, rate and size (``ContainerNotTaken`` for another container)."""
    container, header = _probe(data)
    if container not in VIDEO_CONTAINERS:
        raise ContainerNotTaken(container, header)
    if header is None:
        raise BadVideo(NO_VIDEO_STREAM)
    if header.frames <= 0 or not math.isfinite(header.fps) or header.fps <= 0:
        raise BadVideo(
            f"the video states {header.frames} frames at {header.fps} fps: "
            "a frame count and rate are needed"
        )
    frame_size(header)
    return header


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


def video_frames(payload: bytes | torch.Tensor, plan: VideoPlan) -> np.ndarray:
    """The frames the tower gets, uint8 ``[T, H, W, 3]``: decoded (only the sampled ones) from a
    video file, or the frames as they came."""
    if plan.frame_indices is None:
        return payload.numpy()
    return decode_frames(payload, list(plan.frame_indices))
