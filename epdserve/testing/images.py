"""Synthetic test images for the demo and the benchmarks: deterministic per seed, in PNG or JPEG,
with some structure (gradients and shapes), so they compress and decode like real pictures."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw


def synthetic_image(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(0, 255, 3)
    slope = rng.uniform(-0.5, 0.5, (3, 2))
    pixels = np.stack([base[c] + slope[c, 0] * x + slope[c, 1] * y for c in range(3)], axis=-1)
    pixels += rng.normal(0, 6, pixels.shape)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = (
            x0 + int(rng.integers(8, max(9, width // 3))),
            y0 + int(rng.integers(8, max(9, height // 3))),
        )
        color = tuple(int(v) for v in rng.integers(0, 255, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=color)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()
