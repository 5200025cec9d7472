"""The tensor dtypes allowed to cross a process boundary, by wire name."""

from __future__ import annotations

import torch

from epdserve.wire.offers import DTYPE_NAMES

WIRE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
assert tuple(WIRE_DTYPES) == DTYPE_NAMES
_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}


def dtype_from_wire(name: str) -> torch.dtype:
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"dtype {name!r} is not allowed; use one of {sorted(WIRE_DTYPES)}"
        ) from None


def dtype_to_wire(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot cross the wire; use one of {sorted(WIRE_DTYPES)}"
        ) from None
