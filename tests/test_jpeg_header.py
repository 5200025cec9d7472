"""A JPEG's header (``vision.image_files.header``) sizes the file as Pillow reads it: over JPEGs PIL
writes (every mode it reads, EXIF orientations, colour profiles, progressive, comments), XMP
orientations, MPOs and gain maps, and files with what Pillow reads in its own way: two EXIF or MP
blocks, unusual EXIF directories and MP indexes, frames and markers, Photoshop blocks cut
anywhere."""

import io
import struct

import pytest
from PIL import Image

from epdserve.vision.image_files import TooLarge
from tests.header_answers import ORIENTATION, answer, through_pil
from tests.image_matrix import matrix

JPEG_SIGNATURE = b"\xff\xd8\xff"
XMP_PREFIX = b"http://ns.adobe.com/xap/1.0/\x00"  # an APP1 holding an XMP packet
PHOTOSHOP_PREFIX = b"Photoshop 3.0\x00"  # an APP13 holding Photoshop's image resources


def _jpeg(mode: str = "RGB", size=(37, 21), **options) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, "white" if mode != "CMYK" else (0, 0, 0, 0)).save(
        buffer, format="JPEG", **options
    )
    return buffer.getvalue()


def _exif(orientation: int | None = None, **tags) -> bytes:
    exif = Image.Exif()
    if orientation is not None:
        exif[ORIENTATION] = orientation
    for tag, value in tags.items():
        exif[int(tag, 16)] = value
    return exif.tobytes()


def _tiff(order: str, entries, directory: int = 8, declared_delta: int = 0, tail=b"\0\0\0\0"):
    """An EXIF block: its TIFF header, a first directory of ``entries`` (tag, type, count and 4
    bytes: raw, or a number written in the block's byte order), then ``tail``."""
    head = {"<": b"II*\0", ">": b"MM\0*"}[order]
    table = struct.pack(order + "H", (len(entries) + declared_delta) % 65536)
    for tag, kind, count, value in entries:
        if isinstance(value, tuple):
            value = struct.pack(order + value[0], value[1]).ljust(4, b"\0")
        table += struct.pack(order + "HHL", tag, kind, count) + value
    return b"Exif\0\0" + head + struct.pack(order + "L", directory) + table + tail


def _segment(marker: int, body: bytes, length_delta: int = 0) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", max(0, len(body) + 2 + length_delta)) + body


def _frame(bits: int, layers: int, width: int, height: int) -> bytes:
    return struct.pack(">BHHB", bits, height, width, layers) + bytes(3 * min(layers, 4))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"progressive": True},
        {"dpi": (300, 300)},
        {"comment": b"a camera"},
        {"icc_profile": b"\0" * 3000},
        {"exif": _exif(6)},
        {"exif": _exif(8, **{"0x011a": 72.0, "0x0128": 2}), "icc_profile": b"p" * 40},
        {"exif": _exif(None, **{"0x010f": "maker"})},
    ],
    ids=["plain", "progressive", "dpi", "comment", "icc", "exif-6", "exif-8-dpi-icc", "exif-make"],
)
@pytest.mark.parametrize("mode", ["L", "RGB", "CMYK"])
def test_jpegs_pil_writes_are_sized_as_pil_sizes_them(mode, options):
    data = _jpeg(mode, **options)
    assert answer(data) == through_pil(data)
    swapped = options.get("exif") in (_exif(6), _exif(8, **{"0x011a": 72.0, "0x0128": 2}))
    assert answer(data)[:2] == ((21, 37) if swapped else (37, 21))


def test_the_matrix_jpegs_are_sized_as_pil_sizes_them():
    jpegs = {case: data for case, data in matrix().items() if data.startswith(JPEG_SIGNATURE)}
    assert len(jpegs) >= 10
    for case, data in jpegs.items():
        assert answer(data) == through_pil(data), case


# By case: the XMP packet, the EXIF block beside it (or None), the size header() answers.
XMP_CASES = {
    "attribute": (
        b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>',
        None,
        (21, 37),
    ),
    "element": (b"<rdf:Description><tiff:Orientation>8</tiff:Orientation>", None, (21, 37)),
    "single-quoted": (b"<x tiff:Orientation='6'/>", None, (37, 21)),  # PIL's pattern: =" or >
    "upright": (b'<x tiff:Orientation="1"/>', None, (37, 21)),
    "not-a-digit": (b'<x tiff:Orientation="x6"/>', None, (37, 21)),
    "none-named": (b"<x:xmpmeta/>", None, (37, 21)),
    "exif-holds-one": (b'<x tiff:Orientation="6"/>', _exif(1), (37, 21)),  # the EXIF block's
    "exif-holds-none": (b'<x tiff:Orientation="6"/>', _exif(None, **{"0x010f": "m"}), (21, 37)),
}


@pytest.mark.parametrize("case", sorted(XMP_CASES))
def test_an_xmp_packets_orientation_is_read_as_pil_finds_it(case):
    packet, exif, size = XMP_CASES[case]
    data = _jpeg(xmp=packet, **({"exif": exif} if exif is not None else {}))
    assert answer(data) == through_pil(data) == (*size, "JPEG")


def test_of_two_xmp_packets_the_last_one_counts_as_for_pil():
    data = _with_segments(
        _segment(0xE1, XMP_PREFIX + b'<x tiff:Orientation="1"/>'),
        _segment(0xE1, XMP_PREFIX + b'<x tiff:Orientation="6"/>'),
    )
    inside = _with_app1(XMP_PREFIX + b'a\0<x tiff:Orientation="6"/>')  # PIL cuts at the first NUL
    for one, size in ((data, (21, 37)), (inside, (21, 37))):
        assert answer(one) == through_pil(one) == (*size, "JPEG")


def _mp_index(
    order: str = "<",
    entries: int = 2,
    images: int = 2,
    image_format: int = 0,
    extra: tuple = (),
    next_offset: bool = True,
    version: bool = True,
    entry_type: int = 7,
    images_type: int = 4,
) -> bytes:
    """An APP2 MP index (CIPA DC-007): its TIFF header, one directory (the version, the number of
    images, the entries, ``extra`` tags), the next directory's offset, then the entries."""
    table = [(0xB000, 7, 4, b"0100")] if version else []
    table.append((0xB001, images_type, 1, struct.pack(order + "L", images)))
    rows = b"".join(
        struct.pack(order + "LLLHH", image_format << 24 | 0x030000, 1000, 0, 0, 0)
        for _ in range(entries)
    )
    count = len(table) + 1 + len(extra)
    after = 8 + 2 + 12 * count + 4 * next_offset
    table.append((0xB002, entry_type, len(rows), struct.pack(order + "L", after)))
    table += extra
    head = {"<": b"II*\0", ">": b"MM\0*"}[order] + struct.pack(order + "L", 8)
    body = struct.pack(order + "H", count) + b"".join(
        struct.pack(order + "HHL", tag, kind, items) + value for tag, kind, items, value in table
    )
    return b"MPF\0" + head + body + b"\0\0\0\0" * next_offset + rows


def _with_segments(*segments: bytes) -> bytes:
    """A plain JPEG of PIL's (37x21) with ``segments`` after the signature."""
    data = _jpeg()
    return data[:2] + b"".join(segments) + data[2:]


def _mpo(index: bytes, *app1: bytes) -> bytes:
    """A plain JPEG of PIL's (37x21) with the MP index ``index`` (and APP1s ``app1``)."""
    return _with_segments(_segment(0xE2, index), *(_segment(0xE1, one) for one in app1))


ULTRA_HDR = XMP_PREFIX + b'<rdf:Description hdrgm:Version="1.0"/>'


def test_an_mpo_is_an_mpo_and_a_gain_map_jpeg_stays_a_jpeg():
    buffer = io.BytesIO()
    frames = [Image.new("RGB", (37, 21), colour) for colour in ("white", "black")]
    frames[0].save(buffer, format="MPO", save_all=True, append_images=frames[1:])
    written = buffer.getvalue()
    cases = {
        "pil's": (written, "MPO"),
        "big-endian": (_mpo(_mp_index(">")), "MPO"),
        "one image": (_mpo(_mp_index(entries=1, images=1)), "JPEG"),
        "ultra hdr": (_mpo(_mp_index(), ULTRA_HDR), "JPEG"),
    }
    for case, (data, image_format) in cases.items():
        assert answer(data) == through_pil(data) == (37, 21, image_format), case


UNUSUAL_MP_INDEXES = {
    "cut": _mp_index()[:-3],
    "no entries": _mp_index(entries=0, images=0),
    "entries short of the images": _mp_index(entries=1, images=2),
    "a non-jpeg image": _mp_index(image_format=1),
    "an unknown tag": _mp_index(extra=((0x0100, 3, 1, b"\1\0\0\0"),)),
    "a tag twice": _mp_index(extra=((0xB001, 4, 1, b"\2\0\0\0"),)),
    "entries as bytes": _mp_index(entry_type=1),
    "the count as a short": _mp_index(images_type=3),
    "a bigtiff header": b"MPF\0II+\0" + _mp_index()[8:],
}


@pytest.mark.parametrize("case", sorted(UNUSUAL_MP_INDEXES))
def test_mp_indexes_with_anything_unusual_answer_as_pil_reads_them(case):
    data = _mpo(UNUSUAL_MP_INDEXES[case])
    assert answer(data) == through_pil(data)


def test_two_mp_indexes_and_a_large_declared_size_answer_as_pil_reads_them():
    two = _with_segments(
        _segment(0xE2, _mp_index(entries=1, images=1)), _segment(0xE2, _mp_index())
    )
    assert answer(two) == through_pil(two)
    huge = _jpeg("L", size=(8000, 8000))
    assert answer(huge, max_pixels=1 << 20) == through_pil(huge, max_pixels=1 << 20) == TooLarge


def test_two_exif_blocks_are_read_as_pil_reads_them_as_one():
    data = _jpeg(exif=_exif(6))
    app1 = data.index(b"\xff\xe1")
    after = app1 + 2 + int.from_bytes(data[app1 + 2 : app1 + 4])
    two = data[:after] + _segment(0xE1, _exif(3)) + data[after:]
    assert answer(two) == through_pil(two) == (21, 37, "JPEG")  # the first block's 6


def _with_app1(block: bytes) -> bytes:
    """A plain JPEG of PIL's (37x21) with ``block`` as an APP1 after the signature."""
    return _with_segments(_segment(0xE1, block))


_LONG, _ASCII, _RATIONAL, _IFD = 4, 2, 5, 13
UNUSUAL_EXIF = {
    "orientation-as-a-long": _tiff(">", [(0x0112, _LONG, 1, ("L", 6))]),
    "orientation-of-two-shorts": _tiff("<", [(0x0112, 3, 2, ("H", 6))]),
    "orientation-twice": _tiff("<", [(0x0112, 3, 1, ("H", 6)), (0x0112, 3, 1, ("H", 1))]),
    "an-unknown-type": _tiff("<", [(0x0112, 3, 1, ("H", 6)), (0x010F, _IFD, 1, b"\0" * 4)]),
    "a-value-past-the-block": _tiff("<", [(0x010F, 7, 40, ("L", 90)), (0x0112, 3, 1, ("H", 6))]),
    "an-ascii-x-resolution": _tiff(
        "<", [(0x0128, 3, 1, ("H", 2)), (0x011A, _ASCII, 1, b"5\0\0\0"), (0x0112, 3, 1, ("H", 6))]
    ),
    "the-prefix-twice": b"Exif\0\0" + _tiff("<", [(0x0112, 3, 1, ("H", 6))]),
    "a-cut-directory": _tiff("<", [(0x0112, 3, 1, ("H", 6))], declared_delta=1),
    "a-bigtiff-header": b"Exif\0\0II+\0" + _tiff("<", [(0x0112, 3, 1, ("H", 6))])[10:],
}


@pytest.mark.parametrize("case", sorted(UNUSUAL_EXIF))
def test_exif_blocks_with_anything_unusual_answer_as_pil_reads_them(case):
    data = _with_app1(UNUSUAL_EXIF[case])
    assert answer(data) == through_pil(data)


def test_a_plain_exif_block_with_a_rational_dpi_turns_the_size():
    block = _tiff(
        ">", [(0x0128, 3, 1, ("H", 2)), (0x011A, _RATIONAL, 1, ("L", 26)), (0x0112, 3, 1, ("H", 8))]
    )
    data = _with_app1(block + struct.pack(">LL", 72, 1))
    assert answer(data) == through_pil(data) == (21, 37, "JPEG")


UNUSUAL_FRAMES = {
    "a-component-cut": _segment(0xC0, _frame(8, 3, 33, 17)[:-1]),
    "a-12-bit-frame": _segment(0xC0, _frame(12, 3, 33, 17)),
    "a-2-layer-frame": _segment(0xC0, _frame(8, 2, 33, 17)),
    "a-hierarchical-frame": _segment(0xDE, _frame(8, 3, 50, 60)),
    "a-restart-marker": b"\xff\xd0",
    "a-fill-byte": b"\xff",
}


@pytest.mark.parametrize("case", sorted(UNUSUAL_FRAMES))
def test_unusual_frames_and_markers_answer_as_pil_reads_them(case):
    data = _jpeg()
    frame = data.index(b"\xff\xc0")
    data = data[:frame] + UNUSUAL_FRAMES[case] + data[frame:]
    assert answer(data) == through_pil(data)


def _resource(code: int, data: bytes, name: bytes = b"") -> bytes:
    """A Photoshop image resource: "8BIM", its code, its name (a length byte, padded to even)
    and its data (a 4-byte size, padded to even)."""
    named = bytes([len(name)]) + name
    named += b"\0" * (len(named) & 1)
    return (
        b"8BIM"
        + struct.pack(">H", code)
        + named
        + struct.pack(">L", len(data))
        + data
        + (b"\0" * (len(data) & 1))
    )


RESOLUTION = struct.pack(">LHHLHH", 72 << 16, 1, 1, 72 << 16, 1, 1)  # 72 dpi, as Photoshop writes
PHOTOSHOP = (
    PHOTOSHOP_PREFIX
    + _resource(0x0404, b"\x1c\x02\x00\x00\x02\x00\x04")  # an IPTC record
    + _resource(0x03ED, RESOLUTION)
    + _resource(0x040C, bytes(9), name=b"thumb")
)


def test_a_photoshop_block_cut_anywhere_answers_as_pil_reads_it():
    """PIL parses a Photoshop block's resources until one is cut short, and fails the open when
    one ends right after its code: every cut of a block of three resources answers as PIL."""
    whole = _with_segments(_segment(0xED, PHOTOSHOP))
    assert answer(whole) == through_pil(whole) == (37, 21, "JPEG")
    after_code = len(PHOTOSHOP_PREFIX) + 6
    failing = _with_segments(_segment(0xED, PHOTOSHOP[:after_code]))
    assert answer(failing) == through_pil(failing) == ValueError
    for cut in range(len(PHOTOSHOP_PREFIX), len(PHOTOSHOP)):
        data = _with_segments(_segment(0xED, PHOTOSHOP[:cut]))
        assert answer(data) == through_pil(data), cut


def test_a_short_resolution_resource_ends_pils_parse_of_a_photoshop_block():
    """Past a resolution resource too short to unpack, PIL reads no further: a resource after it
    that would fail the open does not."""
    block = PHOTOSHOP_PREFIX + _resource(0x03ED, bytes(13)) + b"8BIM\x04\x04"
    data = _with_segments(_segment(0xED, block))
    assert answer(data) == through_pil(data) == (37, 21, "JPEG")
    whole = PHOTOSHOP_PREFIX + _resource(0x03ED, bytes(14)) + b"8BIM\x04\x04"
    data = _with_segments(_segment(0xED, whole))
    assert answer(data) == through_pil(data) == ValueError
