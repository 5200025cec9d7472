"""A model's fingerprint as it travels between processes: what determines an item's rows.

Both sides compute it from what they run, never from a name or a flag
(``epdserve.fingerprints``): an encode worker from its tower and processors, an engine (the vLLM
connector, ``epd-prefill``) from what it loaded. Rows enter an engine only from a worker whose
fingerprint equals the engine's (``docs/architecture.md``, invariant 8).

* ``ModelFingerprint``: the whole fingerprint, each part kept so a difference can be named:
  ``architecture`` (the family and its vision config) and ``weights`` (the vision tensors as the
  checkpoint stores them) as digests, the ``dtype``, the image and video processors' effective
  settings (``preprocessing``, ``video``), the row ``layout``. A worker serves it in ``/readyz``;
  an engine in its ``EngineDescription``.
* ``compact``: the short form that travels with every intake item, room registration and commit
  (``CompactFingerprint``: one digest per part, ``.``-separated), from which the parts that differ
  are named without the whole (``compact_differences``).
* ``EngineDescription``: what an engine serves at ``GET /v1/engine`` for a gateway or dispatcher in
  front of it: its fingerprint, its processor kwargs and its per-prompt limits.

Torch-free: the dispatcher and the prefill library import it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue

DIGEST_HEX = 16  # hex digits of each part's digest (64 bits)
PARTS = ("architecture", "weights", "dtype", "preprocessing", "video", "layout")
_DIGEST = f"[0-9a-f]{{{DIGEST_HEX}}}"
CompactFingerprint = Annotated[
    str,
    Field(
        pattern=rf"^{_DIGEST}\.{_DIGEST}\.[a-z0-9]{{1,16}}\.{_DIGEST}\.({_DIGEST}|none)\.{_DIGEST}$",
        max_length=128,
    ),
]
# What a difference in each part means, for an operator.
_MEANING = {
    "architecture": "the vision architecture or its config",
    "weights": "the vision weights",
    "dtype": "the dtype",
    "preprocessing": "the image preprocessing",
    "video": "the video sampling and preprocessing",
    "layout": "the row layout",
}


def digest(value: Any) -> str:
    """The digest of a JSON value (keys sorted), as each part's is spelled."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_HEX]


class RowLayout(BaseModel):
    """What one item's rows look like on the wire: ``[rows, width]``, ``width`` the main embedding
    and its DeepStack levels side by side, ``rows`` = patches / ``merge``²."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    width: int = Field(gt=0, le=1 << 20)
    deepstack_levels: int = Field(ge=0, le=64)
    merge: int = Field(gt=0, le=64)


class ModelFingerprint(BaseModel):
    """What determines an item's rows, part by part (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model_type: str = Field(min_length=1, max_length=64)  # the family, e.g. qwen2_5_vl
    architecture: str = Field(pattern=f"^{_DIGEST}$")
    weights: str = Field(pattern=f"^{_DIGEST}$")
    dtype: str = Field(pattern="^[a-z0-9]{1,16}$")
    preprocessing: dict[str, JsonValue]  # the image processor's effective settings
    video: dict[str, JsonValue] | None = None  # the video processor's; None: no video
    layout: RowLayout

    def part_digests(self) -> dict[str, str]:
        return {
            "architecture": self.architecture,
            "weights": self.weights,
            "dtype": self.dtype,
            "preprocessing": digest(self.preprocessing),
            "video": digest(self.video) if self.video is not None else "none",
            "layout": digest(self.layout.model_dump()),
        }

    @property
    def compact(self) -> str:
        """The short form every item, registration and commit carries."""
        return ".".join(self.part_digests().values())

    def differences(self, other: ModelFingerprint, mine: str, theirs: str) -> list[str]:
        """Each part that differs, said for an operator: the settings by name and value
        (``mine`` and ``theirs`` name the two sides, e.g. "this worker" and "vLLM"); [] when the
        two are the same model."""
        said = []
        for part in compact_differences(self.compact, other.compact):
            if part in ("preprocessing", "video"):
                settings = _settings_differences(
                    getattr(self, part) or {}, getattr(other, part) or {}, mine, theirs
                )
                said.append(f"{_MEANING[part]} differs: {settings}")
            elif part == "dtype":
                said.append(f"the dtype differs: {self.dtype} ({mine}), {other.dtype} ({theirs})")
            elif part == "layout":
                said.append(
                    f"the row layout differs: {self.layout.model_dump()} ({mine}), "
                    f"{other.layout.model_dump()} ({theirs})"
                )
            else:
                type_note = (
                    f" ({self.model_type} against {other.model_type})"
                    if self.model_type != other.model_type
                    else ""
                )
                said.append(
                    f"{_MEANING[part]} differ{type_note}: {getattr(self, part)} ({mine}), "
                    f"{getattr(other, part)} ({theirs})"
                )
        return said


def compact_differences(mine: str, theirs: str) -> list[str]:
    """The parts (``PARTS``) in which two compact fingerprints differ."""
    a, b = mine.split("."), theirs.split(".")
    if len(a) != len(PARTS) or len(b) != len(PARTS):
        return list(PARTS)
    return [part for part, x, y in zip(PARTS, a, b) if x != y]


def say_compact_differences(mine: str, theirs: str, mine_name: str, theirs_name: str) -> str:
    """Why two compact fingerprints are not the same model, in one line."""
    parts = compact_differences(mine, theirs)
    meanings = ", ".join(_MEANING[part] for part in parts)
    return f"another model: {meanings} of {mine_name} and {theirs_name} differ"


def _settings_differences(mine: dict, theirs: dict, mine_name: str, theirs_name: str) -> str:
    keys = sorted(key for key in mine.keys() | theirs.keys() if mine.get(key) != theirs.get(key))
    return "; ".join(
        f"{key} {json.dumps(mine.get(key))} ({mine_name}), "
        f"{json.dumps(theirs.get(key))} ({theirs_name})"
        for key in keys
    )


class EngineDescription(BaseModel):
    """What an engine serves at ``GET /v1/engine`` (the vLLM connector on its ``http_port``,
    ``epd-prefill`` on its port): the model it runs, as it runs it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    served_model_name: str = Field(min_length=1, max_length=256)
    fingerprint: ModelFingerprint
    # the processor kwargs the engine applies over its checkpoint's processor configs
    # (vLLM's --mm-processor-kwargs)
    mm_processor_kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    # items of each modality the engine takes in one prompt (vLLM's --limit-mm-per-prompt)
    limit_mm_per_prompt: dict[str, int] = Field(default_factory=dict)
