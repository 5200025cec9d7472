"""`epd-bench headers`: what reading an image's header costs, against the gateway's budget.

The dispatcher (in the gateway) and every encode worker's intake size each image from its header
(``vision.image_files.header``: the displayed size, the format, nothing decoded). Two readers, over
a mix of the files clients send, at 448x448 and 1920x1080: a PNG, a baseline JPEG, a phone's JPEG
(EXIF with an orientation, an ICC profile), a Photoshop export (EXIF, ICC, an XMP packet, a
Photoshop block) and a lossy WebP:

* ``header``: the product's reader;
* ``pillow``: Pillow's own header read, lazily: ``Image.open``, the size and format, the EXIF
  orientation (a PNG's only from an eXIf chunk: for one without, Pillow's ``getexif`` decodes the
  image to look further).

Per round, each reader reads each file ``--calls`` times (microseconds per call); rounds
interleaved (the readers' order reversed every other round); per file and reader: the median
over the rounds. The budget: at ``RATE`` images/s one core has 1e6 / ``RATE`` us per image for
everything the gateway does with it; each figure is reported as its share of that too."""

from __future__ import annotations

import io
import os
import platform
import statistics
import time
from collections.abc import Callable

from PIL import Image

from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.rounds import in_round
from epdserve.testing.images import synthetic_image
from epdserve.vision.image_files import ORIENTATION_TAG, TRANSPOSED_ORIENTATIONS, header
from epdserve.vision.limits import MAX_PIXELS

RATE = 2000  # images/s one gateway process must sustain
BUDGET_US = 1e6 / RATE
SIZES = ((448, 448), (1920, 1080))
# An editor's XMP packet (its tools, dates and the TIFF orientation as attributes, then the 2 KB
# of padding the XMP standard asks for), as Photoshop and Lightroom write one.
EDITOR_XMP = (
    b'<?xpacket begin="\xef\xbb\xbf" id="W5M0MpCehiHzreSzNTczkc9d"?>'
    b'<x:xmpmeta xmlns:x="adobe:ns:meta/" x:xmptk="Adobe XMP Core 7.0-c000">'
    b'<rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
    b'<rdf:Description rdf:about="" xmlns:xmp="http://ns.adobe.com/xap/1.0/"'
    b' xmlns:tiff="http://ns.adobe.com/tiff/1.0/"'
    b' xmlns:photoshop="http://ns.adobe.com/photoshop/1.0/"'
    b' xmp:CreatorTool="Adobe Photoshop 25.0" xmp:ModifyDate="2026-12-06T12:00:00"'
    b' photoshop:DateCreated="2026-12-06T11:00:00"'
    b' tiff:Orientation="6" tiff:Make="maker" tiff:Model="model"/>'
    b"</rdf:RDF></x:xmpmeta>" + b" " * 2048 + b'<?xpacket end="w"?>'
)
ICC_PROFILE_BYTES = 3144  # an sRGB profile's size (Pillow stores the bytes, unparsed)


def pillow_header(data: bytes, max_pixels: int) -> tuple[int, int, str]:
    """Pillow's own header read (``max_pixels`` unused: the size check costs nothing)."""
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        if image.format != "PNG" or "exif" in image.info:
            if image.getexif().get(ORIENTATION_TAG) in TRANSPOSED_ORIENTATIONS:
                width, height = height, width
        return width, height, image.format


READERS: dict[str, Callable[[bytes, int], object]] = {"header": header, "pillow": pillow_header}


def _camera_exif() -> bytes:
    """A phone's EXIF block: orientation 6, dpi, make, model, date."""
    exif = Image.Exif()
    tags = {0x0112: 6, 0x011A: 72.0, 0x011B: 72.0, 0x0128: 2, 0x010F: "maker", 0x0110: "model"}
    for tag, value in tags.items():
        exif[tag] = value
    exif[0x0132] = "2026:12:06 12:00:00"
    return exif.tobytes()


def _jpeg(width: int, height: int, **metadata) -> bytes:
    picture = Image.open(io.BytesIO(synthetic_image(width, height, 1)))
    out = io.BytesIO()
    picture.save(out, format="JPEG", quality=90, **metadata)
    return out.getvalue()


def _photoshop_block() -> bytes:
    """The Photoshop block (APP13) a "Save As" writes: an IPTC record, the resolution, print
    flags, a caption digest, a layer state and a 4 KB thumbnail."""

    def resource(code: int, data: bytes) -> bytes:  # "8BIM", its code, no name, its size, data
        padded = data + b"\0" * (len(data) & 1)
        return b"8BIM" + code.to_bytes(2) + b"\0\0" + len(data).to_bytes(4) + padded

    resolution = (72 << 16).to_bytes(4) + b"\0\1\0\1" + (72 << 16).to_bytes(4) + b"\0\1\0\1"
    return b"Photoshop 3.0\x00" + b"".join(
        [
            resource(0x0404, b"\x1c\x02\x00\x00\x02\x00\x04\x1c\x02\x78" + bytes(90)),
            resource(0x03ED, resolution),
            resource(0x03F3, bytes(9)),
            resource(0x0425, bytes(16)),
            resource(0x0400, b"\0\0"),
            resource(0x040C, bytes(4096)),
        ]
    )


def files() -> dict[str, bytes]:
    """The mix, by name."""
    mix = {}
    for width, height in SIZES:
        size = f"{width}x{height}"
        webp = io.BytesIO()
        Image.open(io.BytesIO(synthetic_image(width, height, 1))).save(webp, format="WEBP")
        icc = bytes(ICC_PROFILE_BYTES)
        photoshop = _jpeg(width, height, exif=_camera_exif(), icc_profile=icc, xmp=EDITOR_XMP)
        block = _photoshop_block()
        mix |= {
            f"PNG {size}": synthetic_image(width, height, 1),
            f"JPEG {size}, baseline": _jpeg(width, height),
            f"JPEG {size}, a phone's: EXIF (orientation 6) + ICC": _jpeg(
                width, height, exif=_camera_exif(), icc_profile=icc
            ),
            f"JPEG {size}, a Photoshop export: EXIF + ICC + XMP + Photoshop block": (
                photoshop[:2] + b"\xff\xed" + (len(block) + 2).to_bytes(2) + block + photoshop[2:]
            ),
            f"WebP {size}, lossy": webp.getvalue(),
        }
    return mix


def _us_per_call(read: Callable[[bytes, int], object], data: bytes, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        read(data, MAX_PIXELS)
    return (time.perf_counter() - started) / calls * 1e6


def run(rounds: int = 7, calls: int = 2000) -> dict:
    mix = files()
    for name, data in mix.items():  # every reader answers every file alike
        answers = {reader: tuple(read(data, MAX_PIXELS)) for reader, read in READERS.items()}
        if len(set(answers.values())) != 1:
            raise RuntimeError(f"the readers disagree on {name}: {answers}")
    times: dict[tuple[str, str], list[float]] = {(r, f): [] for r in READERS for f in mix}
    for round_index in range(rounds):
        for reader in in_round(list(READERS), round_index):
            for name, data in mix.items():
                times[reader, name].append(_us_per_call(READERS[reader], data, calls))
    rows = []
    for name, data in mix.items():
        row = {"file": name, "bytes": len(data)}
        for reader in READERS:
            us = statistics.median(times[reader, name])
            row[f"{reader}_us"] = round(us, 2)
            row[f"{reader}_budget_share"] = round(us / BUDGET_US, 4)
            row[f"{reader}_us_rounds"] = [round(t, 2) for t in times[reader, name]]
        rows.append(row)
    means = {
        reader: round(statistics.fmean(row[f"{reader}_us"] for row in rows), 2)
        for reader in READERS
    }
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "pillow": Image.__version__,
        "rounds": rounds,
        "calls_per_round": calls,
        "rate_images_per_s": RATE,
        "budget_us_per_image": BUDGET_US,
        "files": rows,
        "mix_mean_us": means,
        "mix_mean_budget_share": {r: round(us / BUDGET_US, 4) for r, us in means.items()},
    }


def main(args) -> int:
    print(
        f"epd-bench headers: {args.rounds} interleaved rounds of {args.calls} calls per file and "
        f"reader; budget {BUDGET_US:.0f} us per image ({RATE} images/s on one core)"
    )
    report = run(args.rounds, args.calls)
    readers = list(READERS)
    print(
        f"\n{'file':70s} {'bytes':>8s} "
        + " ".join(f"{r + ' us':>10s} {'share':>6s}" for r in readers)
    )
    for row in report["files"]:
        cells = " ".join(f"{row[f'{r}_us']:10.1f} {row[f'{r}_budget_share']:6.1%}" for r in readers)
        print(f"{row['file']:70s} {row['bytes']:8d} {cells}")
    means = " ".join(
        f"{report['mix_mean_us'][r]:10.1f} {report['mix_mean_budget_share'][r]:6.1%}"
        for r in readers
    )
    print(f"{'the mix, mean':70s} {'':8s} {means}")
    write_json(args.json, report)
    return 0
