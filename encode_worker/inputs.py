"""Turning what arrives at intake into pixels the tower's own image processor accepts.

Three sources: encoded image bytes (PNG / JPEG / WebP / BMP, decoded with PIL, size-capped), raw
``uint8 [H, W, 3]`` pixels, or a same-node intake ``ShmTensorHandle`` holding such pixels
(``ShmTensorHandle.publish(pixels, purpose="intake")``; the worker consumes and unlinks it).
Anything else, or anything malformed, raises ``BadItem`` with a reason that ends up in the item's
room.
"""

from __future__ import annotations

import io

import torch
from PIL import Image

from data_plane.shm import ShmError, ShmTensorHandle
from encode_worker.config import MAX_PIXELS

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
