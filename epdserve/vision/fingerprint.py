"""A loaded tower's model fingerprint (``epdserve.fingerprints``): what the encode worker and
``epd-prefill`` say they run, computed from the checkpoint they loaded, the tower's config and
dtype, and the processors they apply."""

from __future__ import annotations

from epdserve.data_plane.dtypes import dtype_to_wire
from epdserve.fingerprints import fingerprint
from epdserve.vision.tower import VisionTower
from epdserve.wire.fingerprint import ModelFingerprint, RowLayout


def tower_fingerprint(tower: VisionTower) -> ModelFingerprint:
    info = tower.info
    return fingerprint(
        tower.model_id,  # the checkpoint's directory
        info.family,
        getattr(tower.model.config, "vision_config", tower.model.config),  # as vLLM's config
        dtype_to_wire(tower.dtype),
        tower.processor,
        tower.video_processor,
        RowLayout(width=info.wire_width, deepstack_levels=info.deepstack_levels, merge=info.merge),
    )
