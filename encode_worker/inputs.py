"""What intake hands Prepare that is not a file or raw pixels already: a same-node intake
``ShmTensorHandle`` holding ``uint8 [H, W, 3]`` pixels (``ShmTensorHandle.publish(pixels,
purpose="intake")``; the worker consumes and unlinks it). Files and raw pixels are decoded by
``vision.images`` and ``vision.video``."""

from __future__ import annotations

import torch

from data_plane.shm import ShmError, ShmTensorHandle
from vision.images import BadItem


def pixels_from_shm(handle: ShmTensorHandle) -> torch.Tensor:
    """Attach to and consume a same-node handle: ``uint8 [H, W, 3]`` pixels, the segment
    unlinked."""
    try:
        handle.attach()
        return handle.consume()
    except (ShmError, ValueError, RuntimeError) as exc:
        raise BadItem(f"cannot read pixels from SHM handle {handle.shm_name}: {exc}") from None
