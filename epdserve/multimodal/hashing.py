"""Content hashes of raw feature bytes (xxh3-128), used for pad ids, cache keys and routing."""

from __future__ import annotations

import numpy as np
import torch
import xxhash


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def hash_feature(feature: torch.Tensor | np.ndarray | bytes | bytearray | memoryview) -> int:
    """Hash a feature's raw bytes to a 128-bit int.

    Tensors and arrays also hash their dtype and shape, so the same bytes viewed as a different
    tensor never share a hash. Encoded image files (bytes) hash exactly their bytes.
    """
    hasher = xxhash.xxh3_128()
    if isinstance(feature, torch.Tensor):
        hasher.update(f"torch:{feature.dtype}:{tuple(feature.shape)}".encode())
        hasher.update(_tensor_bytes(feature))
    elif isinstance(feature, np.ndarray):
        hasher.update(f"numpy:{feature.dtype.str}:{feature.shape}".encode())
        hasher.update(memoryview(np.ascontiguousarray(feature)).cast("B"))
    elif isinstance(feature, (bytes, bytearray, memoryview)):
        hasher.update(feature)
    else:
        raise TypeError(f"cannot hash a feature of type {type(feature).__name__}")
    return hasher.intdigest()
