"""What a receiver offers a sender, and the limits every wire message shares (no torch here, so
the handshake service imports it without loading torch)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from data_plane.json_fields import json_int

DTYPE_NAMES = ("bfloat16", "float16", "float32", "uint8", "int32", "int64")
MAX_ROOM_ID = (1 << 63) - 1
MAX_ROWS = 1 << 24
MAX_WIDTH = 1 << 20
MAX_BYTES = 1 << 40


class MooncakeOffer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["mooncake"]
    session: str = Field(min_length=3, max_length=300, pattern=r"^[A-Za-z0-9.\-_\[\]:]+:[0-9]{1,5}$")
    address: json_int(gt=0, lt=1 << 64)
    capacity: json_int(gt=0, le=MAX_BYTES)


class ShmOffer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["shm"]
    namespace: str = Field(min_length=1, max_length=128)
    segment: str = Field(pattern=r"^epd-[A-Za-z0-9_-]{1,100}$")
    offset: json_int(ge=0, le=MAX_BYTES)
    capacity: json_int(gt=0, le=MAX_BYTES)


class LoopbackOffer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["loopback"]
    region: json_int(ge=0)
    offset: json_int(ge=0, le=MAX_BYTES)
    capacity: json_int(gt=0, le=MAX_BYTES)


Offer = Annotated[MooncakeOffer | ShmOffer | LoopbackOffer, Field(discriminator="kind")]
