"""A checkpoint's image processor as its model's processor applies it: the image processor's
config, under the settings the model's processor passes it on every call (InternVL's
``crop_to_patches``: ``fingerprints.processor_image_defaults``), under ``--mm-processor-kwargs``.
vLLM calls the model's processor, so an encode worker or dispatcher that loads the image processor
alone sizes and preprocesses an item as vLLM does only with those settings applied."""

from __future__ import annotations

import json
import os

from epdserve.fingerprints import processor_image_defaults


def model_processor_class(directory: str) -> type | None:
    """The processor class transformers' ``AutoProcessor`` names for the checkpoint's
    ``model_type`` (``config.json``); None for a checkpoint it names none for (a vision-only one)
    or whose config cannot be read."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    try:
        with open(os.path.join(directory, "config.json")) as f:
            model_type = json.load(f).get("model_type", "")
    except (OSError, ValueError):
        return None
    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if isinstance(name, str) else None


def load_image_processor(directory: str, processor_kwargs: dict | None = None):
    """``directory``'s image processor, its model's processor's image settings and then
    ``processor_kwargs`` over its config (module docstring)."""
    from transformers import AutoImageProcessor

    defaults = processor_image_defaults(model_processor_class(directory))
    kwargs = {**defaults, **(processor_kwargs or {})}
    return AutoImageProcessor.from_pretrained(directory, local_files_only=True, **kwargs)
