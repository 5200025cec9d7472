"""What travels in vLLM's ``ec_transfer_params`` for the EPD connector, both ways, vLLM-free so a
gateway imports it without vLLM: the request's rooms (``TransferParams``) and, in the finished
response, how each item's rows were delivered (``DeliveryReport``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.rooms import EncodeTimings
from epdserve.wire.states import ItemState

Identifier = str  # vLLM's multimodal identifier of an item (its multi_modal_uuids value)


def identifier(content_hash: int) -> Identifier:
    """An item's vLLM identifier (``multi_modal_uuids``) from its content hash (xxh3-128)."""
    return f"{content_hash:032x}"


class TransferParams(BaseModel):
    """A request's ``ec_transfer_params``: the room of each item the encode workers deliver,
    keyed by the item's identifier."""

    model_config = ConfigDict(extra="forbid")

    rooms: dict[Identifier, EncodeHandshake] = Field(min_length=1, max_length=256)


class ItemDelivery(BaseModel):
    """One item with a room: whether its rows arrived, how, and where the time went."""

    model_config = ConfigDict(extra="forbid")

    state: (
        ItemState  # DONE: the rows arrived; FAILED: vLLM's tower encoded it, or the request failed
    )
    transport: str | None = None  # shm / mooncake / loopback
    reason: str | None = None  # why it did not arrive
    receive_s: float = 0.0  # the scheduler first saw the request -> rows in the pool (or failure)
    encoder: EncodeTimings | None = None  # the encode worker's split, from its commit


class DeliveryReport(BaseModel):
    """The finished response's ``ec_transfer_params`` for a request that had rooms."""

    model_config = ConfigDict(extra="forbid")

    items: dict[Identifier, ItemDelivery]
