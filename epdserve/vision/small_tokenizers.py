"""The tokenizers of the small test VLMs (``vision.vlm_checkpoints``), one token set per family's
chat layout (``TowerFamily.small_tokens``): a byte-level BPE tokenizer trained in memory on a fixed
text, with the family's special tokens at fixed ids (the config names them), its chat template and
the attributes its processor reads (Gemma 3's ``boi_token``, InternVL's
``start_image_token``, ...). Two builds are identical."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

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


@dataclass(frozen=True)
class SmallTokens:
    """A family's token set for a small tokenizer."""

    special: tuple[str, ...]  # special tokens, at ids 0.. in this order
    bos: str  # the config's bos_token_id
    tokenizer_bos: bool  # whether the tokenizer names it too (Qwen's names none)
    eos: str
    pad: str
    chat_template: str
    image_prompt: str  # one image in a prompt (vLLM expands it to the item's rows)
    video_prompt: str | None  # one video; None: the family takes none
    # the VLM config's token-id arguments: argument -> token
    config_ids: dict[str, str]
    # the tokenizer's named tokens its processor reads (extra_special_tokens): name -> token
    named: dict[str, str] = field(default_factory=dict)

    def id(self, token: str) -> int:
        return self.special.index(token)


# Qwen2-VL's special tokens, in its order.
_QWEN_SPECIAL = (
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
)
_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
# Qwen2-VL's chat layout, for OpenAI chat requests: text parts as they are, each image part
# (image_url, or image_embeds: an EPD request's grid alone) as the image prompt, each video part as
# the video prompt.
_QWEN_CHAT = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url', 'image_embeds'] %}"
    + _QWEN_IMAGE
    + "{% elif part['type'] in ['video', 'video_url', 'video_embeds'] %}"
    + _QWEN_VIDEO
    + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_TOKENS = SmallTokens(
    special=_QWEN_SPECIAL,
    bos="<|endoftext|>",
    tokenizer_bos=False,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    chat_template=_QWEN_CHAT,
    image_prompt=_QWEN_IMAGE,
    video_prompt=_QWEN_VIDEO,
    config_ids={
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    },
)

# Gemma 3's tokens (pad, eos, bos, unk at Gemma's ids 0..3), and the runs of newlines Gemma's
# vocabulary holds as single tokens: vLLM's Gemma 3 processor looks them up by their text.
_GEMMA3_SPECIAL = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
    "\n",
    "\n\n",
    "\n\n\n",
    "\n\n\n\n",
)
_GEMMA3_CHAT = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url'] %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_TOKENS = SmallTokens(
    special=_GEMMA3_SPECIAL,
    bos="<bos>",
    tokenizer_bos=True,
    eos="<end_of_turn>",
    pad="<pad>",
    chat_template=_GEMMA3_CHAT,
    image_prompt="<start_of_image>",
    video_prompt=None,
    config_ids={
        "boi_token_index": "<start_of_image>",
        "eoi_token_index": "<end_of_image>",
        "image_token_index": "<image_soft_token>",
    },
    named={
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    },
)

# InternVL's (its hub tokenizer's) image tokens after Qwen2's chat tokens; its processor reads
# them by name. A prompt's image is its context token: vLLM and the processor replace it with
# ``<img>``, the image's rows of context tokens and ``</img>``.
_INTERNVL_SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
    "<video>",
)
_INTERNVL_CHAT = _QWEN_CHAT.replace(_QWEN_IMAGE, "<IMG_CONTEXT>").replace(_QWEN_VIDEO, "<video>")
INTERNVL_TOKENS = SmallTokens(
    special=_INTERNVL_SPECIAL,
    bos="<|endoftext|>",
    tokenizer_bos=False,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    chat_template=_INTERNVL_CHAT,
    image_prompt="<IMG_CONTEXT>",
    video_prompt=None,
    config_ids={"image_token_id": "<IMG_CONTEXT>"},
    named={
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    },
)


def build_tokenizer(directory: str, tokens: SmallTokens = QWEN_TOKENS) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``VOCAB_SIZE`` ids with ``tokens``' special tokens at their
    ids and its chat template, saved to ``directory`` (``tokenizer.json`` + config)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(tokens.special),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    for index, token in enumerate(tokens.special):
        if tokenizer.token_to_id(token) != index:
            raise RuntimeError(
                f"tokenizer training put {token!r} at {tokenizer.token_to_id(token)}, not {index}"
            )
    named = {"bos_token": tokens.bos} if tokens.tokenizer_bos else {}
    if tokens.named:
        named["extra_special_tokens"] = dict(tokens.named)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=tokens.eos,
        pad_token=tokens.pad,
        model_max_length=32768,
        **named,
    )
    fast.chat_template = tokens.chat_template
    fast.save_pretrained(directory)
    return fast
