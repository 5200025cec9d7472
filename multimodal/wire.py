"""What of an item travels between processes: metadata only, never ``encoded`` or feature tensors."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from data_plane.json_fields import json_int
from data_plane.offers import MAX_ROOM_ID
from multimodal.items import Modality, MultimodalDataItem
from multimodal.rows import item_rows

MAX_SPANS = 4096


class EncodeHandshake(BaseModel):
    """Where an item's room lives: the encode worker's (or a standalone) handshake endpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bootstrap_room: json_int(ge=0, le=MAX_ROOM_ID)
    bootstrap_host: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:\-\[\]_]+$")
    bootstrap_port: json_int(ge=1, le=65535)


class ItemMetadata(BaseModel):
    """The wire form of a ``MultimodalDataItem``: everything except tensors.

    ``model_specific_data`` must hold JSON values; tensors in it (such as ``image_grid_thw``)
    are sent as nested lists.
    """

    model_config = ConfigDict(extra="forbid")

    modality: str = Field(pattern=r"^(IMAGE|VIDEO|AUDIO)$")
    hash: json_int(ge=0, lt=1 << 128) | None = None
    pad_value: json_int(ge=0) | None = None
    offsets: list[tuple[int, int]] | None = Field(default=None, max_length=MAX_SPANS)
    model_specific_data: dict[str, Any] = Field(default_factory=dict)
    encode_handshake: EncodeHandshake | None = None

    @property
    def rows(self) -> int:
        return item_rows(self.offsets)

    @classmethod
    def from_item(cls, item: MultimodalDataItem) -> ItemMetadata:
        extra = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in item.model_specific_data.items()}
        return cls(
            modality=item.modality.name,
            hash=item.hash,
            pad_value=item.pad_value,
            offsets=[tuple(span) for span in item.offsets] if item.offsets is not None else None,
            model_specific_data=extra,
            encode_handshake=EncodeHandshake(**item.encode_handshake) if item.encode_handshake else None,
        )

    def to_item(self) -> MultimodalDataItem:
        return MultimodalDataItem(
            modality=Modality[self.modality],
            hash=self.hash,
            pad_value=self.pad_value,
            offsets=[list(span) for span in self.offsets] if self.offsets is not None else None,
            model_specific_data=dict(self.model_specific_data),
            encode_handshake=self.encode_handshake.model_dump() if self.encode_handshake else None,
        )
