"""The receiver's settings, declared once. ``ReceiverSettings`` is what an operator tunes (the
pool, the transports, the deadlines, checksums): ``epd-prefill`` takes it as flags, the vLLM
connector as ``ec_connector_extra_config``. ``ReceiverConfig`` is the library's whole
configuration: those, and what the embedding process decides itself (the rows' width and dtype,
the DeepStack columns, the fallback, the room API's token, zero-copy)."""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from epdserve.process_settings.groups import RoomEndpointPolicy
from epdserve.process_settings.values import PositiveByteSize, PositiveSeconds, TransportNames
from epdserve.wire.fingerprint import CompactFingerprint
from epdserve.wire.offers import DEFAULT_TRANSPORTS, DTYPE_NAMES, MAX_WIDTH
from epdserve.wire.rooms import MAX_DEADLINE_S, MAX_WAIT_S


class ReceiverSettings(RoomEndpointPolicy):
    transports: TransportNames = Field(
        DEFAULT_TRANSPORTS,
        description="transports offered to the encode workers, comma-separated, in order of "
        "preference (shm: same node; mooncake: RDMA, or TCP where there is none)",
    )
    pool_bytes: PositiveByteSize = Field(
        1 << 30, description="receive pool, registered once (bytes; K, M, G suffixes)"
    )
    slot_bytes: PositiveByteSize = Field(1 << 20, description="receive pool slot size")
    item_timeout_s: PositiveSeconds = Field(
        60.0, description="deadline of one item: not committed by then, it fails (or falls back)"
    )
    quarantine_s: PositiveSeconds = Field(
        40.0,
        description="hold a failed slot this long (above the encode workers' Mooncake transfer "
        "timeout: a failed write can still land)",
    )
    poll_s: PositiveSeconds = Field(
        0.5,
        description="long-poll slice: an unreachable encode worker is noticed within about this",
    )
    endpoint_timeout_s: PositiveSeconds = Field(
        1.0,
        description="an encode worker that has not answered a call this long after its long-poll "
        "slice is stalled (a SIGSTOPped or hung process): its items fail then",
    )
    require_checksum: bool = Field(
        True,
        description="refuse commits without the rows' xxh3-64 checksum (encode workers run "
        "with --no-checksum need it off; then only generation and layout vouch for the bytes)",
    )

    def receiver_settings(self) -> dict:
        """This group's fields and values (to build a ``ReceiverConfig`` from a process's
        settings)."""
        return {name: getattr(self, name) for name in ReceiverSettings.model_fields}


class ReceiverConfig(ReceiverSettings):
    """Everything a ``PrefillReceiver`` takes. Refuses at once what would fail every item later,
    at its registration or its long-poll."""

    model_config = ConfigDict(frozen=True)

    width: int  # wire width of one row (Qwen3-VL: out_width * (1 + deepstack_levels))
    dtype: str = "bfloat16"
    deepstack_width: int = 0  # > 0: the last deepstack_width columns go to encoded_deepstack
    fallback: str = (
        "fail"  # or "local_tower": encode an item's kept pixels here when its room fails
    )
    handshake_token: str | None = None
    zero_copy: bool = False  # encoded = a view of the slot, held until job.release()
    # The compact fingerprint of the engine's model (epdserve.wire.fingerprint): every room is
    # registered with it, and rows committed under another (or under none) are refused. None: no
    # model check (a receiver that runs no model of its own).
    model_fingerprint: CompactFingerprint | None = None

    @model_validator(mode="after")
    def _would_work(self) -> ReceiverConfig:
        problems = [
            problem
            for bad, problem in (
                (not 0 < self.width <= MAX_WIDTH, f"width {self.width} is not in 1..{MAX_WIDTH}"),
                (
                    self.dtype not in DTYPE_NAMES,
                    f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_NAMES)}",
                ),
                (
                    not 0 <= self.deepstack_width < self.width,
                    f"deepstack_width {self.deepstack_width} is not in 0..width-1",
                ),
                (
                    self.item_timeout_s > MAX_DEADLINE_S,
                    f"item_timeout_s {self.item_timeout_s:g} is not in "
                    f"(0, {MAX_DEADLINE_S}] (a room's deadline)",
                ),
                (
                    self.poll_s > MAX_WAIT_S,
                    f"poll_s {self.poll_s:g} is not in (0, {MAX_WAIT_S}] (a long-poll)",
                ),
                (
                    self.fallback not in ("fail", "local_tower"),
                    f"fallback {self.fallback!r} is not fail or local_tower",
                ),
            )
            if bad
        ]
        if problems:
            raise ValueError("ReceiverConfig: " + "; ".join(problems))
        return self
