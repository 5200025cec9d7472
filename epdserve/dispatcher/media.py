"""A request's media as the dispatcher places it: each item hashed (xxh3-128 of its bytes, as the
encode worker computes it) and sized from its header alone (``MediaSizer``), as a
``DispatchedItem``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epdserve.multimodal.hashing import hash_feature
from epdserve.multimodal.items import GRID_KEYS, MultimodalDataItem
from epdserve.vision.image_files import FormatNotTaken
from epdserve.vision.image_files import header as image_header
from epdserve.vision.limits import MAX_PIXELS
from epdserve.vision.sizing import QWEN_VL, Sizing, patch_times, sample_and_size
from epdserve.vision.video import BadVideo, ContainerNotTaken, frame_size, read_header
from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.modality import Modality

MAX_IMAGES = 64  # items (images and videos) per request
MAX_IMAGE_BYTES = 64 << 20  # per item, a video's too


class DispatchError(ValueError):
    """The request cannot be dispatched at all (bad input); no room was named and nothing sent."""


@dataclass(frozen=True)
class Media:
    """One item of a request as the client sent it: an image file, or a video file (MP4/MOV)."""

    data: bytes
    modality: Modality = Modality.IMAGE


@dataclass
class DispatchedItem:
    index: int
    data: bytes  # the image or video file
    content_hash: int
    width: int  # pixels (a video's frames')
    height: int
    grid_thw: tuple[int, int, int]
    rows: int
    encode_handshake: EncodeHandshake | None = None  # the room the prefill side registers in
    worker: str | None = None  # the encode worker that accepted the item
    # why no worker took it; such an item comes back without a room (the caller encodes it
    # itself, or fails it with this reason)
    error: str | None = None
    attempts: list[str] = field(default_factory=list)  # workers tried, in order
    dispatch_s: float = 0.0  # from the start of dispatch to the worker's acknowledgement
    retry_after_s: float | None = None  # the last worker refused it busy: retry after this
    # an image or video in a format no encode worker decodes, which vLLM does: never placed
    # (``error`` says why), vLLM encodes it
    encoded_by_vllm: bool = False
    image_format: str = ""  # PIL's name for an image (PNG, JPEG, ...); "MP4/MOV" for a video
    modality: Modality = Modality.IMAGE
    # a video's seconds per temporal patch (temporal patch size / the sampled frames' rate), as
    # transformers' Qwen2.5-VL processor computes it (its positions, second_per_grid_ts)
    seconds_per_grid_t: float | None = None
    # a video's time of each temporal patch (sizing.patch_times), for models whose prompt
    # states it (Qwen3-VL)
    patch_times: tuple[float, ...] | None = None

    def to_mm_item(self, start: int) -> MultimodalDataItem:
        """The item as a prefill engine holds it: placeholders at ``[start, start + rows)``,
        the content hash, the expected patch grid, and the room."""
        return MultimodalDataItem(
            self.modality,
            hash=self.content_hash,
            offsets=[[start, start + self.rows - 1]],
            model_specific_data={GRID_KEYS[self.modality]: torch.tensor([list(self.grid_thw)])},
            encode_handshake=self.encode_handshake.model_dump() if self.encode_handshake else None,
        )


class MediaSizer:
    """Every item of a request hashed and sized from its header alone (no decode): an image's grid
    from its size and the image processor's config, a video's from its container header and the
    video processor's frame sampling, by the model family's sizing rules."""

    def __init__(
        self,
        processor,
        video_processor=None,
        sizing: Sizing = QWEN_VL,
        max_image_pixels: int = MAX_PIXELS,
    ):
        self.processor = processor
        self.video_processor = video_processor  # None: videos are refused
        self.sizing = sizing
        self.max_image_pixels = max_image_pixels  # the workers' limit: a larger image is refused

    def describe(
        self,
        media: list[bytes | Media],
        names: list[str] | None = None,
        vllm_decodes: bool = False,
    ) -> list[DispatchedItem]:
        """Hash and size every item (no decode); raises ``DispatchError`` for a bad one, naming it
        by ``names`` (its file, say) or else by its index. Bare bytes are an image. A format
        encode workers refuse (TIFF, WebM, ...) is refused here, before anything is sent; with
        ``vllm_decodes`` (a gateway in front of vLLM), an image of such a format that PIL reads
        is sized within the same limits and comes back ``encoded_by_vllm``."""
        if not 1 <= len(media) <= MAX_IMAGES:
            raise DispatchError(
                f"a request carries 1..{MAX_IMAGES} images and videos, got {len(media)}"
            )
        items = []
        for index, entry in enumerate(media):
            entry = entry if isinstance(entry, Media) else Media(entry)
            kind = entry.modality.vllm_name
            label = names[index] if names else f"{kind} {index}"
            data = entry.data
            if not data or len(data) > MAX_IMAGE_BYTES:
                raise DispatchError(f"{label}: {len(data)} bytes (1..{MAX_IMAGE_BYTES} accepted)")
            if entry.modality is Modality.VIDEO:
                items.append(self._describe_video(index, data, label, vllm_decodes))
            else:
                items.append(self._describe_image(index, data, label, vllm_decodes))
        return items

    def _describe_image(
        self, index: int, image: bytes, label: str, vllm_decodes: bool
    ) -> DispatchedItem:
        # the size as displayed (vLLM and the workers apply the EXIF orientation); too large is
        # refused here, not sent to vLLM inline: a small file may declare a huge image
        encoded_by_vllm = False
        try:
            width, height, image_format = image_header(image, self.max_image_pixels)
        except FormatNotTaken as exc:
            if not vllm_decodes:
                raise DispatchError(f"{label}: {exc}") from None
            try:
                width, height, image_format = image_header(image, self.max_image_pixels, True)
            except ValueError as exc:
                raise DispatchError(f"{label}: {exc}") from None
            encoded_by_vllm = True
        except ValueError as exc:
            raise DispatchError(f"{label}: {exc}") from None
        try:
            grid = self.sizing.image_grid(self.processor, height, width)
        except ValueError as exc:
            raise DispatchError(
                f"{label}: {width}x{height} cannot be resized for the tower: {exc}"
            ) from None
        return DispatchedItem(
            index,
            image,
            hash_feature(image),
            width,
            height,
            grid,
            self.sizing.rows(grid, self.processor),
            error=(
                f"image format {image_format}: encode workers do not decode it; vLLM encodes it"
                if encoded_by_vllm
                else None
            ),
            image_format=image_format,
            encoded_by_vllm=encoded_by_vllm,
        )

    def _video_for_vllm(
        self, index: int, video: bytes, label: str, refused: ContainerNotTaken
    ) -> DispatchedItem:
        """A video in a container no encode worker decodes (WebM, ...), which vLLM's own loader
        samples and encodes: its frame size checked from the header, never placed (no grid: vLLM
        sizes it)."""
        try:
            width, height = frame_size(refused.header)
        except BadVideo as exc:
            raise DispatchError(f"{label}: {exc}") from None
        container = refused.container
        return DispatchedItem(
            index,
            video,
            hash_feature(video),
            width,
            height,
            (0, 0, 0),
            0,
            error=f"video container {container}: encode workers do not decode it; vLLM does",
            image_format=container,
            modality=Modality.VIDEO,
            encoded_by_vllm=True,
        )

    def _describe_video(
        self, index: int, video: bytes, label: str, vllm_decodes: bool
    ) -> DispatchedItem:
        """A video sized from its container header and the video processor (no decode)."""
        processor = self.video_processor
        if processor is None:
            raise DispatchError(f"{label}: the model has no video processor: videos are refused")
        try:
            header = read_header(video)
            indices, grid = sample_and_size(processor, header, self.sizing)
        except ContainerNotTaken as exc:
            if not vllm_decodes:
                raise DispatchError(f"{label}: {exc}") from None
            return self._video_for_vllm(index, video, label, exc)
        except BadVideo as exc:
            raise DispatchError(f"{label}: {exc}") from None
        sampled_fps = len(indices) / header.frames * header.fps  # transformers' VideoMetadata's
        return DispatchedItem(
            index,
            video,
            hash_feature(video),
            header.width,
            header.height,
            grid,
            self.sizing.rows(grid, processor),
            image_format="MP4/MOV",
            modality=Modality.VIDEO,
            seconds_per_grid_t=processor.temporal_patch_size / sampled_fps,
            patch_times=patch_times(indices, header.fps, processor.temporal_patch_size),
        )
