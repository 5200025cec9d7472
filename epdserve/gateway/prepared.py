"""A chat request ready for vLLM (``PreparedChat``): the client's body, its images and videos,
where each was placed; the body vLLM gets as the items stand; the ``epd`` report the answer
carries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from PIL import Image
from pydantic import BaseModel

from epdserve.dispatcher.media import DispatchedItem
from epdserve.gateway.chat import CarriedMedia, EncodedMedia, InlineMedia, MediaRef, rewrite
from epdserve.gateway.placement import Prediction, Reason
from epdserve.wire.ec_params import DeliveryReport, ItemDelivery, identifier
from epdserve.wire.modality import Modality


@dataclass
class PreparedChat:
    """A request ready for vLLM: the client's body, its images and videos, and where each was
    placed."""

    request_id: str
    original: dict  # the client's body
    stream: bool
    refs: list[MediaRef] = field(default_factory=list)
    items: list[DispatchedItem] = field(default_factory=list)  # one per distinct item
    of_ref: list[int] = field(default_factory=list)  # the item of each image or video part
    dispatch_s: float = 0.0
    staged_s: float = 0.0  # placed -> every placed item's rows held by its worker
    video_seconds: bool = False  # the model's positions take a video's seconds per patch
    video_timestamps: bool = False  # the model's prompt states each temporal patch's time
    # vLLM takes a placed item as its grid alone; False: the part carries the item itself
    # (TowerFamily.grid_only_requests)
    grid_only_requests: bool = True
    reasons: dict[int, Reason] = field(default_factory=dict)  # why each item went where it did
    inline_patches: int = 0  # of the items vLLM encodes inline, held in the gateway's budget
    prediction: Prediction | None = None  # --placement cost: each route's time to first token

    @property
    def placed(self) -> list[DispatchedItem]:
        """The items an encode worker delivers (they have a room)."""
        return [item for item in self.items if item.worker is not None]

    def vllm_body(self) -> dict:
        """The body for vLLM as the items stand: a placed item named by its identifier, with its
        room in ``ec_transfer_params`` (``_placed_part``); any other inline (vLLM encodes it)."""
        # vLLM refuses a prompt mixing a kind's grid-only parts with that kind's items ("Mixing
        # raw image and embedding inputs is not allowed"): a kind with an item inline carries
        # its placed items too
        inline_kinds = {
            ref.kind
            for ref, index in zip(self.refs, self.of_ref)
            if self.items[index].worker is None
        }
        media, rooms = [], {}
        for ref, index in zip(self.refs, self.of_ref):
            item = self.items[index]
            if item.worker is not None:
                key = identifier(item.content_hash)
                media.append(self._placed_part(ref, item, key, carried=ref.kind in inline_kinds))
                rooms[key] = item.encode_handshake.model_dump()
            else:
                media.append(InlineMedia.of(ref, item.data, _media_type(item)))
        return rewrite(self.original, self.refs, media, rooms) if self.refs else self.original

    def _placed_part(
        self, ref: MediaRef, item: DispatchedItem, key: str, carried: bool
    ) -> EncodedMedia | CarriedMedia:
        """What vLLM gets of an item an encode worker delivers: its patch grid (and a video's
        times, where the model takes them) where vLLM takes a request of grids alone, so its
        front end decodes nothing; else (or ``carried``: an item of its kind goes inline) the
        item itself, as the bytes the gateway hashed (a client's ``data:`` URI as sent, a
        fetched URL's bytes as one: vLLM must preprocess what the worker encoded, and fetches
        nothing)."""
        if carried or not self.grid_only_requests:
            return CarriedMedia(key, InlineMedia.of(ref, item.data, _media_type(item)))
        seconds = item.seconds_per_grid_t if self.video_seconds else None
        times = item.patch_times if self.video_timestamps else None
        return EncodedMedia(key, item.grid_thw, ref.kind, seconds, times)

    def report(self, delivery: DeliveryReport | None) -> GatewayReport:
        images = []
        predicted = self.prediction
        for item in self.items:
            key = identifier(item.content_hash)
            images.append(
                ImageReport(
                    identifier=key,
                    encoder="encode_worker" if item.worker else "colocated",
                    reason=self.reasons.get(item.index),
                    worker=item.worker,
                    rows=item.rows,
                    error=item.error,
                    dispatch_ms=round(item.dispatch_s * 1e3, 3),
                    predicted_encode_worker_ms=_ms(predicted and predicted.encode_worker_s),
                    predicted_vllm_ms=_ms(predicted and predicted.vllm_s),
                    delivery=delivery.items.get(key) if delivery is not None else None,
                )
            )
        return GatewayReport(
            request_id=self.request_id,
            dispatch_ms=round(self.dispatch_s * 1e3, 3),
            staged_ms=round(self.staged_s * 1e3, 3),
            images=images,
        )


class ImageReport(BaseModel):
    """One distinct image of a request: who encoded it, and how its rows reached vLLM."""

    identifier: str  # its content hash, vLLM's identifier of the item
    encoder: Literal["encode_worker", "colocated"]
    reason: Reason | None = None  # why there (gateway.placement.Reason)
    worker: str | None  # the encode worker that took it
    rows: int
    error: str | None  # why it went to vLLM inline instead
    dispatch_ms: float  # request start -> the worker's acknowledgement
    # --placement cost: the request's time to first token predicted by each route (None: the
    # policy did not predict it)
    predicted_encode_worker_ms: float | None = None
    predicted_vllm_ms: float | None = None
    delivery: ItemDelivery | None = None  # the EPD connector's report (non-streaming answers)


class GatewayReport(BaseModel):
    """The ``epd`` field the gateway adds to a non-streaming answer."""

    request_id: str  # the gateway's id (the encode workers' logs name items by it)
    dispatch_ms: float  # request start -> every image placed (or not)
    staged_ms: float  # placed -> every placed image's rows held by its worker, before vLLM
    images: list[ImageReport]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _media_type(item: DispatchedItem) -> str:
    if item.modality is Modality.VIDEO:  # PyAV's container names
        return "video/webm" if "webm" in item.image_format else "video/mp4"
    return Image.MIME.get(item.image_format, "application/octet-stream")
