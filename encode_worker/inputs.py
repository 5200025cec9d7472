"""Turning what arrives at intake into pixels the tower's own image or video processor accepts.

Images: encoded image bytes (PNG / JPEG / WebP / BMP, decoded with PIL, size-capped), raw
``uint8 [H, W, 3]`` pixels, or a same-node intake ``ShmTensorHandle`` holding such pixels
(``ShmTensorHandle.publish(pixels, purpose="intake")``; the worker consumes and unlinks it).
Videos: an encoded video file (MP4 / MOV: sized from its header at intake, only the sampled frames
decoded later, ``multimodal.video``), or frames already decoded and sampled, raw
``uint8 [T, H, W, 3]``. Anything else, or anything malformed, raises ``BadItem`` with a reason that
ends up in the item's room.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from data_plane.shm import ShmError, ShmTensorHandle
from encode_worker.config import MAX_PIXELS
from multimodal.video import BadVideo, decode_frames, read_header, sample_and_size, video_grid

MAX_SIDE = 16384
ALLOWED_FORMATS = {"PNG", "JPEG", "WEBP", "BMP"}


class BadItem(ValueError):
    """This item cannot be encoded; only its room fails."""


def image_from_bytes(data: bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as probe:
            if probe.format not in ALLOWED_FORMATS:
                raise BadItem(
                    f"image format {probe.format!r} is not accepted ({sorted(ALLOWED_FORMATS)})"
                )
            width, height = probe.size
            if width > MAX_SIDE or height > MAX_SIDE or width * height > max_pixels:
                raise BadItem(
                    f"image of {width}x{height} pixels is larger than allowed "
                    f"({max_pixels} pixels, {MAX_SIDE} a side)"
                )
            image = probe.convert("RGB")
            image.load()
            return image
    except BadItem:
        raise
    except Exception as exc:  # PIL raises many types for corrupt data
        raise BadItem(f"cannot decode image: {type(exc).__name__}: {exc}") from None


def image_from_pixels(pixels: torch.Tensor, max_pixels: int = MAX_PIXELS) -> Image.Image:
    if pixels.dtype != torch.uint8 or pixels.dim() != 3 or pixels.shape[2] != 3:
        raise BadItem(
            f"raw pixels must be uint8 [H, W, 3], got {pixels.dtype} {tuple(pixels.shape)}"
        )
    height, width = int(pixels.shape[0]), int(pixels.shape[1])
    if not (0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE and height * width <= max_pixels):
        raise BadItem(f"raw pixels of {width}x{height} are out of range")
    return Image.fromarray(pixels.contiguous().numpy(), mode="RGB")


def pixels_from_shm(handle: ShmTensorHandle) -> torch.Tensor:
    """Attach to and consume a same-node handle: ``uint8 [H, W, 3]`` pixels, the segment
    unlinked."""
    try:
        handle.attach()
        return handle.consume()
    except (ShmError, ValueError, RuntimeError) as exc:
        raise BadItem(f"cannot read pixels from SHM handle {handle.shm_name}: {exc}") from None


@dataclass(frozen=True)
class VideoLimits:
    """What a worker decodes of one video (``WorkerConfig``'s ``--max-video-*`` and
    ``--max-image-pixels`` for a frame): its memory is bounded before anything is decoded."""

    frame_pixels: int
    seconds: float
    frames: int  # sampled frames
    pixels: int  # all the sampled frames' pixels


@dataclass(frozen=True)
class VideoPlan:
    """A video as intake sizes it, before any decode: the frames to decode (None: the frames came
    decoded and sampled), and the grid the video processor will make of them."""

    frame_indices: tuple[int, ...] | None
    grid_thw: tuple[int, int, int]
    pixels: int  # decoded pixels of the frames the tower gets


def plan_video_file(data: bytes, processor, limits: VideoLimits) -> VideoPlan:
    """Size an encoded video from its container header (MP4/MOV) and the video processor's
    sampling; ``BadItem`` for one out of limits or unreadable."""
    try:
        header = read_header(data)
        if header.duration_s > limits.seconds:
            raise BadItem(
                f"video of {header.duration_s:.1f} s is longer than this worker decodes "
                f"({limits.seconds:g} s)"
            )
        indices, grid = sample_and_size(processor, header)
    except BadVideo as exc:
        raise BadItem(str(exc)) from None
    pixels = _within(limits, len(indices), header.height, header.width)
    return VideoPlan(tuple(indices), grid, pixels)


def plan_video_frames(shape: list[int], processor, limits: VideoLimits) -> VideoPlan:
    """Size already-decoded, already-sampled frames, uint8 ``[T, H, W, 3]``."""
    frames, height, width = shape[0], shape[1], shape[2]
    pixels = _within(limits, frames, height, width)
    try:
        grid = video_grid(processor, frames, height, width)
    except BadVideo as exc:
        raise BadItem(str(exc)) from None
    return VideoPlan(None, grid, pixels)


def _within(limits: VideoLimits, frames: int, height: int, width: int) -> int:
    """The frames' decoded pixels; ``BadItem`` past any of ``limits``."""
    if frames > limits.frames:
        raise BadItem(f"{frames} video frames are more than this worker encodes ({limits.frames})")
    if height * width > limits.frame_pixels:
        raise BadItem(
            f"video frames of {width}x{height} are larger than this worker decodes "
            f"({limits.frame_pixels} pixels)"
        )
    if frames * height * width > limits.pixels:
        raise BadItem(
            f"{frames} frames of {width}x{height} are more pixels than this worker decodes of "
            f"one video ({limits.pixels})"
        )
    return frames * height * width


def video_frames(payload: bytes | torch.Tensor, plan: VideoPlan) -> np.ndarray:
    """The frames the tower gets, uint8 ``[T, H, W, 3]``: decoded (only the sampled ones) from a
    video file, or the frames as they came."""
    if plan.frame_indices is None:
        return payload.numpy()
    try:
        return decode_frames(payload, list(plan.frame_indices))
    except BadVideo as exc:
        raise BadItem(str(exc)) from None
