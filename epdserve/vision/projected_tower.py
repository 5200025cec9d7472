"""The towers that end in a multimodal projector, as the encode worker runs them (Gemma 3's,
InternVL's): transformers' own modules, loaded alone out of the full checkpoint (the tensors under
``model.vision_tower.`` and ``model.multi_modal_projector.``; the language model's are not read).
Each takes a batch of fixed-size images ``[n, 3, H, W]`` (the image processor's resize, or its
tiles) and returns the rows vLLM's ``embed_multimodal`` hands the language model, packed in input
order.
"""

from __future__ import annotations

import torch
from transformers import AutoModel, Gemma3Config, InternVLConfig
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3MultiModalProjector,
    Gemma3PreTrainedModel,
)
from transformers.models.internvl.modeling_internvl import (
    InternVLModel,
    InternVLMultiModalProjector,
    InternVLPreTrainedModel,
    InternVLVisionModel,
)


class Gemma3ProjectedTower(Gemma3PreTrainedModel):
    """SigLIP and Gemma 3's projector, as ``Gemma3Model.get_image_features`` runs them."""

    config_class = Gemma3Config
    base_model_prefix = ""  # the checkpoint's names are mapped onto this module's (tower.py)
    _no_split_modules = ["SiglipEncoderLayer"]

    def __init__(self, config: Gemma3Config):
        super().__init__(config)
        self.vision_tower = AutoModel.from_config(config=config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        self.post_init()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Packed rows ``[n * mm_tokens_per_image, width]`` of ``n`` images ``[n, 3, H, W]``."""
        hidden = self.vision_tower(pixel_values=pixel_values, return_dict=True).last_hidden_state
        return self.multi_modal_projector(hidden).flatten(0, 1)


class InternVLProjectedTower(InternVLPreTrainedModel):
    """InternVL's vision tower, pixel shuffle and projector, run by ``InternVLModel``'s own
    ``get_image_features`` (the tensors under ``model.vision_tower.`` and
    ``model.multi_modal_projector.``). Its input is a batch of tiles ``[n, 3, H, W]`` (the image
    processor's dynamic tiling: an image's tiles, then its thumbnail), its output each tile's
    ``image_seq_length`` rows of the text width, packed in tile order: an image's rows are its
    tiles' rows, as vLLM's ``embed_multimodal`` hands them to the language model."""

    config_class = InternVLConfig
    base_model_prefix = ""  # the checkpoint's names are mapped onto this module's (tower.py)
    _no_split_modules = ["InternVLVisionLayer"]

    def __init__(self, config: InternVLConfig):
        super().__init__(config)
        self.vision_tower = InternVLVisionModel(config.vision_config)
        self.multi_modal_projector = InternVLMultiModalProjector(config)
        self.post_init()

    pixel_shuffle = InternVLModel.pixel_shuffle

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Packed rows ``[n * image_seq_length, width]`` of ``n`` tiles ``[n, 3, H, W]``."""
        features = InternVLModel.get_image_features(
            self,
            pixel_values,
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        )
        return features.pooler_output.flatten(0, 1)
