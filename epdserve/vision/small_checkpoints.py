"""Small checkpoints of the real Qwen-VL model classes, built offline (no hub here or in CI).

They keep the real patch, temporal and merge sizes, so pixel widths and rows per image are the
production ones; only depth and widths shrink. ``build_full`` writes a sharded hub-layout
``...ForConditionalGeneration`` checkpoint (the tower must be picked out of it with
``key_mapping``); ``build_vision_only`` writes just the tower. Both write the image processor
and video processor configs next to the weights, as a real checkpoint does.
"""

from __future__ import annotations

import os

import torch
from transformers import Qwen2VLImageProcessorPil
from transformers.utils import logging as hf_logging

from epdserve.vision.families import family

hf_logging.disable_progress_bar()  # no "Writing model shards" bars in test and demo output


def vision_config(name: str, out_width: int = 96, depth: int = 2, width: int = 64) -> dict:
    """The small tower's vision config of family ``name`` (``ValueError`` for an unknown one)."""
    return family(name).small_vision_config(out_width, depth, width)


def image_processor(name: str) -> Qwen2VLImageProcessorPil:
    return family(name).small_image_processor()


def save_processors(name: str, directory: str) -> None:
    """The family's image and video processor configs (a family without video: no video
    processor), beside the weights."""
    image_processor(name).save_pretrained(directory)
    video_processor = family(name).small_video_processor
    if video_processor is not None:
        video_processor().save_pretrained(directory)


# The standard deviation of the weights a small model draws where transformers leaves zeros.
DRAWN_STD = 0.3


def draw_zero_initialised(name: str, model: torch.nn.Module) -> None:
    """Family ``name``'s parameters that transformers initialises to zero, drawn from
    N(0, ``DRAWN_STD``) in ``model`` (``TowerFamily.small_drawn``)."""
    with torch.no_grad():
        for parameter in family(name).small_drawn:
            model.get_parameter(parameter).normal_(0.0, DRAWN_STD)


def build_full(name: str, directory: str, out_width: int = 96, seed: int = 0) -> str:
    """A full VLM checkpoint (tower + tiny LLM), saved in several safetensors shards."""
    torch.manual_seed(seed)
    config_class, model_class = family(name).vlm_config, family(name).vlm
    text = dict(
        hidden_size=out_width,
        intermediate_size=2 * out_width,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=256,
    )
    config = config_class(
        vision_config=vision_config(name, out_width), text_config=text, **family(name).small_vlm
    )
    model = model_class(config).eval()
    draw_zero_initialised(name, model)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, max_shard_size="200KB")
    save_processors(name, directory)
    return directory


def build_vision_only(
    name: str, directory: str, out_width: int = 96, depth: int = 2, width: int = 64, seed: int = 0
) -> str:
    """Just the tower (``visual.*`` weights at the top level), plus the image processor config."""
    torch.manual_seed(seed)
    config_class, tower_class = family(name).vision_config, family(name).tower
    tower = tower_class(config_class(**vision_config(name, out_width, depth, width))).eval()
    os.makedirs(directory, exist_ok=True)
    tower.save_pretrained(directory)
    save_processors(name, directory)
    return directory
