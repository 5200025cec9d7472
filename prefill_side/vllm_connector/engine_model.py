"""The model vLLM runs, as the connector describes it (``EngineDescription``): the fingerprint of
what vLLM itself loaded and applies (its checkpoint's vision weights, its vision config and dtype,
the image and video processors its multimodal registry builds with its ``--mm-processor-kwargs``),
the processor kwargs and the per-prompt limits. Computed once, when the scheduler half starts; the
receiver registers every room with its compact form and refuses rows committed under another."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from epdserve.data_plane.dtypes import dtype_to_wire
from epdserve.fingerprints import as_its_processor_applies, fingerprint
from epdserve.wire.fingerprint import EngineDescription, RowLayout
from epdserve.wire.modality import BY_VLLM_NAME

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def checkpoint_directory(model: str, revision: str | None) -> str:
    """The local directory vLLM loaded ``model`` from (a directory, or a hub id's snapshot in the
    Hugging Face cache, which vLLM fetched into it)."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model, revision=revision, local_files_only=True)


def engine_description(
    vllm_config: VllmConfig, width: int, deepstack_levels: int
) -> EngineDescription:
    """What this engine runs (module docstring); ``width``: one encoder row's (main and
    DeepStack levels side by side)."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    vision_config = hf_config.vision_config
    processor = MULTIMODAL_REGISTRY.get_processing_info(model_config).get_hf_processor()
    multimodal = model_config.multimodal_config
    return EngineDescription(
        served_model_name=model_config.served_model_name,
        fingerprint=fingerprint(
            checkpoint_directory(model_config.model, model_config.revision),
            hf_config.model_type,
            vision_config,
            dtype_to_wire(model_config.dtype),
            as_its_processor_applies(
                processor.image_processor,
                processor,
                dict(multimodal.mm_processor_kwargs or {}),
            ),
            getattr(processor, "video_processor", None),
            RowLayout(
                width=width,
                deepstack_levels=deepstack_levels,
                merge=getattr(vision_config, "spatial_merge_size", 1),  # Gemma 3: none
            ),
        ),
        mm_processor_kwargs=dict(multimodal.mm_processor_kwargs or {}),
        limit_mm_per_prompt={
            modality: multimodal.get_limit_per_prompt(modality) for modality in BY_VLLM_NAME
        },
    )
