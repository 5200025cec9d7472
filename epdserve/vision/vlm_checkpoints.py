"""Small full checkpoints of each family (``vision.families``) with a tokenizer, built offline, for
running vLLM.

A vLLM engine needs what a hub checkpoint holds: the model (``config.json`` + safetensors), the
image and video processor configs and a tokenizer whose special tokens (``<|vision_start|>``,
``<|image_pad|>``, ...) carry the ids the config names. ``build_vlm`` writes all of it with the
real transformers classes (random weights; the tower is ``small_checkpoints.vision_config``'s, so
rows per image are the production ones; the family's text config and hub tensor layout,
``TowerFamily.small_text`` / ``hub_transposes``) and a byte-level BPE tokenizer trained in
memory on a fixed text, so two builds with the same arguments are identical. ``cached_vlm``
builds once per configuration under ``~/.cache/epd-encode-worker`` (an atomic rename: concurrent
builders never see half a directory) and returns the directory.

The same directory serves the encode worker (``--model``: it reads the ``visual.`` weights and the
image processor) and vLLM (``LLM(model=...)``), so both place the same rows per image.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from epdserve.vision.families import FAMILIES
from epdserve.vision.small_checkpoints import save_processors, vision_config

DEFAULT_CACHE = os.path.expanduser("~/.cache/epd-encode-worker")
# Bump when what build_vlm writes changes, so cached directories of an older layout are not reused.
BUILD_VERSION = 4
TEXT_INIT_STD = 0.3
# Qwen2-VL's special tokens, in its order; they take ids 0.. here (the config names them below).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
TOKEN_IDS = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
VOCAB_SIZE = 512
# The fixed training text of the tokenizer: enough words for a few hundred merges.
_CORPUS = [
    "Describe this image in one sentence.",
    "What is shown in the picture?",
    "The quick brown fox jumps over the lazy dog.",
    "A photo of a cat sitting on a red chair.",
    "There are two people walking along the beach at sunset.",
    "Count the objects on the table.",
    "user",
    "assistant",
    "system",
    "You are a helpful assistant.",
    "image",
    "video",
    "number 0123456789",
]
# One image / video in a prompt (vLLM expands the pad to the item's rows).
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PROMPT = "<|vision_start|><|video_pad|><|vision_end|>"
# Qwen2-VL's chat layout, for OpenAI chat requests: text parts as they are, each image part
# (image_url, or image_embeds: an EPD request's grid alone) as IMAGE_PROMPT, each video part as
# VIDEO_PROMPT.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url', 'image_embeds'] %}"
    + IMAGE_PROMPT
    + "{% elif part['type'] in ['video', 'video_url', 'video_embeds'] %}"
    + VIDEO_PROMPT
    + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(directory: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``VOCAB_SIZE`` ids with Qwen2-VL's special tokens at
    ``TOKEN_IDS`` and ``CHAT_TEMPLATE``, saved to ``directory`` (``tokenizer.json`` + config)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    for token, index in TOKEN_IDS.items():
        if tokenizer.token_to_id(token) != index:
            raise RuntimeError(
                f"tokenizer training put {token} at {tokenizer.token_to_id(token)}, not {index}"
            )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


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
    text = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=4096,
        bos_token_id=TOKEN_IDS["<|endoftext|>"],
        eos_token_id=TOKEN_IDS["<|im_end|>"],
        pad_token_id=TOKEN_IDS["<|endoftext|>"],
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
        image_token_id=TOKEN_IDS["<|image_pad|>"],
        video_token_id=TOKEN_IDS["<|video_pad|>"],
        vision_start_token_id=TOKEN_IDS["<|vision_start|>"],
        vision_end_token_id=TOKEN_IDS["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = model_class(config).eval()
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
    _to_hub_layout(directory, FAMILIES[family].hub_transposes)
    GenerationConfig(
        bos_token_id=text["bos_token_id"],
        eos_token_id=text["eos_token_id"],
        pad_token_id=text["pad_token_id"],
        do_sample=False,
    ).save_pretrained(directory)
    save_processors(family, directory)
    build_tokenizer(directory)
    return directory


def _to_hub_layout(directory: str, transposes: dict[str, tuple[int, int]]) -> None:
    """The saved tensors named ``...<suffix>`` transposed as ``transposes`` says, in place."""
    if not transposes:
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
        save_file(tensors, path, metadata={"format": "pt"})


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
