"""Every multimodal architecture vLLM registers, with its status here: the table of
``docs/models.md``, made by ``python -m epdserve.vision.vllm_architectures`` and checked against
the installed vLLM by ``tests/test_models_doc.py`` (so it cannot go stale). A status follows from
the family registry (``vision.families``) and from what transformers has; the reasons no registry
can give are ``AUDIO_ONLY`` here."""

from __future__ import annotations

import transformers

from epdserve.vision.families import FAMILIES
from epdserve.wire.ec_params import MODEL_TYPES

# vLLM's model modules whose models take audio and no image or video: nothing for an encode
# worker of vision towers to encode.
AUDIO_ONLY = frozenset(
    {
        "audioflamingo3",
        "cohere_asr",
        "fireredasr2",
        "funasr",
        "funaudiochat",
        "glmasr",
        "granite_speech",
        "granite_speech_plus",
        "kimi_audio",
        "midashenglm",
        "moss_audio",
        "moss_transcribe_diarize",
        "qwen2_audio",
        "qwen3_asr",
        "qwen3_asr_realtime",
        "ultravox",
        "voxtral",
        "voxtral_realtime",
        "whisper",
    }
)
BEGIN = "<!-- vllm-architectures: begin -->"
END = "<!-- vllm-architectures: end -->"


def registered() -> dict[str, str]:
    """vLLM's multimodal architectures, each with the module of its model code
    (``vllm.model_executor.models.registry``)."""
    from vllm.model_executor.models.registry import _MULTIMODAL_MODELS

    return {name: module for name, (module, _) in _MULTIMODAL_MODELS.items()}


def status(architecture: str, module: str) -> str:
    """What this project does with a checkpoint of ``architecture`` (vLLM's model code in
    ``module``)."""
    for name, entry in FAMILIES.items():
        if entry.vlm.__name__ == architecture:
            if name in MODEL_TYPES:
                return f"supported (`{name}`)"
            return f"encode worker only (`{name}`): the vLLM connector refuses it, not yet tested"
    if module in AUDIO_ONLY:
        return "not applicable: audio only, no vision tower"
    if not hasattr(transformers, architecture):
        return (
            "not yet: transformers has no class of it (remote code or vLLM's own), so no tower "
            "for the encode worker"
        )
    return "not yet: transformers has its classes (a `TowerFamily` entry away)"


def table() -> str:
    """The markdown table of every registered architecture, sorted by name."""
    lines = ["| vLLM architecture | vLLM module | status here |", "|---|---|---|"]
    for architecture, module in sorted(registered().items()):
        lines.append(f"| `{architecture}` | `{module}` | {status(architecture, module)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(BEGIN)
    print(table())
    print(END)
