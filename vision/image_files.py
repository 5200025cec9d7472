"""An image file as vLLM's own media pipeline reads it, so that the encode worker's tower sees the
pixels vLLM's tower would (torch-free: the dispatcher sizes images with it). vLLM's rules
(``vllm.multimodal.media.image.ImageMediaIO.load_bytes``, 0.32): the first frame of the file;
the EXIF orientation applied (an unreadable EXIF block ignored); then RGB, where an image with
transparency (RGBA, LA, PA, or a ``transparency`` entry: a palette's or a PNG's tRNS) is
composited onto white, and any other mode converted as PIL converts it.

``header`` sizes an image from its header alone (the size as displayed: EXIF orientations 5-8
swap width and height); ``decode_rgb`` decodes it by the same rules."""

from __future__ import annotations

import contextlib
import io
from typing import NamedTuple

from PIL import Image, ImageOps

from vision.limits import IMAGE_FORMATS, MAX_SIDE

ORIENTATION_TAG = 0x0112  # EXIF Orientation
TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}  # turned by a quarter: width and height swap
BACKGROUND = (255, 255, 255)  # what vLLM composites transparent pixels onto


class TooLarge(ValueError):
    """The header declares an image larger than the limit (nothing was decoded)."""

    def __init__(self, width: int, height: int, max_pixels: int):
        super().__init__(
            f"an image of {width}x{height} pixels is larger than accepted "
            f"({max_pixels} pixels, {MAX_SIDE} a side)"
        )
        self.width, self.height, self.max_pixels = width, height, max_pixels


class FormatNotTaken(ValueError):
    """An image PIL reads, in a format encode workers do not decode (``IMAGE_FORMATS``)."""

    def __init__(self, image_format: str | None):
        super().__init__(f"image format {image_format!r} is not accepted ({sorted(IMAGE_FORMATS)})")
        self.format = image_format


class ImageHeader(NamedTuple):
    width: int  # as displayed (after the EXIF orientation)
    height: int
    format: str  # PIL's name


def open_image(data: bytes, any_format: bool = False) -> Image.Image:
    """The file opened (its header read, nothing decoded); ``ValueError`` with the reason for a
    file that is not an image, ``FormatNotTaken`` for one of a format encode workers do not
    decode (unless ``any_format``: sizing only)."""
    try:
        image = Image.open(io.BytesIO(data))
    except Exception as exc:  # PIL raises many types for bad data; its text names a BytesIO
        raise ValueError(
            f"not an image encode workers read ({', '.join(sorted(IMAGE_FORMATS))}): "
            f"{type(exc).__name__}"
        ) from None
    if image.format not in IMAGE_FORMATS and not any_format:
        image.close()
        raise FormatNotTaken(image.format)
    return image


def header(data: bytes, max_pixels: int, any_format: bool = False) -> ImageHeader:
    """The image's displayed size and format, from its header; ``ValueError`` as ``open_image``,
    ``TooLarge`` for an image above ``max_pixels`` or ``MAX_SIDE`` a side (checked before anything
    else is read)."""
    with open_image(data, any_format) as image:
        width, height = image.size
        check_size(width, height, max_pixels)
        if _orientation(image) in TRANSPOSED_ORIENTATIONS:
            width, height = height, width
        return ImageHeader(width, height, image.format)


def check_size(width: int, height: int, max_pixels: int) -> None:
    """``TooLarge`` for an image above ``max_pixels`` or ``MAX_SIDE`` a side (the rule every
    side that reads an image's size applies, before decoding it)."""
    if width > MAX_SIDE or height > MAX_SIDE or width * height > max_pixels:
        raise TooLarge(width, height, max_pixels)


def to_rgb(image: Image.Image) -> Image.Image:
    """An opened image as vLLM hands it to its processor: oriented, then RGB (transparency on
    white)."""
    with contextlib.suppress(Exception):  # as vLLM: a broken EXIF block leaves the image as is
        image = ImageOps.exif_transpose(image)
    image.load()
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, BACKGROUND)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert("RGB")


def _orientation(image: Image.Image) -> int | None:
    """The EXIF orientation the header holds. A PNG's EXIF is read only from an eXIf chunk before
    the image data (PIL would decode the whole image to look for one after it: such a rare file's
    grid then disagrees with the worker's, which fails the item rather than encode it otherwise)."""
    if image.format == "PNG" and "exif" not in image.info:
        return None
    with contextlib.suppress(Exception):  # an unreadable EXIF block: no orientation, as vLLM
        return image.getexif().get(ORIENTATION_TAG)
    return None
