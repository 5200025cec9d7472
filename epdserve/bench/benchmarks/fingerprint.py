"""`epd-bench fingerprint`: what a model fingerprint costs at start-up for a full-size tower.

Writes the family's released vision config as a vision-only checkpoint (random weights, in the
dtype asked), then reads its vision weights' digest (``epdserve.fingerprints``) round after round:
"cold", the checkpoint's pages dropped from the page cache first (``posix_fadvise DONTNEED``: read
from disk, as a fresh node would), and "warm" (in the page cache, as a restart would). Medians of
the rounds, each level reported.
"""

from __future__ import annotations

import glob
import os
import statistics
import tempfile
import time

from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.towers import full_size_tower
from epdserve.fingerprints import vision_weights_digest


def _drop_page_cache(directory: str) -> None:
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def main(args) -> int:
    report = {"family": args.family, "dtype": args.dtype, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="epd-fingerprint-") as directory:
        built = full_size_tower(args.family, directory, "cpu", args.dtype)
        size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
        report |= {"params": built["params"], "checkpoint_bytes": size}
        seconds: dict[str, list[float]] = {"cold": [], "warm": []}
        for _ in range(args.rounds):
            for level in ("cold", "warm"):
                if level == "cold":
                    _drop_page_cache(directory)
                started = time.perf_counter()
                vision_weights_digest(directory)
                seconds[level].append(time.perf_counter() - started)
    report["seconds"] = seconds
    report["median_s"] = {level: statistics.median(runs) for level, runs in seconds.items()}
    print(
        f"{args.family} vision tower, {built['params'] / 1e6:.1f} M parameters, "
        f"{size / 1e9:.2f} GB of {args.dtype}: weights digest "
        + ", ".join(
            f"{level} {median:.2f} s (rounds {', '.join(f'{s:.2f}' for s in seconds[level])})"
            for level, median in report["median_s"].items()
        )
    )
    write_json(args.json, report)
    return 0
