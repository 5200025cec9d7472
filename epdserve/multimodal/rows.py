"""The row contract: an item's rows are the sum of its inclusive placeholder spans.

A vision tower returns one packed ``[sum_rows, width]`` tensor for a batch; ``split_rows`` cuts it
per item and refuses any mismatch instead of silently shifting rows between items.
``image_grid`` gives an image's patch grid from its size and the checkpoint's image processor,
so a dispatcher (placeholders) and an encode worker (batching) agree with the tower on rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RowContractError(ValueError):
    """An item's rows do not match what its placeholders (or the packed output) say."""


def item_rows(offsets: Sequence[Sequence[int]] | None) -> int:
    """Rows of one item: the sum of its inclusive ``(start, end)`` placeholder spans."""
    if not offsets:
        raise RowContractError("item has no placeholder offsets")
    total = 0
    previous_end = -1
    for span in offsets:
        if len(span) != 2:
            raise RowContractError(f"offset span {span!r} is not a (start, end) pair")
        start, end = int(span[0]), int(span[1])
        if start < 0 or end < start:
            raise RowContractError(f"offset span ({start}, {end}) is empty or negative")
        if start <= previous_end:
            raise RowContractError(
                f"offset span ({start}, {end}) overlaps or precedes the previous one"
            )
        previous_end = end
        total += end - start + 1
    return total


def split_rows(packed: torch.Tensor, rows_per_item: Sequence[int]) -> list[torch.Tensor]:
    """Split a packed ``[sum_rows, width]`` output into one view per item.

    Raises ``RowContractError`` unless ``packed`` is 2-D and its rows equal ``sum(rows_per_item)``
    with every count positive.
    """
    if packed.dim() != 2:
        raise RowContractError(
            f"packed output must be 2-D [rows, width], got shape {tuple(packed.shape)}"
        )
    counts = [int(r) for r in rows_per_item]
    if any(r <= 0 for r in counts):
        raise RowContractError(f"every item needs a positive row count, got {counts}")
    if sum(counts) != packed.shape[0]:
        raise RowContractError(
            f"packed output has {packed.shape[0]} rows but the items expect {sum(counts)} "
            f"({counts})"
        )
    return list(torch.split(packed, counts, dim=0))
