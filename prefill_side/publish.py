"""An item whose room succeeded: its commit checked (the model that computed the rows against
the engine's, generation, layout, checksum, the encoder's grid against the request's), its rows
published into ``encoded`` (a copy, or with ``zero_copy`` a view of the slot held until the engine
releases the job), its slot freed. Synchronous: a commit that fails a check comes back as a
``Refusal`` for the caller to give the item up with (the give-up may run the local tower: the
caller puts it on a task of its own)."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from epdserve.data_plane.commit import ContractError, accept_commit, verify_rows
from epdserve.data_plane.pool import SlotPool
from epdserve.multimodal.items import GRID_KEYS
from epdserve.wire.fingerprint import say_compact_differences
from epdserve.wire.rooms import RoomView
from epdserve.wire.states import ItemState
from prefill_side.job import PendingItem, ReceiveJob, set_encoded
from prefill_side.metrics import ReceiverMetrics
from prefill_side.settings import ReceiverConfig


class Refusal(NamedTuple):
    """Why a commit was not published, and whether its slot must be quarantined."""

    reason: str
    quarantine: bool


class Publisher:
    def __init__(self, config: ReceiverConfig, pool: SlotPool, metrics: ReceiverMetrics):
        self.config = config
        self.pool = pool
        self.metrics = metrics

    def __call__(self, job: ReceiveJob, entry: PendingItem, view: RoomView) -> Refusal | None:
        """Publish the item's rows (None), or why not (its slot left as it is)."""
        if (
            job.outcomes[entry.index].state != ItemState.PENDING
        ):  # aborted: the writer is done, nobody reads the rows
            self.pool.release(entry.lease)
            return None
        commit = view.commit
        mine = self.config.model_fingerprint
        if mine is not None and commit.fingerprint != mine:
            # the write has ended (it committed): no byte can still land, the slot is free
            return Refusal(
                "rows from another model refused: "
                + (
                    say_compact_differences(
                        mine, commit.fingerprint, "this engine", "the encode worker"
                    )
                    if commit.fingerprint is not None
                    else "the encode worker did not say which model computed them"
                ),
                quarantine=False,
            )
        try:
            rows = accept_commit(
                self.pool, entry.lease, entry.layout, commit, verify_checksum=False
            )
            if not self.config.zero_copy:
                rows = rows.clone()  # verified below: the bytes checked are the bytes published
            verify_rows(rows, commit, self.config.require_checksum)
        except ContractError as exc:
            return Refusal(f"commit rejected: {exc}", quarantine=True)
        grid = view.commit.grid_thw
        grid_key = GRID_KEYS.get(entry.item.modality)
        known = entry.item.model_specific_data.get(grid_key) if grid_key else None
        if (
            grid is not None
            and known is not None
            and torch.as_tensor(known).reshape(-1).tolist() != list(grid)
        ):
            return Refusal(
                f"encoder's {grid_key} {list(grid)} differs from "
                f"the request's {torch.as_tensor(known).reshape(-1).tolist()}",
                quarantine=False,
            )
        if self.config.zero_copy:
            if not job.hold(
                entry.item, entry.lease
            ):  # the engine already let go: nobody reads the view
                self.pool.release(entry.lease)
                return None
        else:
            self.pool.release(entry.lease)
        set_encoded(entry.item, rows, self.config.deepstack_width)
        if grid is not None and known is None and grid_key:
            entry.item.model_specific_data[grid_key] = torch.tensor([list(grid)])
        outcome = job.outcomes[entry.index]
        outcome.state, outcome.transport, outcome.encoder = (
            ItemState.DONE,
            view.transport,
            view.commit.timings,
        )
        outcome.seconds = time.monotonic() - job.started
        self.metrics.delivered(view.transport, entry.layout.nbytes, outcome.seconds)
        job.settle_if_done()
        return None
