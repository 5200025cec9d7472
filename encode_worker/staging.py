"""StageAndSend, the encode worker's last stage: each item's rows copied into the send ring (a
registered ``SlotPool``) and checksummed, then handed to the ``Sender``. A full ring blocks it:
backpressure, all the way back to intake."""

from __future__ import annotations

import time

import torch

from encode_worker.device import DeviceLost
from encode_worker.messages import EncodedBatch, Handoff, ReadyItem
from encode_worker.sender import Sender
from encode_worker.stages import StageContext
from encode_worker.writes import StagedItem, stage
from epdserve.data_plane.commit import EmbeddingLayout, checksum_bytes
from epdserve.data_plane.pool import NoCapacity, SlotPool, TooLarge


class StageAndSend:
    """Copy each item's rows into a send-ring slot and submit it to the sender. On a GPU this
    thread is the one that waits for a batch's rows to reach host memory (once per batch). A full
    ring blocks this stage (backpressure) up to ``receiver_wait_s``; then the item's room fails."""

    def __init__(
        self, context: StageContext, ring: SlotPool, sender: Sender, inbox: Handoff[EncodedBatch]
    ):
        self.ring = ring
        self.torch_threads = context.threads.stage
        self.sender = sender
        self.receiver_wait_s = context.config.receiver_wait_s
        self.with_checksum = context.config.checksum
        self.failer = context.failer
        self.health = context.health
        self.inbox = inbox
        self._stopping = context.stopping

    def loop(self) -> None:
        torch.set_num_threads(self.torch_threads)
        while not self._stopping.is_set():
            encoded = self.inbox.get()
            if encoded is not None:
                self.send(encoded.ready)

    def send(self, ready: list[ReadyItem]) -> None:
        """Stage a batch's items and hand them to the sender together (one wake-up of its loop);
        those staged so far go first when the ring is full, so that their slots can come back."""
        staged: list[StagedItem] = []
        for item in ready:
            one = self._stage(item, staged)
            if one is not None:
                staged.append(one)
        if staged:
            self.sender.submit_all(staged)

    def _stage(self, item: ReadyItem, staged: list[StagedItem]) -> StagedItem | None:
        job = item.job
        try:
            rows = item.encoded.host_rows()
        except DeviceLost as exc:
            self.health.device_lost(str(exc))
            self.failer.fail(job.handshake, str(exc), job.modality)
            return
        layout = EmbeddingLayout.of(rows)
        deadline = time.monotonic() + self.receiver_wait_s
        while True:
            try:
                lease = stage(self.ring, rows)
                break
            except TooLarge:
                self.failer.fail(
                    job.handshake,
                    f"item of {layout.nbytes} bytes is larger than the send ring",
                    job.modality,
                )
                return
            except (
                NoCapacity
            ):  # backpressure: this stage blocks, and so, in turn, do those before it
                if staged:  # delivered first: their slots come back as their writes settle
                    self.sender.submit_all(staged)
                    staged.clear()
                if time.monotonic() >= deadline:
                    self.failer.fail(job.handshake, "send ring stayed full", job.modality)
                    return
                with self.sender.slot_freed:
                    self.sender.slot_freed.wait(0.05)
        digest = checksum_bytes(self.ring.bytes_of(lease)) if self.with_checksum else None
        return StagedItem(
            job.request_id,
            job.handshake,
            lease,
            layout,
            digest,
            dict(job.timings),
            item.encoded.grid_thw,
            job.modality,
        )
