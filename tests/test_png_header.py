"""A PNG's header read without PIL (``vision.image_files.png_size``) sizes a file as PIL does, or
leaves it to PIL: over PNGs PIL writes in every mode it reads, and over chunk sequences built at
random (any IHDR fields, known and unknown chunks, right and wrong CRCs, cut anywhere),
``header`` answers exactly what reading every file through PIL answers."""

import io
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from epdserve.vision import image_files
from epdserve.vision.image_files import PNG_SIGNATURE, png_size
from tests.header_answers import answer, through_pil
from tests.image_matrix import matrix

PIL_MODES = ["1", "L", "P", "RGB", "RGBA", "LA", "I;16"]


def _png(mode: str, size=(37, 21), **options) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG", **options)
    return buffer.getvalue()


def _chunk(kind: bytes, body: bytes, crc_right: bool = True) -> bytes:
    crc = zlib.crc32(kind + body) ^ (0 if crc_right else 1)
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


@pytest.mark.parametrize("mode", PIL_MODES)
def test_a_plain_png_of_every_mode_is_sized_without_pil(mode):
    data = _png(mode, dpi=(72, 72))
    assert png_size(data) == (37, 21)
    assert answer(data) == through_pil(data) == (37, 21, "PNG")


def test_the_matrix_pngs_are_sized_as_pil_sizes_them_and_exif_ones_go_to_pil():
    pngs = {case: data for case, data in matrix().items() if data.startswith(PNG_SIGNATURE)}
    assert len(pngs) >= 5
    for case, data in pngs.items():
        assert answer(data) == through_pil(data), case
        with Image.open(io.BytesIO(data)) as image:
            oriented = "exif" in image.info
        assert (png_size(data) is None) == oriented, case


def test_a_transparent_palette_and_a_large_declared_size_answer_as_through_pil():
    palette = _png("P", transparency=0)
    assert png_size(palette) is not None and answer(palette) == through_pil(palette)
    huge = _png("L", size=(8000, 8000))
    refused = answer(huge, max_pixels=1 << 20)
    assert refused == through_pil(huge, max_pixels=1 << 20)
    assert refused[0] is image_files.TooLarge


# Biased towards files the fast path reads, so that both paths are compared often.
_MOSTLY_RIGHT = st.sampled_from([True, True, True, False])
_KINDS = st.sampled_from(
    [b"PLTE", b"tRNS", b"gAMA", b"cHRM", b"sRGB", b"pHYs"] * 3 + [b"eXIf", b"tEXt", b"zzZz"]
)
_CHUNKS = st.lists(st.tuples(_KINDS, st.binary(max_size=40), _MOSTLY_RIGHT), max_size=3)
_MODES = st.one_of(
    st.sampled_from(sorted(image_files.PNG_MODES)),
    st.tuples(st.sampled_from([1, 2, 4, 8, 16, 3]), st.sampled_from([0, 2, 3, 4, 6, 5])),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    width=st.sampled_from([0, 1, 33, 640, 1000, 9000, 2**31 + 5]),
    height=st.sampled_from([0, 2, 17, 480, 20000]),
    mode=_MODES,
    tail=st.one_of(st.just(b"\0\0\0"), st.binary(min_size=3, max_size=3)),
    ihdr_crc_right=_MOSTLY_RIGHT,
    chunks=_CHUNKS,
    cut=st.one_of(st.none(), st.none(), st.integers(min_value=0, max_value=300)),
)
def test_any_chunk_sequence_answers_as_through_pil(
    width, height, mode, tail, ihdr_crc_right, chunks, cut
):
    ihdr = struct.pack(">IIBB", width, height, *mode) + tail
    data = PNG_SIGNATURE + _chunk(b"IHDR", ihdr, ihdr_crc_right)
    for kind, body, crc_right in chunks:
        data += _chunk(kind, body, crc_right)
    data += _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b"")
    if cut is not None:
        data = data[:cut]
    assert answer(data, max_pixels=1 << 26) == through_pil(data, max_pixels=1 << 26)
