"""The multimodal item model both sides share: items, content hashes, pad ids and the row
contract."""

from multimodal.hashing import hash_feature
from multimodal.items import (
    MM_PAD_BASE,
    MM_PAD_HASH_MASK,
    Modality,
    MultimodalDataItem,
    MultimodalInputs,
    is_mm_pad_value,
    maybe_substitute_mm_pad,
)
from multimodal.rows import RowContractError, item_rows, split_rows

__all__ = [
    "MM_PAD_BASE",
    "MM_PAD_HASH_MASK",
    "Modality",
    "MultimodalDataItem",
    "MultimodalInputs",
    "RowContractError",
    "hash_feature",
    "is_mm_pad_value",
    "item_rows",
    "maybe_substitute_mm_pad",
    "split_rows",
]
