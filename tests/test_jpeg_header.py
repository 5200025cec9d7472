"""A JPEG's header read without PIL (``vision.image_files.jpeg_size``) sizes a file as PIL does, or
leaves it to PIL: over JPEGs PIL writes (every mode it reads, EXIF orientations, colour profiles,
progressive, comments) and over marker sequences built at random (frames of any depth, layer count
and size; quantization tables whole or cut; APPn blocks of every kind PIL looks into, at any
length; EXIF directories of random entries, types, counts and offsets; stray markers and junk;
cut anywhere), ``header`` answers exactly what reading every file through PIL answers."""

import io
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from epdserve.vision import image_files
from epdserve.vision.image_files import JPEG_SIGNATURE, XMP_PREFIX, jpeg_size
from tests.header_answers import answer, orientation_through_pil, through_pil
from tests.image_matrix import matrix


def _jpeg(mode: str = "RGB", size=(37, 21), **options) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, "white" if mode != "CMYK" else (0, 0, 0, 0)).save(
        buffer, format="JPEG", **options
    )
    return buffer.getvalue()


def _exif(orientation: int | None = None, **tags) -> bytes:
    exif = Image.Exif()
    if orientation is not None:
        exif[image_files.ORIENTATION_TAG] = orientation
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
def test_jpegs_pil_writes_are_sized_without_pil(mode, options):
    data = _jpeg(mode, **options)
    assert jpeg_size(data) is not None
    assert answer(data) == through_pil(data)
    swapped = options.get("exif") in (_exif(6), _exif(8, **{"0x011a": 72.0, "0x0128": 2}))
    assert answer(data)[:2] == ((21, 37) if swapped else (37, 21))


def test_the_matrix_jpegs_are_sized_as_pil_sizes_them():
    jpegs = {case: data for case, data in matrix().items() if data.startswith(JPEG_SIGNATURE)}
    assert len(jpegs) >= 10
    for case, data in jpegs.items():
        assert jpeg_size(data) is not None, case
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
def test_an_xmp_packet_is_read_without_pil_its_orientation_as_pil_finds_it(case):
    packet, exif, size = XMP_CASES[case]
    data = _jpeg(xmp=packet, **({"exif": exif} if exif is not None else {}))
    assert jpeg_size(data) is not None
    assert answer(data) == through_pil(data) == (*size, "JPEG")


def test_of_two_xmp_packets_the_last_one_counts_as_for_pil():
    data = _with_segments(
        _segment(0xE1, XMP_PREFIX + b'<x tiff:Orientation="1"/>'),
        _segment(0xE1, XMP_PREFIX + b'<x tiff:Orientation="6"/>'),
    )
    inside = _with_app1(XMP_PREFIX + b'a\0<x tiff:Orientation="6"/>')  # PIL cuts at the first NUL
    for one, size in ((data, (21, 37)), (inside, (21, 37))):
        assert jpeg_size(one) is not None
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


def test_an_mpo_is_read_without_pil_and_a_gain_map_jpeg_stays_a_jpeg():
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
        assert jpeg_size(data) is not None, case
        assert answer(data) == through_pil(data) == (37, 21, image_format), case


MP_INDEXES_LEFT_TO_PIL = {
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


@pytest.mark.parametrize("case", sorted(MP_INDEXES_LEFT_TO_PIL))
def test_mp_indexes_with_anything_unusual_go_to_pil(case):
    data = _mpo(MP_INDEXES_LEFT_TO_PIL[case])
    assert jpeg_size(data) is None
    assert answer(data) == through_pil(data)


def test_two_mp_indexes_and_a_large_declared_size_go_to_pil():
    two = _with_segments(
        _segment(0xE2, _mp_index(entries=1, images=1)), _segment(0xE2, _mp_index())
    )
    assert jpeg_size(two) is None and answer(two) == through_pil(two)
    huge = _jpeg("L", size=(8000, 8000))
    refused = answer(huge, max_pixels=1 << 20)
    assert refused == through_pil(huge, max_pixels=1 << 20)
    assert refused[0] is image_files.TooLarge


def test_two_exif_blocks_go_to_pil_which_reads_them_as_one():
    data = _jpeg(exif=_exif(6))
    app1 = data.index(b"\xff\xe1")
    after = app1 + 2 + int.from_bytes(data[app1 + 2 : app1 + 4])
    two = data[:after] + _segment(0xE1, _exif(3)) + data[after:]
    assert jpeg_size(two) is None
    assert answer(two) == through_pil(two) == (21, 37, "JPEG")  # the first block's 6


def _with_app1(block: bytes) -> bytes:
    """A plain JPEG of PIL's (37x21) with ``block`` as an APP1 after the signature."""
    return _with_segments(_segment(0xE1, block))


_LONG, _ASCII, _RATIONAL, _IFD = 4, 2, 5, 13
EXIF_LEFT_TO_PIL = {
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


@pytest.mark.parametrize("case", sorted(EXIF_LEFT_TO_PIL))
def test_exif_blocks_with_anything_unusual_go_to_pil(case):
    data = _with_app1(EXIF_LEFT_TO_PIL[case])
    assert jpeg_size(data) is None
    assert answer(data) == through_pil(data)


def test_a_plain_exif_block_with_a_rational_dpi_is_read_without_pil():
    block = _tiff(
        ">", [(0x0128, 3, 1, ("H", 2)), (0x011A, _RATIONAL, 1, ("L", 26)), (0x0112, 3, 1, ("H", 8))]
    )
    data = _with_app1(block + struct.pack(">LL", 72, 1))
    assert jpeg_size(data) == (37, 21, 8, "JPEG")
    assert answer(data) == through_pil(data) == (21, 37, "JPEG")


FRAMES_LEFT_TO_PIL = {
    "a-component-cut": _segment(0xC0, _frame(8, 3, 33, 17)[:-1]),
    "a-12-bit-frame": _segment(0xC0, _frame(12, 3, 33, 17)),
    "a-2-layer-frame": _segment(0xC0, _frame(8, 2, 33, 17)),
    "a-hierarchical-frame": _segment(0xDE, _frame(8, 3, 50, 60)),
    "a-restart-marker": b"\xff\xd0",
    "a-fill-byte": b"\xff",
}


@pytest.mark.parametrize("case", sorted(FRAMES_LEFT_TO_PIL))
def test_frames_and_markers_plain_headers_do_not_hold_go_to_pil(case):
    data = _jpeg()
    frame = data.index(b"\xff\xc0")
    data = data[:frame] + FRAMES_LEFT_TO_PIL[case] + data[frame:]
    assert jpeg_size(data) is None
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
    image_files.PHOTOSHOP_PREFIX
    + _resource(0x0404, b"\x1c\x02\x00\x00\x02\x00\x04")  # an IPTC record
    + _resource(0x03ED, RESOLUTION)
    + _resource(0x040C, bytes(9), name=b"thumb")
)


def test_a_photoshop_block_is_read_without_pil_and_cut_anywhere_answers_as_pil():
    """PIL parses a Photoshop block's resources until one is cut short, and fails the open when
    one ends right after its code: every cut of a block of three resources answers as PIL."""
    whole = _with_segments(_segment(0xED, PHOTOSHOP))
    assert jpeg_size(whole) == (37, 21, None, "JPEG")
    assert answer(whole) == through_pil(whole)
    after_code = len(image_files.PHOTOSHOP_PREFIX) + 6
    failing = _with_segments(_segment(0xED, PHOTOSHOP[:after_code]))
    assert jpeg_size(failing) is None and isinstance(through_pil(failing)[0], type)
    for cut in range(len(image_files.PHOTOSHOP_PREFIX), len(PHOTOSHOP)):
        data = _with_segments(_segment(0xED, PHOTOSHOP[:cut]))
        assert answer(data) == through_pil(data), cut


def test_a_short_resolution_resource_ends_pils_parse_of_a_photoshop_block():
    """Past a resolution resource too short to unpack, PIL reads no further: a resource after it
    that would fail the open does not."""
    block = image_files.PHOTOSHOP_PREFIX + _resource(0x03ED, bytes(13)) + b"8BIM\x04\x04"
    data = _with_segments(_segment(0xED, block))
    assert jpeg_size(data) == (37, 21, None, "JPEG")
    assert answer(data) == through_pil(data)
    whole = image_files.PHOTOSHOP_PREFIX + _resource(0x03ED, bytes(14)) + b"8BIM\x04\x04"
    data = _with_segments(_segment(0xED, whole))
    assert jpeg_size(data) is None
    assert answer(data) == through_pil(data)


# A directory entry: tag (the ones PIL reads are likelier), type, count, and its 4 bytes: a
# number written in the block's byte order (an orientation, or an offset), or any bytes (a digit:
# an ASCII X resolution, which PIL's open fails on when a resolution unit is there too).
_TAGS = st.sampled_from([0x0112] * 4 + [0x011A] * 2 + [0x0128] * 2 + [0x010F, 0x8769])
_ENTRY = st.tuples(
    _TAGS,
    st.sampled_from([3] * 4 + [1, 2, 4, 5, 7, 10, 12, 0, 13, 99]),
    st.sampled_from([1] * 4 + [0, 2, 3, 40, 1 << 30]),
    st.one_of(
        st.sampled_from([1, 3, 5, 6, 8, 9]).map(lambda n: ("H", n)),
        st.integers(0, 120).map(lambda n: ("L", n)),
        st.sampled_from([b"5\0\0\0", b"\0\0\0\0"]),
        st.binary(min_size=4, max_size=4),
    ),
)


@st.composite
def _exif_block(draw) -> bytes:
    block = _tiff(
        draw(st.sampled_from(["<", ">"])),
        draw(st.lists(_ENTRY, max_size=5)),
        draw(st.sampled_from([8, 8, 8, 0, 3, 200])),
        draw(st.sampled_from([0, 0, 0, 1, -1])),
        draw(st.sampled_from([b"\0\0\0\0", b"", b"\0\0"])) + draw(st.binary(max_size=60)),
    )
    if draw(st.integers(0, 9)) == 0:
        block = block[:6] + draw(st.sampled_from([b"II+\0", b"XX*\0", b"Exif\0\0"])) + block[10:]
    return block[: draw(st.sampled_from([len(block)] * 5 + [4, 9, 14]))]


_APP = st.one_of(
    st.tuples(st.just(0xE0), st.sampled_from([b"JFIF\0\1\1\1\0H\0H\0\0", b"JFIF\0\1", b"JFXX"])),
    st.tuples(st.just(0xE1), _exif_block()),
    st.tuples(
        st.just(0xE1),
        st.sampled_from(
            [b"<x tiff:Orientation='6'/>", b'<x tiff:Orientation="6"/>', b"<tiff:Orientation>8<"]
            + [b'tiff:Orientation="x"', b"", b'\0tiff:Orientation="5"', b"tiff:Orientation>7"]
        ).map(lambda packet: XMP_PREFIX + packet),
    ),
    st.tuples(st.just(0xE2), st.sampled_from([b"ICC_PROFILE\0\1\1abc", b"ICC_PROFILE\0\1"])),
    st.tuples(st.just(0xE2), st.just(b"FPXR\0x")),
    st.tuples(
        st.just(0xE2),
        st.builds(
            _mp_index,
            order=st.sampled_from(["<", ">"]),
            entries=st.sampled_from([0, 1, 2, 2, 3]),
            images=st.sampled_from([0, 1, 2, 2, 3, 1 << 20]),
            image_format=st.sampled_from([0, 0, 0, 1]),
            extra=st.sampled_from([(), (), ((0xB004, 4, 1, b"\2\0\0\0"),), ((1, 1, 0, bytes(4)),)]),
            next_offset=st.booleans(),
            entry_type=st.sampled_from([7, 7, 7, 1]),
        ).flatmap(lambda index: st.sampled_from([index, index, index[:12], index[:-5]])),
    ),
    st.tuples(st.just(0xE1), st.just(ULTRA_HDR)),
    st.tuples(st.just(0xED), st.just(b"Photoshop 3.0\x008BIM\x03\xed\x00")),
    st.tuples(
        st.just(0xED),
        st.builds(
            lambda resources, tail: image_files.PHOTOSHOP_PREFIX + b"".join(resources) + tail,
            st.lists(
                st.builds(
                    _resource,
                    st.sampled_from([0x0404, 0x03ED, 0x03ED, 0x040C]),
                    st.sampled_from([RESOLUTION, bytes(13), b"", b"\1\2\3"]),
                    st.sampled_from([b"", b"", b"a", b"ab"]),
                ),
                max_size=3,
            ),
            st.sampled_from([b"", b"", b"8BIM", b"8BIM\x04\x04", b"8BIM\x04\x04\x00", b"8BI"]),
        ).flatmap(lambda block: st.sampled_from([block, block, block[:-1], block[:-7]])),
    ),
    st.tuples(st.just(0xEE), st.sampled_from([b"Adobe\0d\0\0\0\0\1", b"Adobe\0"])),
    st.tuples(st.integers(0xE3, 0xEF), st.binary(max_size=8)),
)
_OTHER = st.one_of(
    st.tuples(st.sampled_from([0xC4, 0xCC, 0xDD, 0xFE, 0xDC, 0xDF]), st.binary(max_size=6)),
    st.tuples(
        st.just(0xDB),
        st.sampled_from([bytes(65), bytes(130), bytes(129), bytes(64), b"\x10" + bytes(128)]),
    ),
    st.tuples(
        st.sampled_from([0xC0, 0xC0, 0xC2, 0xC3, 0xCF, 0xDE]),
        st.builds(
            _frame,
            st.sampled_from([8, 8, 8, 12]),
            st.sampled_from([3, 3, 1, 4, 2]),
            st.sampled_from([0, 5, 640, 30000]),
            st.sampled_from([0, 3, 480, 30000]),
        ),
    ),
)
_SEGMENTS = st.lists(
    st.tuples(st.one_of(_APP, _OTHER), st.sampled_from([0] * 12 + [-1, 1, -5])), max_size=6
)
_STRAY = st.sampled_from([b"", b"", b"", b"\xff", b"\x00", b"\xff\xd0", b"\xff\xc8"])


@settings(max_examples=2500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    segments=_SEGMENTS,
    frame=st.booleans(),
    stray=_STRAY,
    stray_at=st.integers(0, 6),
    scan_length_delta=st.sampled_from([0, 0, 0, -1, 5]),
    cut=st.one_of(st.none(), st.none(), st.integers(min_value=0, max_value=400)),
)
def test_any_marker_sequence_answers_as_through_pil(
    segments, frame, stray, stray_at, scan_length_delta, cut
):
    parts = [_segment(marker, body, delta) for (marker, body), delta in segments]
    if frame:
        parts.append(_segment(0xC0, _frame(8, 3, 33, 17)))
    parts.insert(min(stray_at, len(parts)), stray)
    scan = _segment(0xDA, b"\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00", scan_length_delta)
    data = b"\xff\xd8" + b"".join(parts) + scan + b"\x12\x34" * 20 + b"\xff\xd9"
    if cut is not None:
        data = data[:cut]
    assert answer(data, max_pixels=1 << 26) == through_pil(data, max_pixels=1 << 26)
    # a file read without PIL has PIL's orientation (one of 1-4 shows in no size)
    if (read := image_files._read_without_pil(data)) is not None:
        assert read[2] == orientation_through_pil(data)
