"""An item whose room failed (refused, lost, timed out, a commit rejected): its slot freed, or
quarantined while a late write may still land in it, then the item encoded by the local tower
where it falls back, else failed with the reason."""

from __future__ import annotations

import asyncio
import time

from epdserve.data_plane.pool import SlotPool
from epdserve.multimodal.items import MultimodalDataItem
from epdserve.wire.states import ItemState
from prefill_side.fallback import LocalTower
from prefill_side.job import PendingItem, ReceiveJob, set_encoded
from prefill_side.metrics import ReceiverMetrics
from prefill_side.settings import ReceiverConfig


class GiveUp:
    def __init__(
        self, config: ReceiverConfig, pool: SlotPool, metrics: ReceiverMetrics, local: LocalTower
    ):
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.local = local

    async def __call__(
        self,
        job: ReceiveJob,
        index: int,
        item: MultimodalDataItem,
        reason: str,
        entry: PendingItem | None,
        quarantine: bool,
    ) -> None:
        """The room failed: free or quarantine its slot, then fall back or fail the item."""
        if entry is not None:
            (self.pool.quarantine if quarantine else self.pool.release)(entry.lease)
        outcome = job.outcomes[index]
        if outcome.state != ItemState.PENDING:  # aborted already: its outcome stands
            return
        outcome.seconds = time.monotonic() - job.started
        if self.local.takes(item) and not job.cancelled:
            try:
                rows = await asyncio.get_running_loop().run_in_executor(
                    None, self.local.encode, item
                )
                if outcome.state != ItemState.PENDING:  # aborted while the tower ran
                    return
                set_encoded(item, rows, self.config.deepstack_width)
                outcome.state, outcome.transport, outcome.fallback = (
                    ItemState.DONE,
                    "local_tower",
                    True,
                )
                outcome.reason = f"fallback after: {reason}"
                self.metrics.fallbacks.inc()
                self.metrics.items.labels("local_tower", "done").inc()
                job.settle_if_done()
                return
            except Exception as exc:  # the fallback failing must not hide the first reason
                reason = f"{reason}; local tower also failed: {exc}"
        outcome.state, outcome.reason = ItemState.FAILED, reason
        self.metrics.failed()
        job.settle_if_done()
