"""The vision weights' digest, read from a checkpoint's safetensors files as stored.

Every tensor under a vision prefix (``VISION_PREFIXES``: Qwen-VL's tower; Gemma 3's SigLIP and
projector; every tensor of a vision-only checkpoint, which transformers writes under ``visual.``
too) counts by its name without the prefix, its stored
dtype, its shape and an xxh3-128 of its bytes, so a full checkpoint and the vision-only export of
the same tower agree, and two checkpoints of the same architecture with other weights do not. The
files are read through ``mmap`` (the safetensors layout: an 8-byte header length, a JSON header,
the data), without the safetensors package.
"""

from __future__ import annotations

import glob
import json
import mmap
import os
import struct

import xxhash

from epdserve.wire.fingerprint import digest

# Where a full checkpoint keeps its tower, each prefix -> what stays of it in the tensor's name
# (hub layouts: transformers 5 writes model.visual.; Gemma 3's tower is two modules, at the top
# level on the hub, under model. as transformers names them).
VISION_PREFIXES = {
    "model.visual.": "",
    "visual.": "",
    "model.vision_tower.": "vision_tower.",
    "vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "multi_modal_projector.": "multi_modal_projector.",
}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on a header


class CheckpointError(ValueError):
    """The checkpoint's weights cannot be read for a fingerprint."""


def vision_weights_digest(directory: str) -> str:
    """The digest of the vision tensors in ``directory``'s safetensors files (module docstring);
    ``CheckpointError`` when it holds none."""
    vision_only = _is_vision_only(directory)
    entries = []
    for path in _shards(directory):
        entries += _tensor_digests(path, vision_only)
    if not entries:
        raise CheckpointError(f"{directory}: no vision tensors in its safetensors files")
    entries.sort()
    return digest(entries)


def _is_vision_only(directory: str) -> bool:
    try:
        with open(os.path.join(directory, "config.json")) as f:
            return str(json.load(f).get("model_type", "")).endswith("_vision")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {directory}/config.json: {exc}") from None


def _shards(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"cannot read {index}: {exc}") from None
        return [os.path.join(directory, name) for name in files]
    paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not paths:
        raise CheckpointError(f"{directory}: no safetensors files")
    return paths


def _vision_name(name: str, vision_only: bool) -> str | None:
    """A tensor's name in the tower (its vision prefix dropped), or None for no tower tensor. A
    vision-only checkpoint's tensors are all the tower's, with or without the prefix."""
    for prefix, kept in VISION_PREFIXES.items():
        if name.startswith(prefix):
            return kept + name[len(prefix) :]
    return name if vision_only else None


def _tensor_digests(path: str, vision_only: bool) -> list[tuple]:
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: a {length}-byte header is not safetensors")
            header = json.loads(f.read(length))
            wanted = {
                key: meta
                for name, meta in header.items()
                if name != "__metadata__" and (key := _vision_name(name, vision_only)) is not None
            }
            if not wanted:
                return []
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                data = memoryview(mapped)[8 + length :]
                try:
                    return [
                        (
                            key,
                            meta["dtype"],
                            list(meta["shape"]),
                            xxhash.xxh3_128_hexdigest(data[slice(*meta["data_offsets"])]),
                        )
                        for key, meta in wanted.items()
                    ]
                finally:
                    data.release()
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
