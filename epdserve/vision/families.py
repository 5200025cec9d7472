"""The vision-language families the encode workers serve, one entry each: a new family is one
``TowerFamily`` here (its transformers classes, its sizing rules, what its forward derives from
an item's grid (``vision.grid_inputs``) and the shape of a small test checkpoint); the ones whose
rows go through vLLM's EPD connector are also named in ``wire.ec_params.MODEL_TYPES`` (checked
here). ``docs/models.md`` lists them with every multimodal architecture vLLM registers
(``vision.vllm_architectures``).

What a family's rows look like follows from its config at load time (``tower.TowerInfo``): the
output width (``out_hidden_size`` or ``hidden_size``), the DeepStack levels (Qwen3-VL's
``deepstack_visual_indexes``, concatenated on each row as vLLM lays them out) and the merge size
(rows per image = patches / merge²).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    GotOcr2ImageProcessorPil,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    InternVLVideoProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen2VLVideoProcessor,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

from epdserve.vision.projected_tower import Gemma3ProjectedTower, InternVLProjectedTower
from epdserve.vision.sizing import FIXED_SIZE, QWEN_VL, TILED, Sizing
from epdserve.vision.small_tokenizers import (
    GEMMA3_TOKENS,
    INTERNVL_TOKENS,
    QWEN_TOKENS,
    SmallTokens,
)
from epdserve.wire.ec_params import MODEL_TYPES


@dataclass(frozen=True)
class TowerFamily:
    model_type: str  # the checkpoint's config.json model_type (a vision-only one adds "_vision")
    vision_config: type  # the tower's transformers config class (the full model's: Gemma 3)
    tower: type  # the tower's model class (loaded alone, out of the full checkpoint)
    vlm_config: type  # the full model's config and class (small test checkpoints)
    vlm: type
    # A small test tower's vision config: real patch, temporal and merge sizes, shrunk depth and
    # widths.
    small_vision_config: Callable[[int, int, int], dict]  # (out_width, depth, width) -> kwargs
    small_image_processor: Callable[
        [], Qwen2VLImageProcessorPil | Gemma3ImageProcessorPil | GotOcr2ImageProcessorPil
    ]
    # Its video processor: the real sizes and sampling (2 fps), a smaller pixel budget per frame;
    # None: the family takes no video.
    small_video_processor: Callable[[], Qwen2VLVideoProcessor | Qwen3VLVideoProcessor] | None
    # the model's positions take each video's seconds per temporal patch (second_per_grid_ts)
    video_seconds: bool = False
    # the prompt gives each temporal patch of a video its time ("<1.2 seconds>" before each
    # frame's placeholders): a request with the grid alone carries them (sizing.patch_times)
    video_timestamps: bool = False
    # what its forward derives from the grid besides positions and sequences (vision.grid_inputs):
    # attention windows (Qwen2.5-VL), a learned position table resampled per grid (Qwen3-VL)
    windows: bool = False
    position_table: bool = False
    # an item's patch grid from its sizes, and its rows (the processors' rules)
    sizing: Sizing = QWEN_VL
    # a small test VLM's text config beyond the shared one (vlm_checkpoints.build_vlm): heads of
    # 32 and the rope its language model takes
    small_text: dict = field(default_factory=dict)
    # whether vLLM takes a request of an item's grid alone (its processor declares embedding
    # fields); False: an EPD request carries the image itself and the rooms (Gemma 3 asserts it
    # takes no image_embeds), vLLM preprocesses it and its tower is not run for it
    grid_only_requests: bool = True
    # the dtype vLLM's CPU build runs its language model in: bfloat16 where its CPU kernels take
    # no other (Qwen3.5's Gated DeltaNet layers); tests run engine and workers in it
    cpu_dtype: str = "float32"
    # the hub's layout of tensors transformers saves in another (name suffix -> the dims to swap),
    # applied to the small test VLM's checkpoint so vLLM's loader reads it as a real one
    hub_transposes: dict[str, tuple[int, int]] = field(default_factory=dict)
    # the hub's names of tensors transformers saves under others (a pattern -> its replacement)
    hub_renames: dict[str, str] = field(default_factory=dict)
    # How the tower takes a batch: packed patches with their grids (the Qwen-VL towers: what the
    # forward derives from the grids, ``vision.grid_inputs``; varlen attention; compiled
    # regions), or False: a batch of fixed-size images ``[n, 3, H, W]``, the forward taking the
    # pixels alone (Gemma 3's SigLIP and projector; InternVL's tiles, an image's in order).
    packed_patches: bool = True
    # where a checkpoint keeps the tower's tensors (a prefix -> the tower module's name for it)
    tower_prefixes: dict[str, str] = field(
        default_factory=lambda: {r"^model\.visual\.": "", r"^visual\.": ""}
    )
    # the small test VLM's config beyond its vision and text configs, its tokenizer's tokens and
    # chat template, and the processor vLLM builds from them where it needs its config
    # (Gemma3Processor's image_seq_length); None: vLLM needs no processor config
    small_vlm: dict = field(default_factory=dict)
    small_tokens: SmallTokens = QWEN_TOKENS
    small_processor: Callable[..., object] | None = None  # (image processor, tokenizer)
    # the full model's parameters transformers initialises to zero that a small test model draws
    # (``small_checkpoints.draw_zero_initialised``): Gemma 3's projection would make every row 0
    small_drawn: tuple[str, ...] = ()


def _qwen2_image_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=3136, max_pixels=1003520
    )


def _qwen2_video_processor() -> Qwen2VLVideoProcessor:
    return Qwen2VLVideoProcessor(
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=3136,
        max_pixels=64 * 28 * 28,
        fps=2.0,
        cap_pixels_per_frame=False,
    )


# Qwen3-VL's patches and normalisation, as its image and video processors take them.
QWEN3_PATCHES = dict(
    patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3
)


def _qwen3_image_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        **QWEN3_PATCHES, size={"shortest_edge": 65536, "longest_edge": 16777216}
    )


def _qwen3_video_processor() -> Qwen3VLVideoProcessor:
    return Qwen3VLVideoProcessor(
        **QWEN3_PATCHES,
        size={"shortest_edge": 4096, "longest_edge": 4 * 64 * 32 * 32},
        fps=2.0,
        cap_pixels_per_frame=False,
    )


def _qwen3_vision_config(out_width: int, depth: int, width: int) -> dict:
    """A small Qwen3-family tower's config kwargs (Qwen3.5's as is): a learned position table of
    64 entries, no DeepStack levels."""
    return dict(
        depth=depth,
        hidden_size=width,
        out_hidden_size=out_width,
        num_heads=2,
        intermediate_size=2 * width,
        num_position_embeddings=64,
    )


def _qwen3_vl_vision_config(out_width: int, depth: int, width: int) -> dict:
    """A small Qwen3-VL (or Qwen3-VL-MoE) tower's config kwargs: the Qwen3-family tower with
    DeepStack levels after its first two blocks (fewer where it has fewer)."""
    return dict(
        _qwen3_vision_config(out_width, depth, width),
        deepstack_visual_indexes=list(range(min(depth, 2))),
    )


def _qwen3_vl_text(**language: object) -> dict:
    """A small Qwen3-VL language model's text config beyond the shared one, with ``language``'s
    entries added (a new dict each call): Qwen3's attention takes its head size from the config;
    interleaved mrope."""
    return dict(
        head_dim=32,
        **language,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [4, 6, 6],
            "mrope_interleaved": True,
        },
    )


def _qwen3_5_text(**language: object) -> dict:
    """A small Qwen3.5 language model's text config beyond the shared one, with ``language``'s
    entries added (a new dict each call): Gated DeltaNet (linear attention) layers, then full
    attention with a partial, interleaved mrope."""
    return dict(
        head_dim=32,
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        **language,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    )


# Gemma 3's small test model: 112x112 images in patches of 14 (8x8), pooled to 16 tokens (4x4).
GEMMA3_SMALL_TOKENS = 16


def _gemma3_image_processor() -> Gemma3ImageProcessorPil:
    return Gemma3ImageProcessorPil(
        size={"height": 112, "width": 112},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        image_seq_length=GEMMA3_SMALL_TOKENS,
    )


def _gemma3_processor(image_processor, tokenizer) -> Gemma3Processor:
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=GEMMA3_SMALL_TOKENS,
    )


# InternVL's small test model: tiles of 112x112 in patches of 14 (8x8), pixel-shuffled to 16 rows
# (4x4) each; an image is 1 to 6 tiles, plus a thumbnail where it is more than one.
INTERNVL_SMALL_TOKENS = 16


def _internvl_image_processor() -> GotOcr2ImageProcessorPil:
    """InternVL's dynamic tiling (``crop_to_patches``, as its processor applies it by default)
    with the tokens per tile its sizing reads (``sizing.TILED``)."""
    return GotOcr2ImageProcessorPil(
        size={"height": 112, "width": 112},
        crop_to_patches=True,
        min_patches=1,
        max_patches=6,
        image_seq_length=INTERNVL_SMALL_TOKENS,
    )


def _internvl_processor(image_processor, tokenizer) -> InternVLProcessor:
    """InternVL's processor; its video processor of the tile size, as vLLM builds it (the family
    takes no video here: ``sizing.TILED`` refuses one)."""
    return InternVLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(size=image_processor.size),
        chat_template=tokenizer.chat_template,
        image_seq_length=INTERNVL_SMALL_TOKENS,
    )


FAMILIES: dict[str, TowerFamily] = {
    family.model_type: family
    for family in (
        TowerFamily(
            "qwen2_vl",
            Qwen2VLVisionConfig,
            Qwen2VisionTransformerPretrainedModel,
            Qwen2VLConfig,
            Qwen2VLForConditionalGeneration,
            lambda out_width, depth, width: dict(
                depth=depth, embed_dim=width, hidden_size=out_width, num_heads=2, mlp_ratio=2
            ),
            _qwen2_image_processor,
            _qwen2_video_processor,
        ),
        TowerFamily(
            "qwen2_5_vl",
            Qwen2_5_VLVisionConfig,
            Qwen2_5_VisionTransformerPretrainedModel,
            Qwen2_5_VLConfig,
            Qwen2_5_VLForConditionalGeneration,
            lambda out_width, depth, width: dict(
                depth=depth,
                hidden_size=width,
                out_hidden_size=out_width,
                num_heads=2,
                intermediate_size=2 * width,
                fullatt_block_indexes=[depth - 1],
                window_size=112,
            ),
            _qwen2_image_processor,
            _qwen2_video_processor,
            video_seconds=True,
            windows=True,
        ),
        TowerFamily(
            "qwen3_vl",
            Qwen3VLVisionConfig,
            Qwen3VLVisionModel,
            Qwen3VLConfig,
            Qwen3VLForConditionalGeneration,
            _qwen3_vl_vision_config,
            _qwen3_image_processor,
            _qwen3_video_processor,
            position_table=True,
            video_timestamps=True,
            small_text=_qwen3_vl_text(),
        ),
        TowerFamily(
            "qwen3_vl_moe",
            Qwen3VLMoeVisionConfig,
            Qwen3VLMoeVisionModel,
            Qwen3VLMoeConfig,
            Qwen3VLMoeForConditionalGeneration,
            _qwen3_vl_vision_config,
            _qwen3_image_processor,
            _qwen3_video_processor,
            position_table=True,
            video_timestamps=True,
            # the hub stores each layer's fused experts transposed: [experts, in, out]
            hub_transposes={
                "experts.gate_up_proj": (1, 2),
                "experts.down_proj": (1, 2),
            },
            # Qwen3-VL's tower; a language model of sparse experts (Qwen3-VL-30B-A3B's layout)
            small_text=_qwen3_vl_text(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                decoder_sparse_step=1,
                norm_topk_prob=True,  # vLLM reads it (Qwen3-VL-30B-A3B's config states it)
            ),
        ),
        TowerFamily(
            "qwen3_5",
            Qwen3_5VisionConfig,
            Qwen3_5VisionModel,
            Qwen3_5Config,
            Qwen3_5ForConditionalGeneration,
            _qwen3_vision_config,
            _qwen3_image_processor,
            _qwen3_video_processor,
            position_table=True,
            video_timestamps=True,
            cpu_dtype="bfloat16",
            small_text=_qwen3_5_text(),
        ),
        TowerFamily(
            "qwen3_5_moe",
            Qwen3_5MoeVisionConfig,
            Qwen3_5MoeVisionModel,  # Qwen3.5's tower (transformers' subclass of it)
            Qwen3_5MoeConfig,
            Qwen3_5MoeForConditionalGeneration,
            _qwen3_vision_config,
            _qwen3_image_processor,
            _qwen3_video_processor,
            position_table=True,
            video_timestamps=True,
            cpu_dtype="bfloat16",
            # Qwen3.5's language model with sparse experts and a shared one in each layer
            # (Qwen3.5-35B-A3B's layout); transformers saves the experts as the hub stores them
            small_text=_qwen3_5_text(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                shared_expert_intermediate_size=64,
            ),
        ),
        TowerFamily(
            "gemma3",
            Gemma3Config,
            Gemma3ProjectedTower,
            Gemma3Config,
            Gemma3ForConditionalGeneration,
            # SigLIP (its output width is the projector's input; the rows are the LLM's width)
            lambda out_width, depth, width: dict(
                model_type="siglip_vision_model",
                hidden_size=width,
                intermediate_size=2 * width,
                num_hidden_layers=depth,
                num_attention_heads=2,
                image_size=112,
                patch_size=14,
                vision_use_head=False,
            ),
            _gemma3_image_processor,
            None,
            sizing=FIXED_SIZE,
            grid_only_requests=False,
            packed_patches=False,
            # the hub's layout (vision_tower.vision_model.*, as vLLM loads it) or transformers'
            tower_prefixes={
                r"^(model\.)?vision_tower\.(vision_model\.)?": "vision_tower.",
                r"^(model\.)?multi_modal_projector\.": "multi_modal_projector.",
            },
            hub_renames={r"^vision_tower\.(?!vision_model\.)": "vision_tower.vision_model."},
            # Gemma 3's language model: heads of 32, a sliding-window layer then a global one
            small_text=dict(
                head_dim=32,
                query_pre_attn_scalar=32,
                sliding_window=64,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                },
            ),
            small_vlm=dict(mm_tokens_per_image=GEMMA3_SMALL_TOKENS),
            small_tokens=GEMMA3_TOKENS,
            small_processor=_gemma3_processor,
            small_drawn=("model.multi_modal_projector.mm_input_projection_weight",),
        ),
        TowerFamily(
            "internvl",
            InternVLConfig,
            InternVLProjectedTower,
            InternVLConfig,
            InternVLForConditionalGeneration,
            # InternViT (its output width is the projector's input; the rows are the LLM's width)
            lambda out_width, depth, width: dict(
                hidden_size=width,
                intermediate_size=2 * width,
                num_hidden_layers=depth,
                num_attention_heads=2,
                image_size=112,
                patch_size=14,
            ),
            _internvl_image_processor,
            None,
            sizing=TILED,
            grid_only_requests=False,
            packed_patches=False,
            tower_prefixes={
                r"^(model\.)?vision_tower\.": "vision_tower.",
                r"^(model\.)?multi_modal_projector\.": "multi_modal_projector.",
            },
            # InternVL's language model (Qwen2's): a plain rope
            small_text=dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
            small_vlm=dict(image_seq_length=INTERNVL_SMALL_TOKENS),
            small_tokens=INTERNVL_TOKENS,
            small_processor=_internvl_processor,
            small_drawn=(
                "model.vision_tower.embeddings.cls_token",
                "model.vision_tower.embeddings.position_embeddings",
            ),
        ),
    )
}


# The families whose tower takes packed patches with their grids (``TowerFamily.packed_patches``):
# what the grid-derived inputs, the varlen attention path and the compiled regions apply to.
PATCH_GRID_FAMILIES = tuple(name for name, entry in FAMILIES.items() if entry.packed_patches)

unknown = set(MODEL_TYPES) - set(FAMILIES)
if unknown:
    raise RuntimeError(f"wire.ec_params.MODEL_TYPES names no family {sorted(unknown)}")


def family(name: str) -> TowerFamily:
    """The family named ``name``; ``ValueError`` listing the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"unknown family {name!r}; expected one of {', '.join(FAMILIES)}"
        ) from None


class TowerLoadError(RuntimeError):
    """The checkpoint cannot give a complete tower of a supported family."""


def detect_family(directory: str) -> str:
    """The family of the checkpoint in ``directory`` (its ``config.json``'s ``model_type``; a
    vision-only checkpoint's ends in ``_vision``); ``TowerLoadError`` for another."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            model_type = json.load(f).get("model_type", "")
    except (OSError, ValueError) as exc:
        raise TowerLoadError(f"cannot read {path}: {exc}") from exc
    name = model_type.removesuffix("_vision")
    if name not in FAMILIES:
        raise TowerLoadError(
            f"model_type {model_type!r} is not a supported tower ({sorted(FAMILIES)})"
        )
    return name
