"""Small full checkpoints of each family (``vision.families``) with a tokenizer, built offline, for
running vLLM.

A vLLM engine needs what a hub checkpoint holds: the model (``config.json`` + safetensors), the
image and video processor configs and a tokenizer whose special tokens (``<|vision_start|>``,
``<|image_pad|>``, ...) carry the ids the config names. ``build_vlm`` writes all of it with the
real transformers classes (random weights; the tower is ``small_checkpoints.vision_config``'s, so
rows per image are the production ones; the family's text config and hub tensor layout,
``TowerFamily.small_text`` / ``hub_transposes`` / ``hub_renames``) and a byte-level BPE
tokenizer of the family's tokens trained in memory on a fixed text (``vision.small_tokenizers``),
so two builds with the same arguments are identical. ``cached_vlm`` builds once per configuration
under ``~/.cache/epd-encode-worker`` (an atomic rename: concurrent builders never see half a
directory) and returns the directory.

The same directory serves the encode worker (``--model``: it reads the ``visual.`` weights and the
image processor) and vLLM (``LLM(model=...)``), so both place the same rows per image.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig

from epdserve.vision.families import FAMILIES
from epdserve.vision.small_checkpoints import (
    draw_zero_initialised,
    save_processors,
    vision_config,
)
from epdserve.vision.small_tokenizers import QWEN_TOKENS, VOCAB_SIZE, build_tokenizer

DEFAULT_CACHE = os.path.expanduser("~/.cache/epd-encode-worker")
# Bump when what build_vlm writes changes, so cached directories of an older layout are not reused.
BUILD_VERSION = 4
TEXT_INIT_STD = 0.3
# One image / video in a Qwen-VL prompt (vLLM expands the pad to the item's rows); another
# family's: its ``TowerFamily.small_tokens``.
IMAGE_PROMPT = QWEN_TOKENS.image_prompt
VIDEO_PROMPT = QWEN_TOKENS.video_prompt


def build_vlm(
    family: str,
    directory: str,
    hidden: int = 128,
    layers: int = 2,
    tower_width: int = 64,
    seed: int = 0,
) -> str:
    """A full ``...ForConditionalGeneration`` checkpoint (float32) with tokenizer, image and
    video processors in ``directory``. ``hidden``: the LLM's width = the tower's output width =
    the width of every embedding row; heads of 32 (vLLM's CPU attention takes that head size)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(FAMILIES)}")
    if hidden % 64:
        raise ValueError(f"hidden {hidden} must be a multiple of 64 (heads of 32, two KV heads)")
    torch.manual_seed(seed)
    heads = hidden // 32
    tokens = FAMILIES[family].small_tokens
    text = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=4096,
        bos_token_id=tokens.id(tokens.bos),
        eos_token_id=tokens.id(tokens.eos),
        pad_token_id=tokens.id(tokens.pad),
        # mrope sections (temporal, height, width) sum to half the head size (32)
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [4, 6, 6],
        },
    )
    text.update(FAMILIES[family].small_text)
    config_class, model_class = FAMILIES[family].vlm_config, FAMILIES[family].vlm
    config = config_class(
        vision_config=vision_config(family, out_width=hidden, width=tower_width),
        text_config=text,
        **{argument: tokens.id(token) for argument, token in tokens.config_ids.items()},
        **FAMILIES[family].small_vlm,
        tie_word_embeddings=False,
    )
    model = model_class(config).eval()
    draw_zero_initialised(family, model)
    with (
        torch.no_grad()
    ):  # wide text weights: greedy tokens then follow the image (at transformers'
        # 0.02 init the tiny LLM answers most images with one repeated token, so equal tokens prove
        # little)
        language = model.model.language_model
        for name, parameter in [*language.named_parameters(), ("lm_head", model.lm_head.weight)]:
            if parameter.dim() == 2 or ".experts." in name:  # matrices; a MoE layer's experts
                parameter.normal_(0.0, TEXT_INIT_STD)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    _to_hub_layout(directory, FAMILIES[family].hub_transposes, FAMILIES[family].hub_renames)
    GenerationConfig(
        bos_token_id=text["bos_token_id"],
        eos_token_id=text["eos_token_id"],
        pad_token_id=text["pad_token_id"],
        do_sample=False,
    ).save_pretrained(directory)
    save_processors(family, directory)
    tokenizer = build_tokenizer(directory, tokens)
    small_processor = FAMILIES[family].small_processor
    if small_processor is not None:
        image_processor = FAMILIES[family].small_image_processor()
        small_processor(image_processor, tokenizer).save_pretrained(directory)
    return directory


def _to_hub_layout(
    directory: str, transposes: dict[str, tuple[int, int]], renames: dict[str, str]
) -> None:
    """The saved tensors named ``...<suffix>`` transposed as ``transposes`` says, and renamed as
    ``renames`` says (pattern -> replacement), in place."""
    if not transposes and not renames:
        return
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(directory, name)
        tensors = load_file(path)
        for key, tensor in tensors.items():
            for suffix, dims in transposes.items():
                if key.endswith(suffix):
                    tensors[key] = tensor.transpose(*dims).contiguous()
        tensors = {_renamed(key, renames): tensor for key, tensor in tensors.items()}
        save_file(tensors, path, metadata={"format": "pt"})
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                content = json.load(f)
            content["weight_map"] = {
                _renamed(key, renames): shard for key, shard in content["weight_map"].items()
            }
            with open(index, "w") as f:
                json.dump(content, f, indent=2)


def _renamed(key: str, renames: dict[str, str]) -> str:
    for pattern, replacement in renames.items():
        key = re.sub(pattern, replacement, key)
    return key


def cached_vlm(
    family: str,
    hidden: int = 128,
    layers: int = 2,
    tower_width: int = 64,
    cache_dir: str = DEFAULT_CACHE,
) -> str:
    """``build_vlm``'s directory for these arguments, built on first use and reused after."""
    name = f"vlm-v{BUILD_VERSION}-{family}-h{hidden}-l{layers}-t{tower_width}"
    directory = os.path.join(cache_dir, name)
    if os.path.exists(os.path.join(directory, "tokenizer.json")):
        return directory
    os.makedirs(cache_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir)
    try:
        build_vlm(family, staging, hidden=hidden, layers=layers, tower_width=tower_width)
        os.rename(staging, directory)
    except OSError:
        if not os.path.exists(
            os.path.join(directory, "tokenizer.json")
        ):  # not a concurrent builder's win
            raise
    finally:
        if os.path.exists(staging):  # the build failed, or lost the rename to a concurrent builder
            shutil.rmtree(staging)
    return directory
