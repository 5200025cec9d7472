"""An image file as vLLM's own media pipeline reads it, so that the encode worker's tower sees the
pixels vLLM's tower would (torch-free: the dispatcher sizes images with it). vLLM's rules
(``vllm.multimodal.media.image.ImageMediaIO.load_bytes``, 0.32): the first frame of the file;
the EXIF orientation applied (an unreadable EXIF block ignored); then RGB, where an image with
transparency (RGBA, LA, PA, or a ``transparency`` entry: a palette's or a PNG's tRNS) is
composited onto white, and any other mode converted as PIL converts it.

``header`` sizes an image from its header alone (the size as displayed: EXIF orientations 5-8
swap width and height), as PIL opens it (lazily: nothing decoded); ``to_rgb`` makes an opened image
what vLLM hands its processor. A plain WebP's header is read here without PIL (``webp_size``):
PIL's WebP open sets up libwebp's animation decoder and its canvas, so it costs with the pixel
count, ~100 us at 448x448 and 600-900 us at 1920x1080 against under 10 us here, where the 500 us a
gateway process has per image at 2,000 images/s must cover everything; a PNG's or a JPEG's open
costs 17-130 us (``epd-bench headers``, ``docs/results/headers.json``). Every other WebP goes
through PIL."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import struct
from typing import NamedTuple

from PIL import Image, ImageOps

from epdserve.vision.limits import IMAGE_FORMATS, MAX_SIDE

ORIENTATION_TAG = 0x0112  # EXIF Orientation
TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}  # turned by a quarter: width and height swap
BACKGROUND = (255, 255, 255)  # what vLLM composites transparent pixels onto
# An XMP packet: Pillow takes an orientation from it, as Image.getexif() finds it, when the EXIF
# block holds none (or there is none).
XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')
EXIF_PREFIX = b"Exif\x00\x00"  # a JPEG's EXIF block starts with it; a WebP's may
TIFF_ORDERS = {b"II*\x00": "<", b"MM\x00*": ">"}
TIFF_UNIT_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8}
TIFF_SHORT = 3
WEBP_RIFF, WEBP_FORM = b"RIFF", b"WEBP"
# The chunk sequences after the RIFF header that ``webp_size`` reads (libwebp's demuxer, which
# PIL's open runs, takes each): a lossy or a lossless bitstream alone, or an extended header
# (VP8X) with a colour profile, alpha or neither, then an EXIF chunk, an XMP chunk, both (in the
# container's order) or neither. Anything else (an animation, unknown chunks, another order)
# leaves the file to PIL.
WEBP_BITSTREAMS = (b"VP8 ", b"VP8L")
WEBP_EXIF, WEBP_XMP = b"EXIF", b"XMP "
WEBP_SIMPLE = ([b"VP8 "], [b"VP8L"])
WEBP_EXTENDED = [
    [b"VP8X", *profile, *image, *metadata]
    for profile in ([], [b"ICCP"])
    for image in ([b"VP8 "], [b"ALPH", b"VP8 "], [b"VP8L"])
    for metadata in ([], [WEBP_EXIF], [WEBP_XMP], [WEBP_EXIF, WEBP_XMP])
]
# VP8X's flags of the EXIF and XMP chunks: the demuxer hands PIL a chunk only when it is flagged.
WEBP_EXIF_FLAG, WEBP_XMP_FLAG = 0x08, 0x04
# VP8X's flags that leave the file to PIL: an animation's, and the bits no version defines (the
# alpha, colour-profile, EXIF and XMP flags say which chunks may follow; ``WEBP_EXTENDED`` says
# which do)
WEBP_FLAGS_TO_PIL = 0x02 | 0x01 | 0x40 | 0x80
VP8_START_CODE = b"\x9d\x01\x2a"
VP8_FRAME_HEADER = 10  # bytes: the frame tag, the start code, the width and the height
VP8L_SIGNATURE = 0x2F
VP8L_HEADER = 5  # bytes: the signature, then 14 + 14 bits of size, 1 of alpha, 3 of version
# The readers PIL tries before its WebP reader that check no signature first (``Image.ID`` order,
# Pillow 13): a WebP one of them takes opens as that format. ``_claimed_before_webp`` rules out
# the files IM, PCD and SPIDER may take; IMT, TGA and IPTC refuse a RIFF's first bytes.
WEBP_READ_AFTER = ("IM", "IMT", "IPTC", "PCD", "SPIDER", "TGA")


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
    webp = webp_size(data)
    limit = Image.MAX_IMAGE_PIXELS  # PIL's own (above it, PIL warns or refuses)
    if webp is not None and (limit is None or webp[0] * webp[1] <= limit):
        width, height, orientation = webp
        check_size(width, height, max_pixels)
        if orientation in TRANSPOSED_ORIENTATIONS:
            width, height = height, width
        return ImageHeader(width, height, "WEBP")
    with open_image(data, any_format) as image:
        width, height = image.size
        check_size(width, height, max_pixels)
        if _orientation(image) in TRANSPOSED_ORIENTATIONS:
            width, height = height, width
        return ImageHeader(width, height, image.format)


class _LeftToPil(Exception):
    """Something a plain header does not hold: PIL reads the file (and says what is wrong)."""


def _exif_orientation(tiff: bytes) -> int | None:
    """The orientation in an EXIF block's TIFF (after any "Exif\\0\\0"), as PIL's ``getexif`` reads
    it, when its first directory is whole (its entries and their out-of-line values within
    the block), of known types, with each tag once and the orientation one SHORT."""
    if not tiff:
        return None
    order = TIFF_ORDERS.get(tiff[:4])
    if order is None or len(tiff) < 8:
        raise _LeftToPil
    (directory,) = struct.unpack_from(order + "L", tiff, 4)
    if directory + 2 > len(tiff):
        raise _LeftToPil
    (count,) = struct.unpack_from(order + "H", tiff, directory)
    if directory + 2 + 12 * count > len(tiff):
        raise _LeftToPil
    tags, orientation = set(), None
    for entry in range(directory + 2, directory + 2 + 12 * count, 12):
        tag, kind, values, inline = struct.unpack_from(order + "HHL4s", tiff, entry)
        unit = TIFF_UNIT_BYTES.get(kind)
        if unit is None or tag in tags:
            raise _LeftToPil
        tags.add(tag)
        nbytes = unit * values
        if nbytes > 4 and struct.unpack(order + "L", inline)[0] + nbytes > len(tiff):
            raise _LeftToPil  # PIL stops reading the directory there
        if tag == ORIENTATION_TAG:
            if (kind, values) != (TIFF_SHORT, 1):
                raise _LeftToPil
            (orientation,) = struct.unpack_from(order + "H", inline)
    return orientation


def webp_size(data: bytes) -> tuple[int, int, int | None] | None:
    """A WebP's (width, height, orientation), read as libwebp's demuxer reads them for PIL's open,
    when the file is plain: one RIFF exactly as long as the file, its chunks back to back and
    whole (``WEBP_SIMPLE`` or ``WEBP_EXTENDED``), a bitstream header libwebp accepts
    (``_bitstream_size``) and, in an extended file, no ``WEBP_FLAGS_TO_PIL``, a canvas of the
    bitstream's size, and an orientation read as ``_webp_orientation`` reads it. Such a file holds
    one frame; None for every other file (PIL reads it)."""
    if len(data) < 20 or data[:4] != WEBP_RIFF or data[8:12] != WEBP_FORM:
        return None
    if int.from_bytes(data[4:8], "little") + 8 != len(data) or _claimed_before_webp(data):
        return None
    kinds, bodies, at, view = [], [], 12, memoryview(data)  # (bodies are views: not copied)
    while at < len(data):
        if at + 8 > len(data):
            return None
        length = int.from_bytes(data[at + 4 : at + 8], "little")
        end = at + 8 + length + (length & 1)  # (a chunk of odd length has a pad byte)
        if end > len(data):
            return None
        kinds.append(data[at : at + 4])
        bodies.append(view[at + 8 : at + 8 + length])
        at = end
    if kinds in WEBP_SIMPLE:
        size = _bitstream_size(kinds[0], bodies[0])
        return None if size is None else (*size, None)
    if kinds not in WEBP_EXTENDED:
        return None
    vp8x = bodies[0]
    if len(vp8x) != 10 or vp8x[0] & WEBP_FLAGS_TO_PIL:
        return None
    canvas = (int.from_bytes(vp8x[4:7], "little") + 1, int.from_bytes(vp8x[7:10], "little") + 1)
    image = next(at for at, kind in enumerate(kinds) if kind in WEBP_BITSTREAMS)
    size = _bitstream_size(kinds[image], bodies[image])
    if size != canvas:
        return None
    try:
        return (*size, _webp_orientation(vp8x[0], dict(zip(kinds, bodies))))
    except _LeftToPil:
        return None


def _webp_orientation(flags: int, chunks: dict[bytes, memoryview]) -> int | None:
    """The orientation PIL's ``getexif`` finds in a WebP: its EXIF chunk's (``_exif_orientation``;
    the chunk with or without the "Exif\\0\\0" a JPEG's block starts with, which PIL strips),
    else, when it holds none (or there is none), its XMP chunk's (``XMP_ORIENTATION``); each chunk
    only when VP8X flags it and it is not empty (what PIL's ``info`` then holds)."""
    exif = bytes(chunks.get(WEBP_EXIF, b"")) if flags & WEBP_EXIF_FLAG else b""
    xmp = bytes(chunks.get(WEBP_XMP, b"")) if flags & WEBP_XMP_FLAG else b""
    orientation = _exif_orientation(exif.removeprefix(EXIF_PREFIX))
    if orientation is None and xmp and (found := XMP_ORIENTATION.search(xmp)):
        orientation = int(found[2])
    return orientation


def _claimed_before_webp(data: bytes) -> bool:
    """Whether a reader PIL tries before its WebP reader (``WEBP_READ_AFTER``) may take the file:
    IM reads a text header (a first line within 100 bytes, with a key: a colon in it), PCD finds
    ``PCD_`` at 2048, SPIDER 27 floats that make its header in either byte order. (IMT reads a
    first line of a lower-case key and a space, which "RIFF" is not.)"""
    first_line_end = data.find(b"\n", 0, 100)
    if b":" in data[: max(0, first_line_end)] or data[2048:2052] == b"PCD_":
        return True
    if len(data) < 108:
        return False
    spider_header = _spider_header_check()
    return bool(
        spider_header(struct.unpack_from(">27f", data))
        or spider_header(struct.unpack_from("<27f", data))
    )


@functools.cache
def _spider_header_check():
    """PIL's own check of a SPIDER header, imported once every reader is registered as
    ``Image.open`` registers them (imported first, the SPIDER reader would be tried out of
    PIL's order)."""
    Image.preinit()
    Image.init()
    from PIL.SpiderImagePlugin import isSpiderHeader

    return isSpiderHeader


def _bitstream_size(kind: bytes, body: memoryview) -> tuple[int, int] | None:
    """A lossy (VP8) or lossless (VP8L) bitstream's size, when libwebp accepts its header
    (``VP8GetInfo``, ``VP8LGetInfo``): a shown key frame of profile 0-3 whose first partition is
    shorter than the chunk, with the start code and sides above 0; or the signature and version
    0."""
    if kind == b"VP8 ":
        if len(body) < VP8_FRAME_HEADER or body[3:6] != VP8_START_CODE:
            return None
        tag = int.from_bytes(body[:3], "little")
        key_frame, profile, shown = not tag & 1, tag >> 1 & 7, tag >> 4 & 1
        first_partition = tag >> 5  # its length
        if not key_frame or profile > 3 or not shown or first_partition >= len(body):
            return None
        width = int.from_bytes(body[6:8], "little") & 0x3FFF
        height = int.from_bytes(body[8:10], "little") & 0x3FFF
        return (width, height) if width and height else None
    if len(body) < VP8L_HEADER or body[0] != VP8L_SIGNATURE:
        return None
    bits = int.from_bytes(body[1:5], "little")
    if bits >> 29:  # the version
        return None
    return (bits & 0x3FFF) + 1, (bits >> 14 & 0x3FFF) + 1


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
