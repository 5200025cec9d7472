"""Faults injected into real processes: the scenarios behind ``tests/test_faults.py`` and
``epd-bench soak``, one module per family (``processes``: deaths and stalls mid-request;
``contract``: requests that break the contract; ``malformed``: garbage frames and bodies;
``startup``: /dev/shm full, Mooncake unavailable), the lab they run in (``lab``, ``conn``,
``common``) and ``SCENARIOS``, every scenario by name.

Each scenario is a coroutine ``scenario(lab, conn, rng) -> FaultOutcome``: it sets up real items
(synthetic images through the real intake, rooms and receiver), injects one fault, and measures what
happened: the affected rooms' outcome, reason and time from the moment the fault became observable
to their failure in the prefill process, and whether every other item in flight arrived bit-exact
(checked against reference rows from this process's own tower).
"""

from epdserve.bench.faults.contract import (
    duplicate_room,
    duplicate_room_at_intake,
    duplicate_room_in_one_request,
    duplicate_room_two_receivers,
    item_too_large,
    layout_mismatch,
    rows_mismatch,
)
from epdserve.bench.faults.lab import FAST_S, WIDTH, FaultLab, LabConfig, lab_model
from epdserve.bench.faults.malformed import MALFORMED_FRAMES, malformed_input
from epdserve.bench.faults.processes import (
    cancel_during_write,
    handshake_unreachable,
    prefill_killed_after_registering,
    worker_killed_mid_transfer,
    worker_paused_past_deadline,
)
from epdserve.bench.faults.scenario_steps import serves
from epdserve.bench.faults.startup import can_mount_tmpfs, dev_shm_full, mooncake_unavailable
from epdserve.testing.images import synthetic_image

SCENARIOS = {
    "worker_killed_mid_transfer": worker_killed_mid_transfer,
    "worker_paused_past_deadline": worker_paused_past_deadline,
    "prefill_killed_after_registering": prefill_killed_after_registering,
    "handshake_unreachable": handshake_unreachable,
    "cancel_during_write": cancel_during_write,
    "duplicate_room": duplicate_room,
    "item_too_large": item_too_large,
    "rows_mismatch": rows_mismatch,
    "layout_mismatch": layout_mismatch,
    "malformed_input": malformed_input,
    "dev_shm_full": dev_shm_full,
    "mooncake_unavailable": mooncake_unavailable,
}

__all__ = [
    "FAST_S",
    "MALFORMED_FRAMES",
    "SCENARIOS",
    "WIDTH",
    "FaultLab",
    "LabConfig",
    "can_mount_tmpfs",
    "cancel_during_write",
    "dev_shm_full",
    "duplicate_room_at_intake",
    "duplicate_room_in_one_request",
    "duplicate_room_two_receivers",
    "handshake_unreachable",
    "item_too_large",
    "lab_model",
    "malformed_input",
    "mooncake_unavailable",
    "prefill_killed_after_registering",
    "rows_mismatch",
    "serves",
    "synthetic_image",
    "worker_killed_mid_transfer",
    "worker_paused_past_deadline",
]
