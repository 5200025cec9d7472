"""The modalities, spelled once. ``Modality`` keeps the seed's names (``multimodal.items`` takes it
from here); on the wire (intake messages, ``epd-prefill``'s bodies, metric labels) a modality is
its name, ``"IMAGE"``; where vLLM and OpenAI's API name it, its name in lower case, ``"image"``
(``vllm_name``)."""

from __future__ import annotations

from enum import Enum, auto
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema


class Modality(Enum):
    IMAGE = auto()
    VIDEO = auto()
    AUDIO = auto()

    @property
    def vllm_name(self) -> str:
        """vLLM's and OpenAI's name: ``multi_modal_data`` keys, ``image_url`` parts."""
        return self.name.lower()


ENCODED = (Modality.IMAGE, Modality.VIDEO)  # what the encode workers encode
BY_VLLM_NAME = {modality.vllm_name: modality for modality in ENCODED}


def _encoded(value: object) -> Modality:
    if isinstance(value, Modality) and value in ENCODED:
        return value
    if isinstance(value, str) and value in Modality.__members__:
        modality = Modality[value]
        if modality in ENCODED:
            return modality
    raise ValueError(f"modality must be one of {', '.join(m.name for m in ENCODED)}")


# A modality the encode workers encode, by its name on the wire.
EncodedModality = Annotated[
    Modality,
    BeforeValidator(_encoded),
    PlainSerializer(lambda modality: modality.name, return_type=str),
    WithJsonSchema({"enum": [modality.name for modality in ENCODED], "type": "string"}),
]
