"""``header()`` per image, with the fast paths (``png_size``, ``jpeg_size``, ``webp_size``) and
through PIL alone: microseconds, the median of 7 rounds of 2,000 calls.
Usage: PYTHONPATH=. .venv/bin/python docs/results/issue32/headers.py OUT.json"""

import io
import json
import statistics
import sys
import timeit

from bench.images import synthetic_image
from PIL import Image
from vision import image_files

# An editor's XMP packet (as Lightroom writes one: its tools, dates and the TIFF orientation as
# attributes, then the 2 KB of padding the XMP standard asks for).
EDITOR_XMP = (
    b'<?xpacket begin="\xef\xbb\xbf" id="W5M0MpCehiHzreSzNTczkc9d"?>'
    b'<x:xmpmeta xmlns:x="adobe:ns:meta/" x:xmptk="Adobe XMP Core 7.0-c000">'
    b'<rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
    b'<rdf:Description rdf:about="" xmlns:xmp="http://ns.adobe.com/xap/1.0/"'
    b' xmlns:tiff="http://ns.adobe.com/tiff/1.0/"'
    b' xmlns:photoshop="http://ns.adobe.com/photoshop/1.0/"'
    b' xmp:CreatorTool="Adobe Photoshop Lightroom Classic 12.0"'
    b' xmp:ModifyDate="2026-12-06T12:00:00"'
    b' xmp:CreateDate="2026-12-06T11:00:00" photoshop:DateCreated="2026-12-06T11:00:00"'
    b' tiff:Orientation="6" tiff:Make="maker" tiff:Model="model"/>'
    b"</rdf:RDF></x:xmpmeta>" + b" " * 2048 + b'<?xpacket end="w"?>'
)


def camera_exif() -> Image.Exif:
    """A phone's EXIF block: orientation 6, dpi, make, model, date."""
    exif = Image.Exif()
    tags = {0x0112: 6, 0x011A: 72.0, 0x011B: 72.0, 0x0128: 2, 0x010F: "maker", 0x0110: "model"}
    for tag, value in tags.items():
        exif[tag] = value
    exif[0x0132] = "2026:12:06 12:00:00"
    return exif


def camera_like(size: int, xmp: bytes | None = None) -> bytes:
    """A JPEG as a phone writes one: EXIF (``camera_exif``), an ICC profile; with ``xmp``, that
    packet too (as an editor's export)."""
    exif = camera_exif()
    out = io.BytesIO()
    Image.open(io.BytesIO(synthetic_image(size, size, 1, "JPEG"))).save(
        out,
        format="JPEG",
        quality=90,
        exif=exif.tobytes(),
        icc_profile=b"\0" * 3144,
        **({"xmp": xmp} if xmp is not None else {}),
    )
    return out.getvalue()


def synthetic_jpeg_with(size: int, xmp: bytes) -> bytes:
    """The bench's JPEG, with ``xmp`` (its orientation the only one)."""
    out = io.BytesIO()
    Image.open(io.BytesIO(synthetic_image(size, size, 1, "JPEG"))).save(
        out, format="JPEG", quality=90, xmp=xmp
    )
    return out.getvalue()


def _resource(code: int, data: bytes) -> bytes:
    """A Photoshop image resource ("8BIM", its code, an empty name, its size; data padded)."""
    return (
        b"8BIM"
        + code.to_bytes(2)
        + b"\0\0"
        + len(data).to_bytes(4)
        + data
        + b"\0" * (len(data) & 1)
    )


def photoshop_export(size: int) -> bytes:
    """``camera_like``, with the Photoshop block (APP13) a "Save As" writes: an IPTC record, the
    resolution, print flags, a caption digest, a layer state and a 4 KB thumbnail."""
    block = b"Photoshop 3.0\x00" + b"".join(
        [
            _resource(0x0404, b"\x1c\x02\x00\x00\x02\x00\x04" + b"\x1c\x02\x78" + bytes(90)),
            _resource(
                0x03ED, (72 << 16).to_bytes(4) + b"\0\1\0\1" + (72 << 16).to_bytes(4) + b"\0\1\0\1"
            ),
            _resource(0x03F3, bytes(9)),
            _resource(0x0425, bytes(16)),
            _resource(0x0400, b"\0\0"),
            _resource(0x2710, bytes(10)),
            _resource(0x040C, bytes(4096)),
        ]
    )
    data = camera_like(size)
    return data[:2] + b"\xff\xed" + (len(block) + 2).to_bytes(2) + block + data[2:]


def mpo(size: int, gain_map: bool = False) -> bytes:
    """The bench's image as PIL writes a two-image MPO (an MP index in APP2); with ``gain_map``,
    an XMP packet naming a gain map as well (an Ultra HDR photo's: PIL reads it as a JPEG)."""
    image = Image.open(io.BytesIO(synthetic_image(size, size, 1, "JPEG")))
    out = io.BytesIO()
    image.save(out, format="MPO", save_all=True, append_images=[image], quality=90)
    data = out.getvalue()
    if not gain_map:
        return data
    packet = b"http://ns.adobe.com/xap/1.0/\x00" + b'<rdf:Description hdrgm:Version="1.0"/>'
    return data[:2] + b"\xff\xe1" + (len(packet) + 2).to_bytes(2) + packet + data[2:]


def webp(size: int, alpha: bool = False, **options) -> bytes:
    """The bench's image as a WebP; with ``alpha`` (lossy: an extended header, ALPH and VP8)."""
    image = Image.open(io.BytesIO(synthetic_image(size, size, 1)))
    if alpha:
        image.putalpha(200)
    out = io.BytesIO()
    image.save(out, format="WEBP", **options)
    return out.getvalue()


def microseconds(data: bytes) -> float:
    rounds = [
        timeit.timeit(lambda: image_files.header(data, 1 << 30), number=2000) / 2000 * 1e6
        for _ in range(7)
    ]
    return statistics.median(rounds)


def main(out: str) -> None:
    files = {
        "PNG 112": synthetic_image(112, 112, 1),
        "JPEG 112": synthetic_image(112, 112, 1, "JPEG"),
        "JPEG 448": synthetic_image(448, 448, 1, "JPEG"),
        "JPEG 448, EXIF (orientation 6, dpi) + ICC": camera_like(448),
        "JPEG 448, EXIF + ICC + an editor's XMP": camera_like(448, EDITOR_XMP),
        "JPEG 448, an editor's XMP alone": synthetic_jpeg_with(448, EDITOR_XMP),
        "JPEG 448, EXIF + ICC + a Photoshop block": photoshop_export(448),
        "MPO 448 (two images, an MP index)": mpo(448),
        "JPEG 448 with a gain map (an MP index, XMP)": mpo(448, gain_map=True),
        "WebP 112 (lossy)": webp(112),
        "WebP 448 (lossy)": webp(448),
        "WebP 448 (lossy, alpha)": webp(448, alpha=True),
        "WebP 448 (lossless)": webp(448, lossless=True),
        "WebP 448 (lossy), EXIF (orientation 6, dpi) + XMP": webp(
            448, exif=camera_exif().tobytes(), xmp=EDITOR_XMP
        ),
    }
    rows = {}
    for name, data in files.items():
        fast = microseconds(data)
        readers = ("png_size", "jpeg_size", "webp_size")
        saved = [getattr(image_files, name) for name in readers]
        for reader in readers:
            setattr(image_files, reader, lambda data: None)
        try:
            pil = microseconds(data)
        finally:
            for reader, function in zip(readers, saved):
                setattr(image_files, reader, function)
        rows[name] = {"fast_us": round(fast, 2), "pil_us": round(pil, 2), "bytes": len(data)}
        print(f"{name:45s} {fast:6.2f} us, through PIL {pil:6.2f} us")
    with open(out, "w") as file:
        json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
