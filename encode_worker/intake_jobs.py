"""The encode jobs intake makes of its items, from what can be seen without decoding: an image's
header (its size as displayed), a video's container header and the checkpoint's frame sampling, a
pixel array's shape, an intake SHM handle's name. Each is sized for the tower (its grid, its
pixels) and checked against the sender's grid and against this worker's limits; its cache key is
the hash of the bytes this worker encodes (an SHM item's, checked once Prepare reads it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from encode_worker.inputs import check_claimed_hash
from encode_worker.scheduler import EncodeJob
from epdserve.data_plane.shm import ShmTensorHandle
from epdserve.multimodal.hashing import hash_feature
from epdserve.vision.image_files import TooLarge, check_size
from epdserve.vision.image_files import header as image_header
from epdserve.vision.images import BadItem
from epdserve.vision.limits import MAX_SIDE
from epdserve.vision.sizing import VideoLimits, plan_video_file, plan_video_frames
from epdserve.wire.intake import IntakeRequest
from epdserve.wire.modality import Modality

if TYPE_CHECKING:
    from encode_worker.config import WorkerConfig
    from epdserve.vision.tower import VisionTower


class IntakeJobs:
    """Makes an ``EncodeJob`` of each intake item (see the module's docstring), or refuses it as
    a ``BadItem``."""

    def __init__(self, tower: VisionTower, config: WorkerConfig):
        self.tower = tower
        self.max_image_pixels = config.max_image_pixels
        self.video_limits = VideoLimits(
            config.max_image_pixels,
            config.max_video_seconds,
            config.max_video_frames,
            config.max_video_pixels,
        )

    def job(self, request: IntakeRequest, payload: bytes | None) -> EncodeJob:
        """The item as a job; ``BadItem`` for an item that must not go further."""
        if request.modality is Modality.VIDEO:
            source_payload, grid, pixels, video = self._video(request, payload)
        else:
            source_payload, grid, pixels = self._image(request, payload)
            video = None
        if request.grid_thw is not None and tuple(request.grid_thw) != grid:
            raise BadItem(
                f"the sender sized this item to grid {list(request.grid_thw)}, this worker's "
                f"processor config to {list(grid)}: the two disagree (same checkpoint and "
                "processor settings on both sides?)"
            )
        # The cache key is the hash of the bytes this worker encodes, never the client's word for
        # it: a wrong claimed hash would poison the cache entry of the image it names.
        if request.source == "shm":
            if request.content_hash is None:
                raise BadItem("SHM-backed items must carry a content hash")
            content_hash = request.content_hash  # checked against the pixels once read (Prepare)
        else:
            content_hash = hash_feature(payload)
            check_claimed_hash(request.content_hash, content_hash)
        return EncodeJob(
            request.request_id,
            request.encode_handshake,
            content_hash,
            request.source,
            source_payload,
            grid[0] * grid[1] * grid[2],
            request.modality,
            pixels=pixels,
            nbytes=len(payload) if payload is not None else 0,
            grid_thw=grid,
            video=video,
        )

    def _image(self, request: IntakeRequest, payload: bytes | None):
        """An image's payload as Prepare reads it, its grid and its pixels."""
        if request.source == "bytes":
            try:  # the size as displayed (the EXIF orientation applied), as Prepare decodes it
                width, height, _ = image_header(payload, self.max_image_pixels)
            except TooLarge as exc:  # refused below, as an image of any source is
                width, height = exc.width, exc.height
            except ValueError as exc:
                raise BadItem(f"cannot read image header: {exc}") from None
        else:
            height, width = (request.shape if request.source == "pixels" else request.shm.shape)[:2]
        try:
            check_size(width, height, self.max_image_pixels)
        except TooLarge:
            raise BadItem(
                f"image of {width}x{height} pixels is larger than this worker decodes "
                f"({self.max_image_pixels} pixels, {MAX_SIDE} a side)"
            ) from None
        if request.source == "bytes":
            source_payload = payload
        elif request.source == "pixels":
            source_payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(
                height, width, 3
            )
        else:
            try:  # the name alone decides: a segment that is not an intake handle is never opened
                source_payload = ShmTensorHandle.for_intake(
                    request.shm.shm_name, tuple(request.shm.shape), torch.uint8
                )
            except ValueError as exc:
                raise BadItem(str(exc)) from None
        try:
            grid = self.tower.sizing.image_grid(self.tower.processor, height, width)
        except ValueError as exc:
            raise BadItem(
                f"image of {width}x{height} cannot be resized for the tower: {exc}"
            ) from None
        return source_payload, grid, width * height

    def _video(self, request: IntakeRequest, payload: bytes):
        """A video's payload as Prepare reads it, its grid, its decoded pixels and its plan."""
        processor = self.tower.video_processor
        if processor is None:
            raise BadItem("this worker's checkpoint has no video processor: videos are refused")
        if request.source == "bytes":
            plan = plan_video_file(payload, processor, self.video_limits, self.tower.sizing)
            source_payload = payload
        else:
            plan = plan_video_frames(request.shape, processor, self.video_limits, self.tower.sizing)
            source_payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(
                *request.shape
            )
        return source_payload, plan.grid_thw, plan.pixels, plan
