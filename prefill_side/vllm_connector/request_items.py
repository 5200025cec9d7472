"""What a vLLM request asks the connector to receive: its ``ec_transfer_params`` read against its
multimodal features, each item with a room made the receiver's item (its placeholder offsets, the
grid vLLM placed, its room), or the reason the request cannot be served."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError

from epdserve.multimodal.items import MultimodalDataItem
from epdserve.wire.ec_params import Identifier, TransferParams
from epdserve.wire.modality import BY_VLLM_NAME

if TYPE_CHECKING:
    from vllm.v1.request import Request

# Keys of an item's processed data that only size its placeholders: an item with nothing else
# carries no media, so vLLM's tower cannot encode it.
PLACEHOLDER_KEYS = frozenset({"image_grid_thw", "video_grid_thw"})

RoomsKey = frozenset  # of (identifier, host, port, room id): the rooms a request receives from


class RequestRefused(ValueError):
    """The request's rooms cannot be received; the message says why."""


@dataclass(frozen=True)
class RequestItems:
    """A request's items that have rooms, as the receiver takes them."""

    rooms: RoomsKey
    items: list[MultimodalDataItem]
    slots: dict[Identifier, int]  # identifier -> its item's index in ``items``


def request_items(request: Request) -> RequestItems:
    """The items ``request``'s ``ec_transfer_params`` name rooms for; ``RequestRefused`` when the
    parameters do not validate, name a room for no item of the request or for an item of another
    modality, or an item has neither its media nor a room."""
    try:
        params = TransferParams.model_validate(request.ec_transfer_params)
    except ValidationError as exc:
        raise RequestRefused(f"invalid ec_transfer_params: {exc}") from None
    items, slots = [], {}
    for key, handshake in params.rooms.items():
        index = next((i for i, f in enumerate(request.mm_features) if f.identifier == key), None)
        if index is None:
            raise RequestRefused(
                f"ec_transfer_params names a room for {key!r}, which is no item of this request"
            )
        feature = request.mm_features[index]
        if feature.modality not in BY_VLLM_NAME:
            raise RequestRefused(
                f"item {key!r} is {feature.modality}: only "
                f"{', '.join(BY_VLLM_NAME)} rows are received"
            )
        rows = request.get_num_encoder_embeds(index)
        known = {}
        grid = _placeholder_data(feature).get(f"{feature.modality}_grid_thw")
        if grid is not None:  # the receiver checks the encoder's grid against the one vLLM placed
            known[f"{feature.modality}_grid_thw"] = grid.reshape(1, 3)
        slots[key] = len(items)
        start = feature.mm_position.offset
        items.append(
            MultimodalDataItem(
                BY_VLLM_NAME[feature.modality],
                offsets=[[start, start + rows - 1]],
                model_specific_data=known,
                encode_handshake=handshake.model_dump(),
            )
        )
    bare = [
        f.identifier
        for f in request.mm_features
        if f.identifier not in params.rooms and not carries_media(f)
    ]
    if bare:
        raise RequestRefused(f"items {', '.join(bare)} carry neither their media nor a room")
    rooms = frozenset(
        (key, room.bootstrap_host, room.bootstrap_port, room.bootstrap_room)
        for key, room in params.rooms.items()
    )
    return RequestItems(rooms, items, slots)


def _placeholder_data(feature) -> dict[str, torch.Tensor]:
    """The tensors of an item's processed data ({} when vLLM holds none for it)."""
    return feature.data.get_data() if feature.data is not None else {}


def carries_media(feature) -> bool:
    """Whether the request sent the item itself (vLLM's tower can encode it), not just its grid."""
    return bool(set(_placeholder_data(feature)) - PLACEHOLDER_KEYS)
