"""What travels in vLLM's ``ec_transfer_params`` for the EPD connector, both ways, vLLM-free so a
gateway imports it without vLLM: the request's rooms (``TransferParams``) and, in the finished
response, how each item's rows were delivered (``DeliveryReport``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.rooms import EncodeTimings
from epdserve.wire.states import ItemState

Identifier = str  # vLLM's multimodal identifier of an item (its multi_modal_uuids value)
# The model types (``vision.families`` entries) whose encoder rows the EPD connector hands vLLM,
# each run end to end by tests/test_vllm_connector.py; here, below the vision stack, because the
# connector inside vLLM imports nothing above the prefill wing. A row is ``row_shape`` wide.
MODEL_TYPES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "gemma3",
    "internvl",
)


def row_shape(config) -> tuple[int, int]:
    """One row of a model of ``config`` (a full model's transformers config, or vLLM's copy of
    it; or a vision-only tower's config): its main width (the LLM's hidden size: the text
    config's, else the tower's output width) and its DeepStack levels, each as wide again,
    concatenated after it (vLLM's ``embed_multimodal`` layout)."""
    vision = getattr(config, "vision_config", None) or config
    text = getattr(config, "text_config", None)
    if text is not None:
        out_width = text.hidden_size
    else:
        out_width = getattr(vision, "out_hidden_size", None) or vision.hidden_size
    return out_width, len(getattr(vision, "deepstack_visual_indexes", None) or [])


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
