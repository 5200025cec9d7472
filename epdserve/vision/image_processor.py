"""A checkpoint's image processor as its model's processor applies it: the image processor's
config, under the settings the model's processor passes it on every call (InternVL's
``crop_to_patches``: ``fingerprints.processor_image_defaults``), under ``--mm-processor-kwargs``;
and the processor's settings the family's sizing reads where the image processor's config has none
(InternVL's ``image_seq_length``, rows per tile: ``fingerprints.PROCESSOR_SIZING_SETTINGS``, from
the processor's config or its class's default, as vLLM's processor has them). vLLM calls the
model's processor, so an encode worker or dispatcher that loads the image processor alone sizes and
preprocesses an item as vLLM does only with those applied; the connector's fingerprint reads
vLLM's image processor alike (``fingerprints.as_its_processor_applies``)."""

from __future__ import annotations

import inspect
import json
import os

from epdserve.fingerprints import PROCESSOR_SIZING_SETTINGS, processor_image_defaults


def _config(directory: str, name: str) -> dict:
    """``directory``'s JSON config ``name``; {} where there is none or it cannot be read."""
    try:
        with open(os.path.join(directory, name)) as f:
            content = json.load(f)
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def model_processor_class(directory: str) -> type | None:
    """The processor class transformers' ``AutoProcessor`` names for the checkpoint's
    ``model_type`` (``config.json``); None for a checkpoint it names none for (a vision-only one)
    or whose config cannot be read."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(_config(directory, "config.json").get("model_type", ""))
    return getattr(transformers, name, None) if isinstance(name, str) else None


def load_image_processor(directory: str, processor_kwargs: dict | None = None):
    """``directory``'s image processor, its model's processor's image settings and then
    ``processor_kwargs`` over its config, with the processor's sizing settings it lacks (module
    docstring)."""
    from transformers import AutoImageProcessor

    processor_class = model_processor_class(directory)
    kwargs = {**processor_image_defaults(processor_class), **(processor_kwargs or {})}
    image_processor = AutoImageProcessor.from_pretrained(directory, local_files_only=True, **kwargs)
    if processor_class is None:
        return image_processor
    processor_config = _config(directory, "processor_config.json")
    parameters = inspect.signature(processor_class.__init__).parameters
    for name in PROCESSOR_SIZING_SETTINGS:
        if getattr(image_processor, name, None) is not None or name not in parameters:
            continue  # an image processor's unset setting is None
        default = parameters[name].default
        value = processor_config.get(name, default)
        if value is not inspect.Parameter.empty:
            setattr(image_processor, name, value)
    return image_processor
