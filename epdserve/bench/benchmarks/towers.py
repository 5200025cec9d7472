"""The towers and images the benchmarks run. No hub is reachable here or on the lent GPU machine,
so every tower is built on the fly with random weights, from the real classes:

* ``bench_tower``: a small Qwen2.5-VL-architecture tower for the CPU (2 layers), with a real output
  width, so the bytes moved per item are a real model's;
* ``full_size_tower``: the exact vision config of a released checkpoint (``FULL_SIZE``: Qwen2-VL-7B,
  Qwen2.5-VL-7B, Qwen3-VL-8B, as their hub ``config.json`` sets them), with the image processor
  settings those checkpoints ship, for the GPU.
"""

from __future__ import annotations

import io
import os

import numpy as np
import torch

DEFAULT_CACHE = os.path.expanduser("~/.cache/epd-encode-worker")

# The hub's vision_config of each family's released checkpoint (the parts that shape the tower).
FULL_SIZE: dict[str, dict] = {
    "qwen2_vl": dict(  # Qwen/Qwen2-VL-7B-Instruct
        depth=32,
        embed_dim=1280,
        hidden_size=3584,
        mlp_ratio=4,
        num_heads=16,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    ),
    "qwen2_5_vl": dict(  # Qwen/Qwen2.5-VL-7B-Instruct
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        fullatt_block_indexes=[7, 15, 23, 31],
        window_size=112,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        hidden_act="silu",
    ),
    "qwen3_vl": dict(  # Qwen/Qwen3-VL-8B-Instruct
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=4096,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        hidden_act="gelu_pytorch_tanh",
    ),
}
# The image processor settings the released checkpoints ship (preprocessor_config.json).
FULL_SIZE_PROCESSOR: dict[str, dict] = {
    "qwen2_vl": dict(
        patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=3136, max_pixels=12845056
    ),
    "qwen2_5_vl": dict(
        patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=3136, max_pixels=12845056
    ),
    "qwen3_vl": dict(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": 65536, "longest_edge": 16777216},
    ),
}


def bench_tower(depth: int, hidden: int, width: int) -> str:
    """A small Qwen2.5-VL-architecture tower's checkpoint directory (built once, cached)."""
    from epdserve.vision.small_checkpoints import build_vision_only

    directory = os.path.join(DEFAULT_CACHE, f"bench-qwen2_5_vl-d{depth}-h{hidden}-w{width}")
    if not os.path.exists(os.path.join(directory, "model.safetensors")):
        build_vision_only("qwen2_5_vl", directory, out_width=width, depth=depth, width=hidden)
    return directory


def full_size_tower(family: str, directory: str, device: str, dtype: str, seed: int = 0) -> dict:
    """Write ``family``'s full-size vision-only checkpoint (random weights, built on ``device``)
    and its released image processor settings into ``directory``; what was built."""
    from transformers import Qwen2VLImageProcessor

    from epdserve.data_plane.dtypes import dtype_from_wire
    from epdserve.vision.families import family as tower_family

    spec = tower_family(family)
    torch.manual_seed(seed)
    with torch.device(device):
        tower = spec.tower(spec.vision_config(**FULL_SIZE[family]))
    tower = tower.to(dtype_from_wire(dtype)).eval()
    params = sum(p.numel() for p in tower.parameters())
    os.makedirs(directory, exist_ok=True)
    tower.save_pretrained(directory)
    Qwen2VLImageProcessor(**FULL_SIZE_PROCESSOR[family]).save_pretrained(directory)
    return {"family": family, "params": params, "config": FULL_SIZE[family]}


def free_encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """``VisionTower.encode`` at no cost: zero rows of the right shape and dtype, from one
    buffer (the stand-in worker's tower, and ``instant_tower``'s)."""
    rows = sum(self.rows_per_item(grid_thw))
    zeros = getattr(self, "_stand_in_rows", None)
    if zeros is None or zeros.shape[0] < rows:
        zeros = self._stand_in_rows = torch.zeros(
            max(rows, 4096), self.info.wire_width, dtype=self.dtype
        )
    return zeros[:rows]


def instant_tower(tower):
    """``tower`` (a ``VisionTower``) made to return its rows instantly (``free_encode``): the
    worker around it then costs only its own CPU, as if its GPU were infinitely fast."""
    import types

    tower.encode = types.MethodType(free_encode, tower)
    return tower


def noise_images(count: int, width: int, height: int) -> list[bytes]:
    """``count`` PNGs of uniform noise (distinct per index): the worst case for the decoder."""
    from PIL import Image

    out = []
    for seed in range(count):
        pixels = np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def parse_size(text: str) -> tuple[int, int]:
    """``"448"`` (square) or ``"1280x720"`` (width x height)."""
    width, _, height = text.lower().partition("x")
    return int(width), int(height or width)
