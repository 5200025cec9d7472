"""The transport registry: each transport's offer (what a receiver offers a sender) and its
declaration, and the limits every wire message shares. No torch here, so the handshake service
imports it without loading torch.

A transport declares itself once, in ``TRANSPORTS``: its name on the wire, its offer model, the
``Transport`` class that implements it (a module of its own, imported only by a process that builds
it: ``data_plane.transport.build_transports``), and what the processes around it must do for it.
The order of ``TRANSPORTS`` is the sender's preference. Everything else reads this: the sender's
choice, which transports the encode worker registers its send ring with, the handshake models'
transport names and offers list, ``--transports``, and the receiver's pool memory.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from epdserve.wire.json_fields import json_int

DTYPE_NAMES = ("bfloat16", "float16", "float32", "uint8", "int32", "int64")
MAX_ROOM_ID = (1 << 63) - 1
MAX_ROWS = 1 << 24
MAX_WIDTH = 1 << 20
MAX_BYTES = 1 << 40


def drawn_room_id() -> int:
    """A room id drawn at random from [1, ``MAX_ROOM_ID``] (a dispatcher's, a table's mint): ids
    are never reused, and 63 random bits make a clash negligible."""
    return secrets.randbelow(MAX_ROOM_ID) + 1


class OfferModel(BaseModel):
    """An offer: ``kind`` (the transport's name) and ``capacity`` (bytes the slot holds), plus
    where to write. Offers name a byte ``offset`` in their own address space unless they say
    otherwise in ``span``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def span(self) -> tuple[int, int]:
        """``(start, end)``: the offered slot's first byte and the end of its address space (a
        registration whose ``start + capacity`` passes ``end`` is refused)."""
        return self.offset, MAX_BYTES


class ShmOffer(OfferModel):
    kind: Literal["shm"]
    namespace: str = Field(min_length=1, max_length=128)
    segment: str = Field(pattern=r"^epd-[A-Za-z0-9_-]{1,100}$")
    offset: json_int(ge=0, le=MAX_BYTES)
    capacity: json_int(gt=0, le=MAX_BYTES)


class MooncakeOffer(OfferModel):
    kind: Literal["mooncake"]
    session: str = Field(
        min_length=3, max_length=300, pattern=r"^[A-Za-z0-9.\-_\[\]:]+:[0-9]{1,5}$"
    )
    address: json_int(gt=0, lt=1 << 64)
    capacity: json_int(gt=0, le=MAX_BYTES)

    def span(self) -> tuple[int, int]:
        return self.address, 1 << 64


class LoopbackOffer(OfferModel):
    kind: Literal["loopback"]
    region: json_int(ge=0)
    offset: json_int(ge=0, le=MAX_BYTES)
    capacity: json_int(gt=0, le=MAX_BYTES)


@dataclass(frozen=True)
class TransportSpec:
    name: str  # on the wire: the offer's ``kind``, and ``transport`` in begin_write and commit
    offer: type[OfferModel]  # its ``kind`` is ``Literal[name]``
    # "module:Class" of its ``data_plane.transport.Transport``; ``Class.from_config(config)`` builds
    # it from the transport's own settings object (None: its defaults)
    implementation: str
    # the sender's source memory (the encode worker's send ring) must be registered with it
    registers_send_memory: bool = False
    # writers reach the receive pool only through its /dev/shm segment: a receiver whose pool is
    # not (or no longer) such a segment does not offer it
    needs_shm_pool: bool = False


TRANSPORTS: tuple[TransportSpec, ...] = (  # the sender's preference, first to last
    TransportSpec(
        "shm", ShmOffer, "epdserve.data_plane.shm_transport:ShmTransport", needs_shm_pool=True
    ),
    TransportSpec(
        "mooncake",
        MooncakeOffer,
        "epdserve.data_plane.mooncake:MooncakeTransport",
        registers_send_memory=True,
    ),
    TransportSpec("loopback", LoopbackOffer, "epdserve.data_plane.loopback:LoopbackTransport"),
)
TRANSPORT_NAMES = tuple(spec.name for spec in TRANSPORTS)
DEFAULT_TRANSPORTS = ("shm", "mooncake")  # what a process offers or uses unless told otherwise
_BY_NAME = {spec.name: spec for spec in TRANSPORTS}
assert all(spec.offer.model_fields["kind"].annotation == Literal[spec.name] for spec in TRANSPORTS)

TransportName = Literal[TRANSPORT_NAMES]
Offer = Annotated[Union[tuple(spec.offer for spec in TRANSPORTS)], Field(discriminator="kind")]
MAX_OFFERS = len(TRANSPORTS)  # a registration offers each transport at most once


def transport_spec(name: str) -> TransportSpec:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}") from None
