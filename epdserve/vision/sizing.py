"""The families' sizing rules: an image's or a video's patch grid from its sizes alone, as
the checkpoint's processors will make it (so a dispatcher sizes an item from its header, and the
worker that decodes it agrees), its rows, and which of a video's frames are sampled (the video
processor's ``sample_frames``: by fps, clamped to its ``min_frames`` / ``max_frames`` and rounded
to its temporal patch size, at its ``fps`` or ``DEFAULT_FPS``); a video sized from its container
header within a worker's limits, before anything is decoded (``plan_video_file``). A family names
its rules in the registry (``TowerFamily.sizing``): ``QWEN_VL`` (patch grids the processor sizes
by ``smart_resize``) ``FIXED_SIZE`` (Gemma 3: every image resized to one size, the same rows
whatever its size) or ``TILED`` (InternVL: an image cut into tiles of one size, the tiles' count
by its aspect ratio and size)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from epdserve.vision.images import BadItem
from epdserve.vision.video import BadVideo, VideoHeader, VideoPlan, read_header

# qwen-vl-utils' sampling rate, for a video processor whose config names none (Qwen2-VL's).
DEFAULT_FPS = 2.0


def grid_rows(grid_thw: Sequence[int], processor) -> int:
    """Rows of an item of patch grid ``(t, h, w)``: its patches over ``processor``'s (a Qwen-VL
    image or video processor's) ``merge_size**2``."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // processor.merge_size**2


def image_grid(processor, height: int, width: int) -> tuple[int, int, int]:
    """The ``(t, h, w)`` patch grid a Qwen-VL image processor makes of a ``height x width`` image
    (its ``image_grid_thw``), from the size alone; rows = ``t * h * w // merge_size**2``.
    Raises ``ValueError`` for an image the processor cannot resize (too small, extreme aspect)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patch = processor.patch_size
    resized_h, resized_w = smart_resize(
        height,
        width,
        factor=patch * processor.merge_size,
        min_pixels=processor.size["shortest_edge"],
        max_pixels=processor.size["longest_edge"],
    )
    return 1, resized_h // patch, resized_w // patch


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


def patch_times(indices: Sequence[int], fps: float, temporal: int) -> tuple[float, ...]:
    """Each temporal patch's time in seconds, for a video sampled at frame ``indices`` of a
    ``fps`` stream: the mean of its first and last frame's times, the last patch padded with the
    last frame (as Qwen3-VL's processors, transformers' and vLLM's, time them)."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    return tuple(
        (padded[i] + padded[i + temporal - 1]) / fps / 2 for i in range(0, len(padded), temporal)
    )


def sample_and_size(
    processor, header: VideoHeader, sizing: Sizing
) -> tuple[list[int], tuple[int, int, int]]:
    """The frames ``processor`` samples from a video with this header, and the grid it makes of
    them by the family's ``sizing``: a video file's size, as the dispatcher and the encode worker
    both take it."""
    indices = sampled_indices(processor, header.frames, header.fps)
    return indices, sizing.video_grid(processor, len(indices), header.height, header.width)


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


@dataclass(frozen=True)
class Sizing:
    """A family's sizing rules, as the registry names them."""

    image_grid: Callable[..., tuple[int, int, int]]  # (processor, height, width)
    video_grid: Callable[..., tuple[int, int, int]]  # (processor, frames, height, width)
    rows: Callable[[Sequence[int], object], int]  # (grid, the processor that made it)


QWEN_VL = Sizing(image_grid, video_grid, grid_rows)


def fixed_image_grid(processor, height: int, width: int) -> tuple[int, int, int]:
    """The grid of a fixed-size image processor's (Gemma 3's) image of any size: ``(1, s, s)``,
    ``s * s`` its ``image_seq_length`` (the model's ``mm_tokens_per_image``, written in a
    checkpoint's preprocessor config), one entry per row. ``ValueError`` where the processor
    makes more than one crop of an image (pan-and-scan) or its row count is not a square."""
    if getattr(processor, "do_pan_and_scan", False):
        raise ValueError("pan-and-scan crops are not sized here: serve with do_pan_and_scan off")
    side = _rows_side(processor, "")
    return 1, side, side


def _rows_side(processor, hint: str) -> int:
    """The side ``s`` of the image processor's ``image_seq_length`` rows (an image's, or a
    tile's) as an ``s x s`` grid; ``ValueError`` (ending in ``hint``) where it is no square."""
    tokens = getattr(processor, "image_seq_length", None)
    side = math.isqrt(tokens) if isinstance(tokens, int) and tokens > 0 else 0
    if side * side != tokens:
        raise ValueError(
            f"the image processor's image_seq_length {tokens!r} is not a square token count{hint}"
        )
    return side


def fixed_video_grid(processor, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """None: a family of fixed-size images or tiles takes no video (``BadVideo``)."""
    raise BadVideo("this model takes no video")


def fixed_rows(grid_thw: Sequence[int], processor) -> int:
    """Rows of a fixed-size image of grid ``(1, s, s)``: ``s * s``; of ``t`` tiles of grid
    ``(t, s, s)``: ``t * s * s``."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w


FIXED_SIZE = Sizing(fixed_image_grid, fixed_video_grid, fixed_rows)


def tiled_image_grid(processor, height: int, width: int) -> tuple[int, int, int]:
    """The grid a dynamically tiling image processor's (InternVL's ``crop_to_patches``) makes of a
    ``height x width`` image: ``(tiles, s, s)``, ``tiles`` the processor's count (its
    ``get_number_of_image_patches``: the tiles of the best grid within ``min_patches`` /
    ``max_patches``, and a thumbnail where there is more than one), ``s * s`` the rows of a tile
    (its ``image_seq_length``: the model's processor's, which ``vision.image_processor`` sets on
    it where its own config has none). ``ValueError`` where it names no square one."""
    side = _rows_side(processor, " (the rows of one tile: load it with vision.image_processor)")
    return processor.get_number_of_image_patches(height, width, {}), side, side


# Tiles of one fixed size: rows = tiles x rows per tile, the grid's product as for FIXED_SIZE.
TILED = Sizing(tiled_image_grid, fixed_video_grid, fixed_rows)


@dataclass(frozen=True)
class VideoLimits:
    """What a worker decodes of one video (``WorkerConfig``'s ``--max-video-*`` and
    ``--max-image-pixels`` for a frame): its memory is bounded before anything is decoded."""

    frame_pixels: int
    seconds: float
    frames: int  # sampled frames
    pixels: int  # all the sampled frames' pixels


def plan_video_file(data: bytes, processor, limits: VideoLimits, sizing: Sizing) -> VideoPlan:
    """Size an encoded video from its container header (MP4/MOV) and the video processor's
    sampling, by the family's ``sizing``; ``BadItem`` for one out of limits or unreadable."""
    header = read_header(data)
    if header.duration_s > limits.seconds:
        raise BadItem(
            f"video of {header.duration_s:.1f} s is longer than this worker decodes "
            f"({limits.seconds:g} s)"
        )
    indices, grid = sample_and_size(processor, header, sizing)
    pixels = _within(limits, len(indices), header.height, header.width)
    return VideoPlan(tuple(indices), grid, pixels)


def plan_video_frames(
    shape: list[int], processor, limits: VideoLimits, sizing: Sizing
) -> VideoPlan:
    """Size already-decoded, already-sampled frames, uint8 ``[T, H, W, 3]``, by the family's
    ``sizing``."""
    frames, height, width = shape[0], shape[1], shape[2]
    pixels = _within(limits, frames, height, width)
    return VideoPlan(None, sizing.video_grid(processor, frames, height, width), pixels)


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
