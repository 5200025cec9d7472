"""An image file as vLLM's own media pipeline reads it, so that the encode worker's tower sees the
pixels vLLM's tower would (torch-free: the dispatcher sizes images with it). vLLM's rules
(``vllm.multimodal.media.image.ImageMediaIO.load_bytes``, 0.32): the first frame of the file;
the EXIF orientation applied (an unreadable EXIF block ignored); then RGB, where an image with
transparency (RGBA, LA, PA, or a ``transparency`` entry: a palette's or a PNG's tRNS) is
composited onto white, and any other mode converted as PIL converts it.

``header`` sizes an image from its header alone (the size as displayed: EXIF orientations 5-8
swap width and height); ``decode_rgb`` decodes it by the same rules. A plain PNG's header is read
here without PIL (``png_size``: the dispatcher and every worker's intake read one per image, and
PIL's open costs ~9 us of it); every other file goes through PIL."""

from __future__ import annotations

import contextlib
import io
import struct
import zlib
from typing import NamedTuple

from PIL import Image, ImageOps

from vision.limits import IMAGE_FORMATS, MAX_SIDE

ORIENTATION_TAG = 0x0112  # EXIF Orientation
TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}  # turned by a quarter: width and height swap
BACKGROUND = (255, 255, 255)  # what vLLM composites transparent pixels onto
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The (bit depth, colour type) pairs PIL reads (``PngImagePlugin._MODES``).
PNG_MODES = {(1, 0), (2, 0), (4, 0), (8, 0), (16, 0), (8, 2), (16, 2), (1, 3), (2, 3), (4, 3)}
PNG_MODES |= {(8, 3), (8, 4), (16, 4), (8, 6), (16, 6)}
# The chunks ``png_size`` passes over before the image data, each with the least length PIL's
# reader takes without an error (tRNS: by colour type, below). Any other chunk (an eXIf, a text,
# a colour profile, an animation's) leaves the file to PIL.
PNG_PLAIN_CHUNKS = {b"PLTE": 0, b"tRNS": 0, b"gAMA": 4, b"cHRM": 32, b"sRGB": 1, b"pHYs": 9}
PNG_TRNS_LENGTHS = {0: 2, 2: 6}  # a grey key is 2 bytes, a truecolour one 6


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
    size = png_size(data)
    if size is not None:
        check_size(*size, max_pixels)
        return ImageHeader(*size, "PNG")
    with open_image(data, any_format) as image:
        width, height = image.size
        check_size(width, height, max_pixels)
        if _orientation(image) in TRANSPOSED_ORIENTATIONS:
            width, height = height, width
        return ImageHeader(width, height, image.format)


def png_size(data: bytes) -> tuple[int, int] | None:
    """A PNG's (width, height), read as PIL reads them, when its header is plain: the signature,
    an IHDR of a mode PIL reads, then only ``PNG_PLAIN_CHUNKS`` up to the first IDAT, every CRC
    right. Such a file holds no orientation (no eXIf) and PIL opens it to the same size; None
    for every other file (PIL reads it, and says what is wrong with it)."""
    if not data.startswith(PNG_SIGNATURE):
        return None
    size, at = None, len(PNG_SIGNATURE)
    while at + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, at)
        if kind == b"IDAT":
            return size
        end = at + 8 + length
        if end + 4 > len(data):
            return None
        if size is None:
            if kind != b"IHDR" or length != 13:
                return None
            width, height, depth, colour, _, filtering = struct.unpack_from(">IIBBBB", data, at + 8)
            limit = Image.MAX_IMAGE_PIXELS  # PIL's own (above it, PIL warns or refuses)
            if (depth, colour) not in PNG_MODES or filtering or not width or not height:
                return None
            if limit is not None and width * height > limit:
                return None
            size = (width, height)
        elif length < PNG_PLAIN_CHUNKS.get(kind, 1 << 32):
            return None
        elif kind == b"tRNS" and length < PNG_TRNS_LENGTHS.get(colour, 0):
            return None
        if zlib.crc32(memoryview(data)[at + 4 : end]) != int.from_bytes(data[end : end + 4]):
            return None
        at = end + 4
    return None


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
