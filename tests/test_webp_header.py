"""A WebP's header read without PIL (``vision.image_files.webp_size``) sizes a file as PIL
(libwebp's demuxer) does, or leaves it to PIL: over WebPs PIL writes (lossy and lossless, with
alpha and a colour profile, with EXIF and XMP orientations), and over RIFF files built at random
(every chunk kind the demuxer knows and unknown ones, extended headers of any flags and canvas,
EXIF and XMP chunks, bitstream headers with each field right or wrong, wrong RIFF lengths, cut
anywhere), ``header`` answers exactly what reading every file through PIL answers."""

import io
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from epdserve.vision import image_files
from epdserve.vision.image_files import (
    WEBP_FORM,
    WEBP_READ_AFTER,
    WEBP_RIFF,
    FormatNotTaken,
    TooLarge,
    webp_size,
)
from tests.header_answers import answer, orientation_through_pil, through_pil
from tests.image_matrix import matrix
from tests.profiles import examples

PLAIN = [
    ("RGB", {}),
    ("L", {}),
    ("RGBA", {}),  # lossy with alpha: VP8X, ALPH, VP8
    ("RGB", {"lossless": True}),
    ("RGBA", {"lossless": True}),
    ("RGB", {"icc_profile": b"\0" * 301}),
    ("RGBA", {"icc_profile": b"\0" * 300}),
    ("RGBA", {"icc_profile": b"\0" * 300, "lossless": True}),
]


def _webp(mode: str, size=(37, 21), **options) -> bytes:
    buffer = io.BytesIO()
    colour = (255, 0, 0, 128) if mode == "RGBA" else "red"  # (an opaque one is written as RGB)
    Image.new(mode, size, colour).save(buffer, format="WEBP", **options)
    return buffer.getvalue()


def _riff(chunks: bytes, length_error: int = 0) -> bytes:
    return (
        WEBP_RIFF + struct.pack("<I", max(0, 4 + len(chunks) + length_error)) + WEBP_FORM + chunks
    )


def _chunk(kind: bytes, body: bytes, pad: bool = True) -> bytes:
    return kind + struct.pack("<I", len(body)) + body + (b"\0" if pad and len(body) & 1 else b"")


@pytest.mark.parametrize(("mode", "options"), PLAIN, ids=[str(case) for case in PLAIN])
def test_a_plain_webp_is_sized_without_pil(mode, options):
    data = _webp(mode, **options)
    assert webp_size(data) == (37, 21, None)
    assert answer(data) == through_pil(data) == (37, 21, "WEBP")


def _exif(orientation: int | None) -> bytes:
    """An EXIF block as PIL writes one ("Exif\\0\\0", then the TIFF), with a camera's tags."""
    exif = Image.Exif()
    exif[0x010F] = "maker"
    if orientation is not None:
        exif[0x0112] = orientation
    return exif.tobytes()


def _xmp(orientation: int) -> bytes:
    return b'<x:xmpmeta><rdf:Description tiff:Orientation="%d"/></x:xmpmeta>' % orientation


# A WebP's orientation: its EXIF chunk's, else its XMP chunk's; (EXIF, XMP, orientation)
METADATA = {
    "exif": (_exif(6), None, 6),  # (PIL writes the TIFF alone, as the container's specification)
    "exif-without-an-orientation": (_exif(None), None, None),
    "xmp": (None, _xmp(5), 5),
    "exif-without-one-then-xmp": (_exif(None), _xmp(7), 7),
    "exif-over-xmp": (_exif(3), _xmp(6), 3),
}


@pytest.mark.parametrize("case", sorted(METADATA))
@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_a_webps_exif_and_xmp_orientation_is_read_without_pil_as_pil_reads_it(case, mode):
    exif, xmp, orientation = METADATA[case]
    options = {"exif": exif} if exif is not None else {}
    data = _webp(mode, **options, **({"xmp": xmp} if xmp is not None else {}))
    assert webp_size(data) == (37, 21, orientation)
    assert answer(data) == through_pil(data)
    assert answer(data)[:2] == ((21, 37) if orientation in (5, 6, 7, 8) else (37, 21))


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, at = [], 12
    while at < len(data):
        (length,) = struct.unpack_from("<I", data, at + 4)
        chunks.append((data[at : at + 4], data[at + 8 : at + 8 + length]))
        at += 8 + length + (length & 1)
    return chunks


def test_an_exif_chunk_with_a_jpegs_prefix_is_read_as_pil_reads_it():
    """Some writers start a WebP's EXIF chunk with the "Exif\\0\\0" of a JPEG's block, which PIL
    strips (a second one too: that file is left to PIL)."""
    written = _chunks(_webp("RGB", exif=_exif(6)))
    assert [kind for kind, _ in written] == [b"VP8X", b"VP8 ", b"EXIF"]
    (_, exif), prefix = written[2], image_files.EXIF_PREFIX
    assert not exif.startswith(prefix)
    for body, read in ((prefix + exif, (37, 21, 6)), (prefix + prefix + exif, None)):
        data = _riff(b"".join(_chunk(kind, part) for kind, part in [*written[:2], (b"EXIF", body)]))
        assert webp_size(data) == read
        assert answer(data) == through_pil(data) == (21, 37, "WEBP")


def _exif_with_a_text_resolution(orientation: int) -> bytes:
    """A TIFF whose resolution unit sits beside an X resolution that is text, not one RATIONAL."""
    entries = [(0x0128, 3, 1, b"\2\0\0\0"), (0x011A, 2, 1, b"5\0\0\0")]
    entries.append((0x0112, 3, 1, struct.pack("<H", orientation) + b"\0\0"))
    directory = struct.pack("<H", len(entries)) + b"".join(
        struct.pack("<HHL", tag, kind, count) + value for tag, kind, count, value in entries
    )
    return b"II*\0" + struct.pack("<L", 8) + directory + bytes(4)


def test_an_exif_chunk_with_a_resolution_a_jpegs_open_refuses_is_read_as_pil_reads_it():
    """Such a resolution fails PIL's open of a JPEG (it reads a dpi from it); PIL's WebP open
    reads no dpi, and finds the orientation."""
    data = _webp("RGB", exif=_exif_with_a_text_resolution(6))
    assert webp_size(data) == (37, 21, 6)
    assert answer(data) == through_pil(data) == (21, 37, "WEBP")


@pytest.mark.parametrize("flag", [image_files.WEBP_EXIF_FLAG, image_files.WEBP_XMP_FLAG])
def test_an_exif_or_xmp_chunk_its_header_does_not_flag_holds_no_orientation(flag):
    """libwebp's demuxer hands PIL a metadata chunk only when VP8X flags it."""
    data = bytearray(_webp("RGB", exif=_exif(3), xmp=_xmp(6)))
    assert data[12:16] == b"VP8X" and data[20] & flag
    data[20] &= ~image_files.WEBP_EXIF_FLAG  # the EXIF chunk unflagged: the XMP's counts, if any
    data[20] &= ~flag
    assert webp_size(bytes(data)) == (37, 21, None if flag == image_files.WEBP_XMP_FLAG else 6)
    assert answer(bytes(data)) == through_pil(bytes(data))


@pytest.mark.parametrize("bit", range(8))
def test_each_extended_header_flag_answers_as_through_pil(bit):
    data = bytearray(_webp("RGBA"))  # VP8X (flags: alpha), ALPH, VP8
    assert data[12:16] == b"VP8X" and data[20] == 0x10
    data[20] |= 1 << bit
    assert answer(bytes(data)) == through_pil(bytes(data))


def test_the_matrix_webps_are_sized_as_pil_sizes_them():
    webps = {case: data for case, data in matrix().items() if data[8:12] == WEBP_FORM}
    assert len(webps) >= 2
    for case, data in webps.items():
        assert webp_size(data) is not None, case
        assert answer(data) == through_pil(data), case


def _lossy(extra: bytes) -> bytes:
    """A lossy bitstream of 37x21 whose compressed data is ``extra``."""
    return b"\x10\x00\x00\x9d\x01\x2a" + struct.pack("<HH", 37, 21) + extra


def _with_floats(body: bytearray, at: dict[int, float]) -> bytes:
    """``body`` (a chunk's, at file offset 20) with big-endian floats at these file offsets."""
    for offset, value in at.items():
        body[offset - 20 : offset - 16] = struct.pack(">f", value)
    return bytes(body)


# WebPs that a reader PIL tries first (one that checks no signature) takes (found by a review)
CLAIMED_FIRST = {
    "IM": _riff(_chunk(b"VP8 ", _lossy(b": x\nImage type: L\nImage size (x*y): 5*7\n\x1a"))),
    "PCD": _riff(_chunk(b"VP8 ", _lossy(bytes(2018) + b"PCD_" + bytes(1600)))),
    "SPIDER": _riff(
        _chunk(
            b"VP8L",
            _with_floats(
                bytearray(b"\x2f" + struct.pack("<I", 36 | 20 << 14) + bytes(32826)),
                {44: 1.0, 48: 1.0, 84: 4.0, 88: 4.0},
            ),
        )
    ),
}


def test_the_readers_pil_tries_before_its_webp_reader_without_a_signature_are_ruled_out():
    Image.init()
    before = _readers_before_webp()
    assert set(before) <= set(WEBP_READ_AFTER), before
    for name, data in CLAIMED_FIRST.items():
        assert webp_size(data) is None, name
        assert answer(data) == through_pil(data), name
        assert answer(data) == FormatNotTaken, name  # read as another format


def _readers_before_webp() -> list[str]:
    """The readers ``Image.open`` tries before the WebP one that take any file to look at."""
    ids = Image.ID[: Image.ID.index("WEBP")]
    return [name for name in ids if Image.OPEN[name][1] is None]


def test_an_animation_and_a_large_declared_size_answer_as_through_pil():
    frames = [Image.new("RGB", (20, 10), colour) for colour in ("red", "blue")]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="WEBP", save_all=True, append_images=frames[1:])
    animation = buffer.getvalue()
    assert webp_size(animation) is None
    assert answer(animation) == through_pil(animation) == (20, 10, "WEBP")
    huge = _webp("RGB", size=(8000, 8000))
    refused = answer(huge, max_pixels=1 << 20)
    assert webp_size(huge) == (8000, 8000, None)
    assert refused == through_pil(huge, max_pixels=1 << 20) == TooLarge


# Each random file is plain, or has one thing wrong (so that every fault is met often with the
# rest of the file right, where only that fault decides the answer).
FAULTS = [
    *["none"] * 12,
    *("riff_length", "cut", "more", "no_pad", "chunk_added", "chunk_taken"),
    *("flags", "reserved", "canvas", "vp8x_longer"),
    *("inter_frame", "profile", "hidden", "partition", "start_code", "zero_side", "vp8_short"),
    *("vp8l_signature", "vp8l_version", "vp8l_short"),
]
_SIDES = st.sampled_from([1, 2, 37, 640, 16383])
_KINDS = st.sampled_from(
    [b"ICCP", b"ALPH", b"EXIF", b"XMP ", b"ANIM", b"ANMF", b"VP8X", b"VP8 ", b"VP8L", b"zzzz"]
)
_LAYOUTS = st.sampled_from(
    [[b"VP8 "], [b"VP8L"], [b"VP8X", b"VP8 "], [b"VP8X", b"VP8L"], [b"VP8X", b"ICCP", b"VP8L"]]
    + [[b"VP8X", b"ALPH", b"VP8 "], [b"VP8X", b"ICCP", b"ALPH", b"VP8 "]]
    + [[b"VP8X", b"ALPH", b"VP8L"]]  # (refused: a lossless bitstream holds its own alpha)
    + [[b"VP8X", b"VP8 ", b"EXIF"], [b"VP8X", b"VP8L", b"XMP "]]
    + [[b"VP8X", b"ICCP", b"ALPH", b"VP8 ", b"EXIF", b"XMP "], [b"VP8X", b"VP8L", b"XMP ", b"EXIF"]]
)
_EXIF_BODIES = st.sampled_from(
    [_exif(6), _exif(6)[6:], _exif(2), _exif(None), b"Exif\0\0", b"", b"II*\0junk", _exif(6)[:20]]
    + [b"Exif\0\0" + _exif(5), _exif(7).replace(b"\x12\x01\x03\x00", b"\x12\x01\x04\x00")]
    + [_exif_with_a_text_resolution(8)]
)
_XMP_BODIES = st.sampled_from([_xmp(6), _xmp(1), b"", b"tiff:Orientation=6", b"\xff\xfe"])


def _vp8(draw, fault: str, width: int, height: int) -> bytes:
    extra = draw(st.binary(max_size=24))
    tag = (fault == "inter_frame") | draw(st.integers(0, 3)) << 1 | (fault != "hidden") << 4
    if fault == "profile":
        tag |= draw(st.integers(4, 7)) << 1
    partition = draw(st.integers(0, len(extra) + 9))  # (the body is 10 + len(extra) bytes)
    if fault == "partition":
        partition = draw(st.integers(len(extra) + 10, len(extra) + 40))
    start_code = b"\x9d\x01\x2a"
    if fault == "start_code":
        start_code = draw(st.binary(min_size=3, max_size=3).filter(lambda code: code != start_code))
    if fault == "zero_side":
        width, height = draw(st.sampled_from([(0, height), (width, 0), (0x4000, height)]))
    scales = draw(st.integers(0, 3)) << 14, draw(st.integers(0, 3)) << 14  # (libwebp ignores them)
    body = struct.pack("<I", tag | partition << 5)[:3] + start_code
    body += struct.pack("<HH", width | scales[0], height | scales[1]) + extra
    return body[: draw(st.integers(0, 9))] if fault == "vp8_short" else body


def _vp8l(draw, fault: str, width: int, height: int) -> bytes:
    signature = 0x2F
    if fault == "vp8l_signature":
        signature = draw(st.integers(0, 255).filter(lambda byte: byte != 0x2F))
    version = draw(st.integers(1, 7)) if fault == "vp8l_version" else 0
    bits = width - 1 | (height - 1) << 14 | draw(st.integers(0, 1)) << 28 | version << 29
    body = bytes([signature]) + struct.pack("<I", bits) + draw(st.binary(max_size=16))
    return body[: draw(st.integers(0, 4))] if fault == "vp8l_short" else body


def _vp8x(draw, fault: str, width: int, height: int) -> bytes:
    flags = draw(st.sampled_from([0, 0x10, 0x20, 0x30])) | draw(st.sampled_from([0, 4, 8, 12]))
    if fault == "flags":
        flags |= draw(st.sampled_from([0x01, 0x02, 0x04, 0x08, 0x40, 0x80]))
    reserved = b"\0\0\0"
    if fault == "reserved":
        reserved = draw(st.binary(min_size=3, max_size=3))
    if fault == "canvas":
        width, height = draw(
            st.tuples(_SIDES, _SIDES).filter(lambda canvas: canvas != (width, height))
        )
    body = bytes([flags]) + reserved
    body += (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return body + (draw(st.binary(min_size=1, max_size=3)) if fault == "vp8x_longer" else b"")


@st.composite
def _webp_file(draw) -> bytes:
    fault = draw(st.sampled_from(FAULTS))
    width, height = draw(_SIDES), draw(_SIDES)
    kinds = draw(_LAYOUTS)
    if fault == "chunk_added":
        at = draw(st.integers(0, len(kinds)))
        kinds = kinds[:at] + [draw(_KINDS)] + kinds[at:]
    elif fault == "chunk_taken":
        at = draw(st.integers(0, len(kinds) - 1))
        kinds = kinds[:at] + kinds[at + 1 :]
    chunks = b""
    for kind in kinds:
        if kind == b"VP8X":
            body = _vp8x(draw, fault, width, height)
        elif kind == b"VP8 ":
            body = _vp8(draw, fault, width, height)
        elif kind == b"VP8L":
            body = _vp8l(draw, fault, width, height)
        elif kind == b"EXIF":
            body = draw(_EXIF_BODIES)
        elif kind == b"XMP ":
            body = draw(_XMP_BODIES)
        else:
            body = draw(st.binary(max_size=20))
        chunks += _chunk(kind, body, pad=fault != "no_pad")
    length_error = draw(st.sampled_from([-9, -2, -1, 1, 2, 8])) if fault == "riff_length" else 0
    data = _riff(chunks, length_error)
    if fault == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif fault == "more":
        data += draw(st.binary(min_size=1, max_size=9))
    return data


@settings(max_examples=examples(2000), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=_webp_file())
def test_any_riff_file_answers_as_through_pil(data):
    sized = answer(data, max_pixels=1 << 26)
    assert sized == through_pil(data, max_pixels=1 << 26)
    # a file sized without PIL has PIL's orientation (one of 1-4 shows in no size)
    if (read := webp_size(data)) is not None and isinstance(sized, tuple):
        assert read[2] == orientation_through_pil(data)
