"""An image file as vLLM's own media pipeline reads it, so that the encode worker's tower sees the
pixels vLLM's tower would (torch-free: the dispatcher sizes images with it). vLLM's rules
(``vllm.multimodal.media.image.ImageMediaIO.load_bytes``, 0.32): the first frame of the file;
the EXIF orientation applied (an unreadable EXIF block ignored); then RGB, where an image with
transparency (RGBA, LA, PA, or a ``transparency`` entry: a palette's or a PNG's tRNS) is
composited onto white, and any other mode converted as PIL converts it.

``header`` sizes an image from its header alone (the size as displayed: EXIF orientations 5-8
swap width and height); ``decode_rgb`` decodes it by the same rules. A plain PNG's, JPEG's or
WebP's header is read here without PIL (``png_size``, ``jpeg_size``, ``webp_size``: the dispatcher
and every worker's intake read one per image, and PIL's open costs ~9 us of it for a PNG, ~18 for a
JPEG, 43-78 for a WebP); every other file, and every one these readers find anything unusual in,
goes through PIL."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import struct
import zlib
from typing import NamedTuple

from PIL import Image, ImageOps

from epdserve.vision.limits import IMAGE_FORMATS, MAX_SIDE

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
JPEG_SIGNATURE = b"\xff\xd8\xff"
JPEG_SOS = 0xDA  # start of scan: the header ends
# The frame markers PIL sizes an image by (``JpegImagePlugin.MARKER``'s SOF handlers, less DHP).
JPEG_FRAMES = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
JPEG_PASSED = {0xC4, 0xCC, 0xDD, 0xFE}  # DHT, DAC, DRI, COM: PIL stores or skips them
JPEG_LAYERS = {1, 3, 4}  # the component counts PIL reads (L, RGB, CMYK)
# A Photoshop block (APP13: its image resources, "8BIM" each), which PIL parses into
# ``info["photoshop"]``: read as PIL reads it (``_check_photoshop``), whose parse can fail the open.
PHOTOSHOP_PREFIX, PHOTOSHOP_RESOURCE = b"Photoshop 3.0\x00", b"8BIM"
PHOTOSHOP_RESOLUTION, PHOTOSHOP_RESOLUTION_BYTES = 0x03ED, 14  # what PIL unpacks of it
# An MP index (APP2, CIPA DC-007): a file with more than one image in it is PIL's MPO, but a gain
# map JPEG (Ultra HDR: an APP1 names its gain map) stays a JPEG. Read as PIL reads it when plain
# (``_mp_images``): the MP tags PIL knows, of their types, each once, within the index.
MPF_PREFIX = b"MPF\x00"
ULTRA_HDR_MARK = b' hdrgm:Version="'
MP_NUMBER_OF_IMAGES, MP_ENTRY = 0xB001, 0xB002
MP_TAGS = {0xB000: (7, 4), MP_NUMBER_OF_IMAGES: (4, 1), MP_ENTRY: (7, None), 0xB004: (4, 1)}
MP_ENTRY_BYTES = 16
# An XMP packet (APP1): PIL keeps the last one's bytes after the prefix, and takes an orientation
# from them, as Image.getexif() finds it, when the EXIF block holds none (or there is none).
XMP_PREFIX = b"http://ns.adobe.com/xap/1.0/\x00"
XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')
# By APPn marker: a payload prefix, and the least payload PIL reads after it without an error.
JPEG_APP_LENGTHS = {0xE0: (b"JFIF", 7), 0xE2: (b"ICC_PROFILE\x00", 14), 0xEE: (b"Adobe", 7)}
EXIF_PREFIX = b"Exif\x00\x00"
TIFF_ORDERS = {b"II*\x00": "<", b"MM\x00*": ">"}
TIFF_UNIT_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8}
TIFF_SHORT, TIFF_RATIONAL = 3, 5
X_RESOLUTION_TAG, RESOLUTION_UNIT_TAG = 0x011A, 0x0128  # what PIL's JPEG open reads a dpi from
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
    plain = _read_without_pil(data)
    if plain is not None:
        width, height, orientation, image_format = plain
        check_size(width, height, max_pixels)
        if orientation in TRANSPOSED_ORIENTATIONS:
            width, height = height, width
        return ImageHeader(width, height, image_format)
    with open_image(data, any_format) as image:
        width, height = image.size
        check_size(width, height, max_pixels)
        if _orientation(image) in TRANSPOSED_ORIENTATIONS:
            width, height = height, width
        return ImageHeader(width, height, image.format)


def _read_without_pil(data: bytes) -> tuple[int, int, int | None, str] | None:
    """A plain file's (width, height, EXIF orientation, format) from the PIL-free readers, when
    PIL would open it without a word (within its ``MAX_IMAGE_PIXELS``); None: PIL reads it."""
    if (size := png_size(data)) is not None:
        width, height, orientation, image_format = *size, None, "PNG"
    elif (jpeg := jpeg_size(data)) is not None:
        width, height, orientation, image_format = jpeg
    elif (webp := webp_size(data)) is not None:
        width, height, orientation, image_format = *webp, "WEBP"
    else:
        return None
    limit = Image.MAX_IMAGE_PIXELS  # PIL's own (above it, PIL warns or refuses)
    if limit is not None and width * height > limit:
        return None
    return width, height, orientation, image_format


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
            if (depth, colour) not in PNG_MODES or filtering or not width or not height:
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


class _LeftToPil(Exception):
    """Something a plain header does not hold: PIL reads the file (and says what is wrong)."""


def jpeg_size(data: bytes) -> tuple[int, int, int | None, str] | None:
    """A JPEG's (width, height, EXIF orientation, format: JPEG or MPO), read as PIL reads them,
    when its header is plain: markers back to back from the signature to the start of scan, each
    whole, of the kinds PIL passes over or reads without an error (``JPEG_FRAMES``,
    ``JPEG_PASSED``, quantization tables, APPn), a Photoshop block PIL parses without an error
    (``_check_photoshop``), at least one 8-bit frame of a layer count PIL reads, and an EXIF block
    whose first directory is whole (``_exif_orientation``); the orientation as PIL finds it in the
    EXIF block and the last XMP packet (``_pil_orientation``); and an MP index read as
    ``_mp_images`` reads it. None for every other file (PIL reads it)."""
    if not data.startswith(JPEG_SIGNATURE):
        return None
    try:
        size, exif, xmp, mp_index, ultra_hdr, at = None, None, None, None, False, 2
        while True:
            if at + 4 > len(data) or data[at] != 0xFF:
                return None
            marker, length = data[at + 1], int.from_bytes(data[at + 2 : at + 4])
            body = data[at + 4 : at + 2 + length]
            if length < 2 or len(body) != length - 2:
                return None
            if marker == JPEG_SOS:
                break
            if marker in JPEG_FRAMES:
                if len(body) < 6 or (len(body) - 6) % 3 or body[0] != 8:
                    return None  # (PIL reads the components after the 6 bytes 3 at a time)
                if body[5] not in JPEG_LAYERS:
                    return None
                size = (int.from_bytes(body[3:5]), int.from_bytes(body[1:3]))
            elif marker == 0xDB:
                _check_quantization(body)
            elif 0xE0 <= marker <= 0xEF:
                if marker == 0xED and body.startswith(PHOTOSHOP_PREFIX):
                    _check_photoshop(body)
                prefix, least = JPEG_APP_LENGTHS.get(marker, (b"", 0))
                if len(body) < least and body.startswith(prefix):
                    return None
                if marker == 0xE1 and body.startswith(EXIF_PREFIX):
                    if exif is not None:
                        return None
                    exif = body
                elif marker == 0xE1 and body.startswith(XMP_PREFIX):
                    xmp = body[len(XMP_PREFIX) :]
                elif marker == 0xE2 and body.startswith(MPF_PREFIX):
                    if mp_index is not None:
                        return None
                    mp_index = body[len(MPF_PREFIX) :]
                ultra_hdr = ultra_hdr or (marker == 0xE1 and ULTRA_HDR_MARK in body)
            elif marker not in JPEG_PASSED:
                return None
            at += 2 + length
        if size is None or not size[0] or not size[1]:
            return None
        orientation = _pil_orientation(exif, xmp)
        several = mp_index is not None and _mp_images(mp_index) > 1 and not ultra_hdr
        return (*size, orientation, "MPO" if several else "JPEG")
    except _LeftToPil:
        return None


def _check_photoshop(block: bytes) -> None:
    """``_LeftToPil`` when PIL's parse of a Photoshop block would fail the open. PIL walks its
    resources (each "8BIM", a 2-byte code, a name's length and name padded to even, a 4-byte size
    and data padded to even) until one is not a resource, or until one is cut short, where its
    unpacking raises ``struct.error``, which it catches: so does a resolution resource (0x03ED)
    of less than 14 bytes. A resource that ends right after its code makes it read the name's
    length past the end: an ``IndexError``, which fails the open."""
    at = len(PHOTOSHOP_PREFIX)
    while block[at : at + 4] == PHOTOSHOP_RESOURCE:
        code = block[at + 4 : at + 6]
        at += 6
        if at > len(block):  # the code cut short: PIL stops here
            return
        if at == len(block):
            raise _LeftToPil
        at += 1 + block[at]
        at += at & 1
        if at + 4 > len(block):  # the size cut short
            return
        size = int.from_bytes(block[at : at + 4])
        at += 4
        short = min(size, len(block) - at) < PHOTOSHOP_RESOLUTION_BYTES  # (its data, if cut)
        if int.from_bytes(code) == PHOTOSHOP_RESOLUTION and short:
            return
        at += size
        at += at & 1


def _mp_images(index: bytes) -> int:
    """The number of images an MP index names, as PIL's ``_getmp`` reads it, when the index is
    plain: a classic TIFF header, its first directory whole and followed by the next one's offset,
    of the tags ``MP_TAGS`` only (each once, of its type and count, its value within the index),
    the number of images and as many whole entries, each of a JPEG image."""
    order = TIFF_ORDERS.get(index[:4])
    if order is None or len(index) < 8:
        raise _LeftToPil
    (directory,) = struct.unpack_from(order + "L", index, 4)
    if directory < 8 or directory + 2 > len(index):
        raise _LeftToPil
    (count,) = struct.unpack_from(order + "H", index, directory)
    if directory + 2 + 12 * count + 4 > len(index):
        raise _LeftToPil
    values, out_of_line = {}, 0
    for entry in range(directory + 2, directory + 2 + 12 * count, 12):
        tag, kind, items, inline = struct.unpack_from(order + "HHL4s", index, entry)
        expected = MP_TAGS.get(tag)
        if expected is None or tag in values or kind != expected[0] or not items:
            raise _LeftToPil
        if expected[1] is not None and items != expected[1]:
            raise _LeftToPil
        nbytes = items * TIFF_UNIT_BYTES[kind]
        if nbytes <= 4:
            values[tag] = inline[:nbytes]
            continue
        (offset,) = struct.unpack(order + "L", inline)
        out_of_line += nbytes
        if offset + nbytes > len(index) or out_of_line > len(index):
            raise _LeftToPil
        values[tag] = index[offset : offset + nbytes]
    if MP_NUMBER_OF_IMAGES not in values or MP_ENTRY not in values:
        raise _LeftToPil
    (images,) = struct.unpack(order + "L", values[MP_NUMBER_OF_IMAGES])
    entries = values[MP_ENTRY]
    if MP_ENTRY_BYTES * images > len(entries):
        raise _LeftToPil
    for at in range(0, MP_ENTRY_BYTES * images, MP_ENTRY_BYTES):
        (attribute,) = struct.unpack_from(order + "L", entries, at)
        if (attribute >> 24) & 7:  # not a JPEG image: PIL reads the file as a JPEG, and warns
            raise _LeftToPil
    return images


def _check_quantization(body: bytes) -> None:
    """A DQT's tables, each whole (PIL refuses the file otherwise)."""
    while body:
        table = 1 + (64 if body[0] < 16 else 128)
        if len(body) < table:
            raise _LeftToPil
        body = body[table:]


def _exif_orientation(segment: bytes) -> int | None:
    """The orientation in an EXIF block's first directory, as PIL reads it, when that directory
    is whole (its entries and their out-of-line values within the block), of known types, with
    each tag once and the orientation one SHORT; and when the dpi PIL's open reads from it (a
    resolution unit and an X resolution) is one RATIONAL."""
    tiff = segment[len(EXIF_PREFIX) :]
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
    types, orientation = {}, None
    for entry in range(directory + 2, directory + 2 + 12 * count, 12):
        tag, kind, values, inline = struct.unpack_from(order + "HHL4s", tiff, entry)
        unit = TIFF_UNIT_BYTES.get(kind)
        if unit is None or tag in types:
            raise _LeftToPil
        types[tag] = (kind, values)
        nbytes = unit * values
        if nbytes > 4 and struct.unpack(order + "L", inline)[0] + nbytes > len(tiff):
            raise _LeftToPil  # PIL stops reading the directory there
        if tag == ORIENTATION_TAG:
            if (kind, values) != (TIFF_SHORT, 1):
                raise _LeftToPil
            (orientation,) = struct.unpack_from(order + "H", inline)
    one_rational = (TIFF_RATIONAL, 1)
    if RESOLUTION_UNIT_TAG in types and types.get(X_RESOLUTION_TAG, one_rational) != one_rational:
        raise _LeftToPil
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
    """The orientation PIL finds in a WebP: its EXIF chunk's, read as ``_exif_orientation`` reads
    a JPEG's (with or without the "Exif\\0\\0" a JPEG's block starts with, which PIL strips), else
    its XMP chunk's (``XMP_ORIENTATION``), each only when VP8X flags it and it is not empty (what
    PIL's ``info`` then holds)."""
    exif = bytes(chunks.get(WEBP_EXIF, b"")) if flags & WEBP_EXIF_FLAG else b""
    xmp = bytes(chunks.get(WEBP_XMP, b"")) if flags & WEBP_XMP_FLAG else b""
    if exif and not exif.startswith(EXIF_PREFIX):  # the TIFF alone, as the container has it
        exif = EXIF_PREFIX + exif
    return _pil_orientation(exif, xmp)


def _pil_orientation(exif: bytes | None, xmp: bytes | None) -> int | None:
    """The orientation as PIL's ``getexif`` finds it: the EXIF block's (``_exif_orientation``, the
    block with its "Exif\\0\\0"), else, when it holds none (or there is none), the XMP packet's
    (``XMP_ORIENTATION``)."""
    orientation = _exif_orientation(exif) if exif else None
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
