"""Images as the towers' processors take them: decoded from a file (PNG / JPEG / WebP / BMP, with
PIL, its size checked from the header first) or taken from raw ``uint8 [H, W, 3]`` pixels.
Anything else, or anything malformed, raises ``BadItem`` with a reason that ends up in the item's
room."""

from __future__ import annotations

import io

import torch
from PIL import Image

from vision.limits import IMAGE_FORMATS, MAX_PIXELS, MAX_SIDE


class BadItem(ValueError):
    """This item cannot be encoded; only its room fails."""


def image_from_bytes(data: bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as probe:
            if probe.format not in IMAGE_FORMATS:
                raise BadItem(
                    f"image format {probe.format!r} is not accepted ({sorted(IMAGE_FORMATS)})"
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
