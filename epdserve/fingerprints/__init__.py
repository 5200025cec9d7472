"""Model fingerprints computed from what a process runs (``epdserve.wire.fingerprint`` defines
them): the vision weights as the checkpoint stores them, the vision config, the dtype, the image
and video processors' effective settings and the row layout.

The encode worker fingerprints its tower at start-up (``epdserve.vision.tower``); an engine from
what it loaded (the vLLM connector from vLLM's own config and processors, ``epd-prefill`` from its
tower). Torch- and transformers-free: processors and configs are read through the methods every
transformers object has (``to_dict``, ``to_diff_dict``), so the prefill library computes an
engine's fingerprint inside vLLM without the encoder's stack.
"""

from __future__ import annotations

from epdserve.fingerprints.checkpoint import VISION_PREFIXES, vision_weights_digest
from epdserve.wire.fingerprint import ModelFingerprint, RowLayout, digest

__all__ = [
    "VISION_PREFIXES",
    "PROCESSOR_SIZING_SETTINGS",
    "as_its_processor_applies",
    "fingerprint",
    "processor_image_defaults",
    "processor_settings",
    "vision_weights_digest",
]

# Vision-config keys that do not change what the tower computes.
_CONFIG_NOISE = frozenset(
    {
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "model_type",
        "initializer_range",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "use_cache",
    }
)
# Processor keys that name a class, not a setting (the backend class is kept, as "class").
_PROCESSOR_NOISE = frozenset(
    {"image_processor_type", "video_processor_type", "processor_class", "auto_map"}
)


def processor_image_defaults(processor_class) -> dict:
    """The image settings a model's processor class (transformers' ``InternVLProcessor``, ...)
    passes its image processor on every call, over the image processor's own config: its kwargs'
    ``images_kwargs`` defaults (InternVL's ``crop_to_patches``, Gemma 3's pan-and-scan ones; {}
    for Qwen-VL's or for none). vLLM calls the model's processor, so these, not the image
    processor's config, are what it applies, unless its ``--mm-processor-kwargs`` set them."""
    kwargs = getattr(processor_class, "valid_processor_kwargs", None)
    return dict(getattr(kwargs, "_defaults", {}).get("images_kwargs", {}))


# The model processor's settings a family's sizing reads off the image processor, set on it where
# its own config has none: InternVL's rows per tile (its processor's config holds them).
PROCESSOR_SIZING_SETTINGS = ("image_seq_length",)


def as_its_processor_applies(image_processor, processor, processor_kwargs: dict):
    """A copy of ``image_processor`` (whose config already has ``processor_kwargs`` over it) with
    the settings its model's ``processor`` applies over it (``processor_image_defaults``) set,
    except those ``processor_kwargs`` set, and the processor's ``PROCESSOR_SIZING_SETTINGS`` it
    has none of: the image processor as it runs under its model's processor."""
    import copy

    applied = copy.copy(image_processor)
    for name, value in processor_image_defaults(type(processor)).items():
        if name not in processor_kwargs:
            setattr(applied, name, value)
    for name in PROCESSOR_SIZING_SETTINGS:  # an image processor's unset setting is None
        if getattr(applied, name, None) is None and getattr(processor, name, None) is not None:
            setattr(applied, name, getattr(processor, name))
    return applied


def processor_settings(processor) -> dict | None:
    """A transformers image or video processor's effective settings (its ``to_dict()`` after
    ``--mm-processor-kwargs``, as JSON values), with its class: PIL's and torchvision's resize
    differ by up to a quarter of a normalised unit, so the backend decides rows too. None for no
    processor."""
    if processor is None:
        return None
    settings = {
        key: value
        for key, value in processor.to_dict().items()
        if key not in _PROCESSOR_NOISE and not key.startswith("_")
    }
    return _json(settings) | {"class": type(processor).__name__}


def architecture_digest(model_type: str, vision_config) -> str:
    """The digest of a family and its vision config (a transformers config object: the keys that
    differ from the class's defaults, as both sides' transformers read the same checkpoint)."""
    settings = {
        key: value
        for key, value in vision_config.to_diff_dict().items()
        if key not in _CONFIG_NOISE and not key.startswith("_")
    }
    return digest({"model_type": model_type, "vision_config": _json(settings)})


def fingerprint(
    directory: str,
    model_type: str,
    vision_config,
    dtype: str,
    image_processor,
    video_processor,
    layout: RowLayout,
) -> ModelFingerprint:
    """The fingerprint of the model in ``directory`` (a full or vision-only checkpoint) as a
    process runs it: ``dtype`` its tower's, the processors the ones it applies."""
    return ModelFingerprint(
        model_type=model_type,
        architecture=architecture_digest(model_type, vision_config),
        weights=vision_weights_digest(directory),
        dtype=dtype,
        preprocessing=processor_settings(image_processor),
        video=processor_settings(video_processor),
        layout=layout,
    )


def _json(value):
    """``value`` as plain JSON values (tuples as lists, enums and other objects as their text)."""
    import json

    return json.loads(json.dumps(value, default=_plain))


def _plain(value):
    number = getattr(value, "value", None)  # an enum (PIL's resampling filters)
    return number if isinstance(number, (int, float, str)) else str(value)
