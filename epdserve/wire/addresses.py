"""Addresses as they travel between processes: an ``Endpoint`` (host and port, spelled in one
place) and an item's room address (the seed's ``encode_handshake`` dict, typed)."""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

import yarl
from pydantic import BaseModel, ConfigDict, Field

from epdserve.wire.json_fields import json_int
from epdserve.wire.offers import MAX_ROOM_ID

# An encode worker's ports unless configured: the bootstrap (rooms) port avoids SGLang's PD
# bootstrap port (8998), so the two can share a node.
DEFAULT_BOOTSTRAP_PORT = 8990
DEFAULT_INTAKE_PORT = 8999
# Endpoints a process has spelled lately, kept with their URL and canonical host: every item names
# its room's endpoint, and a deployment has a few (yarl and ipaddress cost ~10 us per item).
ADDRESS_CACHE = 1024
HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})")  # a DNS name or an IPv4 address


@functools.lru_cache(maxsize=ADDRESS_CACHE)
def endpoint_url(scheme: str, host: str, port: int | None = None) -> str:
    """``scheme://host[:port]``, the one place an endpoint's URL is spelled: an IPv6 host is
    bracketed (given with or without brackets); ``ValueError`` for a host that makes no URL.
    Without a port for an address that has none yet (a bind to a random port)."""
    return str(yarl.URL.build(scheme=scheme, host=_bare(host), port=port))


def split_authority(text: str, max_ports: int) -> tuple[str, list[int]]:
    """``host[:port...]`` or ``[ipv6][:port...]`` with at most ``max_ports`` ports: the bare host
    and the ports. ``ValueError`` says what is wrong (without naming ``text``)."""
    text = text.strip()
    if text.startswith("["):
        v6, bracket, rest = text[1:].partition("]")
        try:
            ipaddress.IPv6Address(v6)
        except ValueError:
            raise ValueError(f"{v6!r} is not an IPv6 address") from None
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError("expected [ipv6] then :port fields")
        parts = [v6, *rest[1:].split(":")] if rest else [v6]
    else:
        parts = text.split(":")
        if parts[0] and not HOST_NAME.fullmatch(parts[0]):
            raise ValueError(
                f"{parts[0]!r} is not a host name or IPv4 address (an IPv6 address goes in "
                "brackets)"
            )
    if not parts[0] or len(parts) > 1 + max_ports:
        raise ValueError(f"expected a host then at most {max_ports} :port fields")
    try:
        ports = [int(p) for p in parts[1:]]
    except ValueError:
        raise ValueError("ports must be numbers") from None
    if any(not 0 < p < 65536 for p in ports):
        raise ValueError("ports must be in 1..65535")
    return parts[0], ports


@dataclass(frozen=True)
class Endpoint:
    """A host and a port, the one type every process uses to reach another. The host is kept bare
    (an IPv6 address without brackets, an IP address in its canonical form), so two spellings of
    one endpoint are equal and hash alike; ``authority`` and ``url`` bracket an IPv6 host."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not _bare(self.host):
            raise ValueError("an endpoint needs a host")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is not in 1..65535")
        object.__setattr__(self, "host", canonical_host(self.host))

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """``host:port`` or ``[ipv6]:port``; ``ValueError`` naming ``text`` otherwise."""
        try:
            host, ports = split_authority(text, 1)
        except ValueError as exc:
            raise ValueError(f"endpoint {text!r}: {exc}") from None
        if not ports:
            raise ValueError(f"endpoint {text!r}: no port")
        return cls(host, ports[0])

    @property
    def authority(self) -> str:
        """``host:port``, ``[ipv6]:port`` for an IPv6 host (what ``parse`` reads back)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def url(self, scheme: str) -> str:
        """``scheme://authority``; ``ValueError`` for a host that makes no URL."""
        return endpoint_url(scheme, self.host, self.port)

    def __str__(self) -> str:
        return self.authority


def _bare(host: str) -> str:
    """The host without the brackets an IPv6 address may come in."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@functools.lru_cache(maxsize=ADDRESS_CACHE)
def canonical_host(host: str) -> str:
    """A host as endpoints compare it: an IPv6 address without brackets, an IP address in its
    canonical form (``0:0::1`` is ``::1``), a DNS name as given."""
    host = _bare(host)
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:  # not an IP address: a DNS name
        return host


class EncodeHandshake(BaseModel):
    """Where an item's room lives: the encode worker's (or a standalone) handshake endpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bootstrap_room: json_int(ge=1, le=MAX_ROOM_ID)  # rooms are minted in [1, MAX_ROOM_ID]
    bootstrap_host: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:\-\[\]_]+$")
    bootstrap_port: json_int(ge=1, le=65535)
    # the deployment's signature of this address (wire.room_signatures): a process with a handshake
    # token calls no room endpoint whose address is not signed with it
    signature: str | None = Field(None, pattern=r"^v1\.[0-9]{1,12}\.[0-9a-f]{64}$")

    @classmethod
    def at(cls, endpoint: Endpoint, room: int) -> EncodeHandshake:
        """Room ``room`` at ``endpoint`` (the host travels bare)."""
        return cls(bootstrap_room=room, bootstrap_host=endpoint.host, bootstrap_port=endpoint.port)

    @functools.cached_property
    def endpoint(self) -> Endpoint:
        """The room endpoint (equal whether the host came bracketed or not); made once per
        address (several calls per item read it)."""
        return Endpoint(self.bootstrap_host, self.bootstrap_port)

    @property
    def url(self) -> str:
        """``http://host:port`` of the room endpoint (an IPv6 host bracketed, given with or without
        brackets); ``ValueError`` for a host that makes no URL."""
        return self.endpoint.url("http")
