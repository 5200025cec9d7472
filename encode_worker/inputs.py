"""What intake hands Prepare, as far as the worker reads it itself: a same-node intake
``ShmTensorHandle`` holding ``uint8 [H, W, 3]`` pixels (``ShmTensorHandle.publish(pixels,
purpose="intake")``; the worker consumes and unlinks it), and a client's claimed content hash,
checked against the bytes. Files and raw pixels are decoded by ``vision.images`` and
``vision.video``."""

from __future__ import annotations

import torch

from epdserve.data_plane.shm import ShmError, ShmTensorHandle
from epdserve.vision.images import BadItem


def pixels_from_shm(handle: ShmTensorHandle) -> torch.Tensor:
    """Attach to and consume a same-node handle: ``uint8 [H, W, 3]`` pixels, the segment
    unlinked."""
    try:
        handle.attach()
        return handle.consume()
    except (ShmError, ValueError, RuntimeError) as exc:
        raise BadItem(f"cannot read pixels from SHM handle {handle.shm_name}: {exc}") from None


def check_claimed_hash(claimed: int | None, computed: int) -> None:
    """A client's content hash must be the xxh3-128 of the payload's bytes (file or raw pixels)."""
    if claimed is not None and claimed != computed:
        raise BadItem(
            f"claimed content hash {claimed:032x} is not the hash of the item's bytes "
            f"({computed:032x})"
        )
