"""An item's room address as it travels between processes (the seed's ``encode_handshake`` dict, typed)."""

from __future__ import annotations

import yarl
from pydantic import BaseModel, ConfigDict, Field

from data_plane.json_fields import json_int
from data_plane.offers import MAX_ROOM_ID


def endpoint_url(scheme: str, host: str, port: int | None = None) -> str:
    """``scheme://host[:port]``, the one place an endpoint's URL is spelled: an IPv6 host is
    bracketed (given with or without brackets); ``ValueError`` for a host that makes no URL."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return str(yarl.URL.build(scheme=scheme, host=host, port=port))


class EncodeHandshake(BaseModel):
    """Where an item's room lives: the encode worker's (or a standalone) handshake endpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bootstrap_room: json_int(ge=1, le=MAX_ROOM_ID)  # rooms are minted in [1, MAX_ROOM_ID]
    bootstrap_host: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:\-\[\]_]+$")
    bootstrap_port: json_int(ge=1, le=65535)

    @property
    def url(self) -> str:
        """``http://host:port`` of the room endpoint (an IPv6 host bracketed, given with or without
        brackets); ``ValueError`` for a host that makes no URL."""
        return endpoint_url("http", self.bootstrap_host, self.bootstrap_port)
