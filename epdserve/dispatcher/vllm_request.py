"""A vLLM offline request (``LLM.generate``) from dispatched items, with their rooms in
``ec_transfer_params``: how a gateway of one's own would call vLLM with the EPD connector (the
tests and ``epd-bench vllm`` do)."""

from __future__ import annotations

import torch

from epdserve.dispatcher.media import DispatchedItem
from epdserve.multimodal.items import GRID_KEYS
from epdserve.vision.families import FAMILIES
from epdserve.wire.ec_params import identifier
from epdserve.wire.modality import BY_VLLM_NAME, Modality


def vllm_request(
    prompt: str,
    items: list[DispatchedItem],
    order: list[int] | None = None,
    images: list | None = None,
    model_type: str = "qwen2_vl",
) -> tuple[dict, dict | None]:
    """``(prompt, ec_transfer_params)`` for ``LLM.generate`` from dispatched items: one item per
    distinct image or video (a repeated one is dispatched once), ``order`` the item of each
    placeholder in the prompt, images and videos each in their own order (default: each item
    once, in order). ``images``: each item's decoded media (a PIL image; a video's frames, with
    its metadata where the model needs it), sent along so that vLLM's tower encodes an item whose
    room fails; None sends the patch grids alone (the prefill engine decodes and preprocesses
    nothing; a failed room fails the request). ``model_type``: the served model's
    (``FAMILIES``: whether a video's seconds per temporal patch, or its patches' times, go
    along). ``ValueError`` when an item has no room (the dispatcher could not place it) and no
    media is sent: nothing could encode it; or when no media is sent for a model that takes no
    request of grids alone (Gemma 3: ``TowerFamily.grid_only_requests``)."""
    order = list(range(len(items))) if order is None else order
    if images is None and not FAMILIES[model_type].grid_only_requests:
        raise ValueError(f"{model_type} takes no request of grids alone: send the images")
    if images is None and any(item.encode_handshake is None or item.error for item in items):
        raise ValueError(
            "an item has no room ("
            + "; ".join(str(item.error) for item in items if item.error)
            + "): send the images"
        )
    rooms = {
        identifier(item.content_hash): item.encode_handshake.model_dump()
        for item in items
        if item.encode_handshake is not None and item.error is None
    }
    data, uuids = {}, {}
    for name, modality in BY_VLLM_NAME.items():
        placed = [i for i in order if items[i].modality is modality]
        if not placed:
            continue
        uuids[name] = [identifier(items[i].content_hash) for i in placed]
        if images is not None:
            data[name] = [images[i] for i in placed]
            continue
        data[name] = {GRID_KEYS[modality]: torch.tensor([list(items[i].grid_thw) for i in placed])}
        if modality is Modality.VIDEO and FAMILIES[model_type].video_seconds:
            data[name]["second_per_grid_ts"] = torch.tensor(
                [items[i].seconds_per_grid_t for i in placed]
            )
        if modality is Modality.VIDEO and FAMILIES[model_type].video_timestamps:
            data[name]["timestamps"] = [torch.tensor(items[i].patch_times) for i in placed]
    request = {"prompt": prompt, "multi_modal_data": data, "multi_modal_uuids": uuids}
    return request, ({"rooms": rooms} if rooms else None)
