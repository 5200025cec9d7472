"""A PNG's header (``vision.image_files.header``) sizes the file as Pillow reads it: over PNGs PIL
writes in every mode it reads, the matrix's, one whose eXIf chunk turns it, a transparent palette,
and a declared size above the limit."""

import io

import pytest
from PIL import Image

from epdserve.vision.image_files import TooLarge
from tests.header_answers import answer, through_pil
from tests.image_matrix import matrix

PIL_MODES = ["1", "L", "P", "RGB", "RGBA", "LA", "I;16"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png(mode: str, size=(37, 21), **options) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG", **options)
    return buffer.getvalue()


@pytest.mark.parametrize("mode", PIL_MODES)
def test_a_png_of_every_mode_is_sized_as_pil_sizes_it(mode):
    data = _png(mode, dpi=(72, 72))
    assert answer(data) == through_pil(data) == (37, 21, "PNG")


def test_the_matrix_pngs_are_sized_as_pil_sizes_them():
    pngs = {case: data for case, data in matrix().items() if data.startswith(PNG_SIGNATURE)}
    assert len(pngs) >= 5
    for case, data in pngs.items():
        assert answer(data) == through_pil(data), case


def test_an_exif_chunks_orientation_turns_the_size():
    exif = Image.Exif()
    exif[0x0112] = 6
    data = _png("RGB", exif=exif.tobytes())
    assert answer(data) == through_pil(data) == (21, 37, "PNG")


def test_a_transparent_palette_and_a_large_declared_size_answer_as_through_pil():
    palette = _png("P", transparency=0)
    assert answer(palette) == through_pil(palette) == (37, 21, "PNG")
    huge = _png("L", size=(8000, 8000))
    assert answer(huge, max_pixels=1 << 20) == through_pil(huge, max_pixels=1 << 20) == TooLarge
