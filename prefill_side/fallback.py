"""The local tower: rows for an item the encode workers did not deliver (``--fallback
local_tower``), or for a colocated item an engine encodes itself, from the pixels or image bytes
the item kept. The tower is the embedding process's (a ``vision.tower.VisionTower``: its own
image path too), so this library imports no vision stack."""

from __future__ import annotations

import torch

from epdserve.data_plane.dtypes import dtype_to_wire
from epdserve.multimodal.items import MultimodalDataItem
from epdserve.multimodal.rows import RowContractError, item_rows
from prefill_side.settings import ReceiverConfig


class LocalTower:
    """A receiver's local tower (a ``vision.tower.VisionTower``, or anything with its
    ``image_inputs``, ``rows_per_item``, ``encode_items``, ``info`` and ``dtype``)."""

    def __init__(self, config: ReceiverConfig, tower):
        self.config = config
        self.tower = tower

    def takes(self, item: MultimodalDataItem) -> bool:
        """Whether a failed item falls back here: the receiver was configured to, has a tower,
        and the item kept what to encode."""
        return (
            self.config.fallback == "local_tower"
            and self.tower is not None
            and item.feature is not None
        )

    def encode(self, item: MultimodalDataItem) -> torch.Tensor:
        """Rows for an item from the local tower and the pixels (or image bytes) it kept."""
        (rows,) = self.encode_batch([item])
        return rows

    def encode_batch(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """Rows for several items in one tower call (a colocated engine's path). The row contract
        holds here as on the wire: ``RowContractError``, before the tower runs, for an item whose
        image makes other rows than its placeholders hold, or another patch grid than the one it
        carries, or for a tower whose rows are not this receiver's width and dtype."""
        tower = self.tower
        if (tower.info.wire_width, dtype_to_wire(tower.dtype)) != (
            self.config.width,
            self.config.dtype,
        ):
            raise RowContractError(
                f"the local tower makes [*, {tower.info.wire_width}] {dtype_to_wire(tower.dtype)} "
                f"rows, this receiver takes [*, {self.config.width}] {self.config.dtype}"
            )
        processed = []
        for item in items:
            inputs = tower.image_inputs(item.feature)
            grid = inputs["image_grid_thw"]
            (rows,) = tower.rows_per_item(grid)
            placeholders = item_rows(item.offsets)
            if rows != placeholders:
                raise RowContractError(
                    f"the image makes {rows} rows (grid {grid.reshape(-1).tolist()}) but the "
                    f"item's placeholders hold {placeholders}"
                )
            known = item.model_specific_data.get("image_grid_thw")
            if (
                known is not None
                and torch.as_tensor(known).reshape(-1).tolist() != grid.reshape(-1).tolist()
            ):
                raise RowContractError(
                    f"the image's grid {grid.reshape(-1).tolist()} differs from the item's "
                    f"image_grid_thw {torch.as_tensor(known).reshape(-1).tolist()}"
                )
            processed.append(inputs)
        rows = tower.encode_items(
            torch.cat([p["pixel_values"] for p in processed]),
            torch.cat([p["image_grid_thw"] for p in processed]),
        )
        return [r.to(tower.dtype).clone() for r in rows]
