"""Gemma 3's tower as the encode worker runs it: SigLIP and the multimodal projector (average pool
to ``mm_tokens_per_image`` tokens, RMS norm, projection to the LLM's width), transformers' own
modules loaded alone out of a ``Gemma3ForConditionalGeneration`` checkpoint (the tensors under
``model.vision_tower.`` and ``model.multi_modal_projector.``; the language model's are not read).

Its input is a batch of fixed-size images ``[n, 3, H, W]`` (the image processor's resize), its
output the rows vLLM's ``embed_multimodal`` hands the language model, packed in item order:
``[n * mm_tokens_per_image, text hidden size]``.
"""

from __future__ import annotations

import torch
from transformers import AutoModel, Gemma3Config
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3MultiModalProjector,
    Gemma3PreTrainedModel,
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
