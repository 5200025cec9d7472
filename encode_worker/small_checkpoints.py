"""Small checkpoints of the real Qwen-VL model classes, built offline (no hub here or in CI).

They keep the real patch, temporal and merge sizes, so pixel widths and rows per image are the
production ones; only depth and widths shrink. ``build_full`` writes a sharded hub-layout
``...ForConditionalGeneration`` checkpoint (the tower must be picked out of it with
``key_mapping``); ``build_vision_only`` writes just the tower. Both write the image processor
config next to the weights, as a real checkpoint does.
"""

from __future__ import annotations

import os

import torch
from transformers.utils import logging as hf_logging
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
hf_logging.disable_progress_bar()  # no "Writing model shards" bars in test and demo output


def vision_config(family: str, out_width: int = 96, depth: int = 2, width: int = 64) -> dict:
    if family == "qwen2_vl":
        return dict(depth=depth, embed_dim=width, hidden_size=out_width, num_heads=2, mlp_ratio=2)
    if family == "qwen2_5_vl":
        return dict(depth=depth, hidden_size=width, out_hidden_size=out_width, num_heads=2,
                    intermediate_size=2 * width, fullatt_block_indexes=[depth - 1], window_size=112)
    if family == "qwen3_vl":
        return dict(depth=depth, hidden_size=width, out_hidden_size=out_width, num_heads=2,
                    intermediate_size=2 * width, num_position_embeddings=64,
                    deepstack_visual_indexes=list(range(min(depth, 2))))
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def image_processor(family: str) -> Qwen2VLImageProcessorPil:
    if family == "qwen3_vl":
        return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                        image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                        size={"shortest_edge": 65536, "longest_edge": 16777216})
    return Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=3136,
                                    max_pixels=1003520)


def build_full(family: str, directory: str, out_width: int = 96, seed: int = 0) -> str:
    """A full VLM checkpoint (tower + tiny LLM), saved in several safetensors shards."""
    torch.manual_seed(seed)
    config_class, model_class = {
        "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration),
    }[family]
    text = dict(hidden_size=out_width, intermediate_size=2 * out_width, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, vocab_size=256)
    config = config_class(vision_config=vision_config(family, out_width), text_config=text)
    model = model_class(config).eval()
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, max_shard_size="200KB")
    image_processor(family).save_pretrained(directory)
    return directory


def build_vision_only(family: str, directory: str, out_width: int = 96, depth: int = 2, width: int = 64,
                      seed: int = 0) -> str:
    """Just the tower (``visual.*`` weights at the top level), plus the image processor config."""
    from encode_worker.tower import TOWER_CLASSES

    torch.manual_seed(seed)
    config_class, tower_class = TOWER_CLASSES[family]
    tower = tower_class(config_class(**vision_config(family, out_width, depth, width))).eval()
    os.makedirs(directory, exist_ok=True)
    tower.save_pretrained(directory)
    image_processor(family).save_pretrained(directory)
    return directory
