"""Multimodal request items, with the seed's names and semantics.

``MultimodalDataItem`` is one image / video / audio clip of a request. On an EPD prefill engine its
``encoded`` (and ``encoded_deepstack``) rows arrive from an encode worker named by
``encode_handshake`` instead of being computed by a local tower.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

import numpy as np
import torch

from epdserve.data_plane.shm import ShmTensorHandle
from epdserve.multimodal.hashing import hash_feature
from epdserve.wire.modality import Modality

# A placeholder token's id is rewritten to ``MM_PAD_BASE + (hash & MM_PAD_HASH_MASK)`` so that
# repeated features share a substitute id and prefix-match in a text-only prefix cache. The base
# sits above any text vocabulary; the 30-bit mask keeps cross-hash collisions rare (~1e9 ids).
MM_PAD_BASE = 1_000_000
MM_PAD_HASH_MASK = (1 << 30) - 1

# The seed's switch, read by ``ensure_hash`` only: set to 1, an engine gives every item it hashes
# a random id (no pad-id sharing). It does not reach the dispatcher or the encode workers, whose
# keys are the bytes' hash (turn the worker's cache off with ``--cache-bytes 0``).
SKIP_COMPUTE_HASH_ENV = "EPD_MM_SKIP_COMPUTE_HASH"


def is_mm_pad_value(token_ids: torch.Tensor) -> torch.Tensor:
    """Bool mask of the positions holding a hash-derived multimodal pad id."""
    return (token_ids >= MM_PAD_BASE) & (token_ids <= MM_PAD_BASE + MM_PAD_HASH_MASK)


def maybe_substitute_mm_pad(input_ids: torch.Tensor, substitute_id: int | None) -> torch.Tensor:
    """Replace hash pad ids with ``substitute_id``; returns ``input_ids`` unchanged for None."""
    if substitute_id is None:
        return input_ids
    return input_ids.masked_fill(is_mm_pad_value(input_ids), substitute_id)


# Where an item's ``model_specific_data`` holds its patch grid ``[[t, h, w]]``, by modality (the
# names transformers' and vLLM's Qwen-VL processors give it).
GRID_KEYS = {Modality.IMAGE: "image_grid_thw", Modality.VIDEO: "video_grid_thw"}


def _skip_compute_hash() -> bool:
    return os.environ.get(SKIP_COMPUTE_HASH_ENV, "").strip().lower() in {"1", "true", "yes"}


# ``eq=False``: tensor fields break the generated element-wise ``__eq__`` and ``__hash__``.
@dataclasses.dataclass(eq=False)
class MultimodalDataItem:
    modality: Modality
    hash: int | None = None
    pad_value: int | None = None
    offsets: list | None = None
    feature: torch.Tensor | np.ndarray | ShmTensorHandle | None = None
    model_specific_data: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Encoder output, set once (by a local tower or by an encode worker's commit) and reused by
    # every chunked-prefill step of the request. Never sent on the wire.
    encoded: torch.Tensor | None = None
    encoded_deepstack: torch.Tensor | None = None
    # EPD: ``{bootstrap_room, bootstrap_host, bootstrap_port}`` naming the handshake endpoint of
    # this item's room (one room per item). None leaves the item to a local tower.
    encode_handshake: dict | None = None

    def __getattr__(self, name: str):
        extra = self.__dict__.get("model_specific_data")
        if extra is not None and name in extra:
            return extra[name]
        raise AttributeError(f"'{type(self).__name__}' has no attribute '{name}'")

    def ensure_hash(self) -> None:
        """Resolve ``hash`` lazily.

        Order: the skip env var gives a random id (dedup off); a hash already set (the gateway's
        content hash) is kept; an inline feature is hashed here; an SHM-backed feature without a
        hash is an error, since hashing it would mean reading shared memory.
        """
        if _skip_compute_hash():
            self.hash = uuid.uuid4().int
        elif self.hash is None:
            if isinstance(self.feature, ShmTensorHandle):
                raise ValueError(
                    "SHM-backed multimodal items must carry a content hash or pad_value"
                )
            if self.feature is None:
                raise ValueError("item has neither a hash nor a feature to hash")
            self.hash = hash_feature(self.feature)

    def set_pad_value(self) -> None:
        if self.pad_value is not None:
            return
        self.ensure_hash()
        self.pad_value = MM_PAD_BASE + (self.hash & MM_PAD_HASH_MASK)

    def is_modality(self, modality: Modality) -> bool:
        return self.modality == modality


@dataclasses.dataclass(eq=False)
class MultimodalInputs:
    mm_items: list[MultimodalDataItem]
    im_token_id: int | None = None
    video_token_id: int | None = None
    mrope_positions: torch.Tensor | None = None
    mrope_position_delta: torch.Tensor | None = None
    mrope_position_delta_scalar: int | None = None
    mrope_position_delta_repeated_cache: torch.Tensor | None = None

    def ensure_pad_values(self) -> None:
        for item in self.mm_items:
            item.set_pad_value()

    def publish_shm_features(self) -> None:
        for item in self.mm_items:
            if isinstance(item.feature, torch.Tensor):
                item.feature = ShmTensorHandle.publish(item.feature)

    def attach_shm_features(self) -> None:
        for item in self.mm_items:
            if isinstance(item.feature, ShmTensorHandle):
                item.feature.attach()

    def release_shm_features(self) -> None:
        for item in self.mm_items:
            if isinstance(item.feature, ShmTensorHandle):
                item.feature.release()
                item.feature = None

    def has_pending_shm_features(self) -> bool:
        return any(isinstance(item.feature, ShmTensorHandle) for item in self.mm_items)
