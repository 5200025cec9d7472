"""Image files of every kind a user sends: PIL modes (bilevel, grey, palette, RGB, 16-bit, CMYK),
alpha full, partial and none, palettes with and without transparency, EXIF orientations 1-8, PNG /
JPEG / WebP / BMP / GIF, an animated GIF. ``matrix()``: name -> file bytes (made once)."""

from __future__ import annotations

import functools
import io

import numpy as np
from PIL import Image

from epdserve.testing.images import synthetic_image

WIDTH, HEIGHT = 96, 64  # not square: a quarter turn changes the grid
ORIENTATION_TAG = 0x0112


def _base(seed: int = 5) -> Image.Image:
    return Image.open(io.BytesIO(synthetic_image(WIDTH, HEIGHT, seed=seed))).convert("RGB")


def _saved(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _with_alpha(alpha: str) -> Image.Image:
    """The base image with an alpha channel: opaque, a gradient (partial) or all clear."""
    rgba = _base().convert("RGBA")
    values = {
        "opaque": np.full((HEIGHT, WIDTH), 255, np.uint8),
        "partial": np.tile(np.linspace(0, 255, WIDTH, dtype=np.uint8), (HEIGHT, 1)),
        "clear": np.zeros((HEIGHT, WIDTH), np.uint8),
    }[alpha]
    rgba.putalpha(Image.fromarray(values, "L"))
    return rgba


def _oriented_jpeg(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = orientation
    return _saved(_base(7), "JPEG", quality=95, exif=exif.tobytes())


def _animated_gif() -> bytes:
    first, second = _base(8).quantize(64), _base(9).quantize(64)
    return _saved(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)


@functools.cache
def matrix() -> dict[str, bytes]:
    base = _base()
    grey = base.convert("L")
    palette = base.quantize(32)
    sixteen = Image.fromarray(np.asarray(grey, np.uint16) * 257)  # mode I;16
    cases = {
        "png-1": _saved(base.convert("1"), "PNG"),
        "png-L": _saved(grey, "PNG"),
        "png-L-trns": _saved(grey, "PNG", transparency=128),
        "png-LA-partial": _saved(_with_alpha("partial").convert("LA"), "PNG"),
        "png-P": _saved(palette, "PNG"),
        "png-P-trns": _saved(palette, "PNG", transparency=3),
        "png-RGB": _saved(base, "PNG"),
        "png-RGB-trns": _saved(base, "PNG", transparency=tuple(base.getpixel((0, 0)))),
        "png-I16": _saved(sixteen, "PNG"),
        "png-RGBA-opaque": _saved(_with_alpha("opaque"), "PNG"),
        "png-RGBA-partial": _saved(_with_alpha("partial"), "PNG"),
        "png-RGBA-clear": _saved(_with_alpha("clear"), "PNG"),
        "webp-RGB": _saved(base, "WEBP", lossless=True),
        "webp-RGBA-partial": _saved(_with_alpha("partial"), "WEBP", lossless=True),
        "jpeg-L": _saved(grey, "JPEG", quality=95),
        "jpeg-CMYK": _saved(base.convert("CMYK"), "JPEG", quality=95),
        "bmp-RGB": _saved(base, "BMP"),
        "bmp-P": _saved(palette, "BMP"),
        "gif-P": _saved(palette, "GIF"),
        "gif-trns": _saved(palette, "GIF", transparency=3),
        "gif-animated": _animated_gif(),
    }
    for orientation in range(1, 9):
        cases[f"jpeg-exif-{orientation}"] = _oriented_jpeg(orientation)
    return cases
