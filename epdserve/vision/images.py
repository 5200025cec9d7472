"""Images as the towers' processors take them: decoded from a file (``vision.limits.IMAGE_FORMATS``,
by vLLM's rules: ``vision.image_files``; its size checked from the header first) or taken from raw
``uint8 [H, W, 3]`` pixels.
Anything else, or anything malformed, raises ``BadItem`` with a reason that ends up in the item's
room."""

from __future__ import annotations

import torch
from PIL import Image

from epdserve.vision.image_files import TooLarge, check_size, open_image, to_rgb
from epdserve.vision.limits import MAX_PIXELS, MAX_SIDE


class BadItem(ValueError):
    """This item cannot be encoded; only its room fails."""


def image_from_bytes(data: bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """An image file decoded as vLLM decodes it (``vision.image_files``), its size checked from
    the header first."""
    try:
        probe = open_image(data)
    except ValueError as exc:
        raise BadItem(f"cannot decode image: {exc}") from None
    with probe:
        try:
            check_size(*probe.size, max_pixels)
        except TooLarge as exc:
            raise BadItem(str(exc)) from None
        try:
            return to_rgb(probe)
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
