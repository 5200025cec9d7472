"""``WorkerConfig``: every setting of an encode worker, once. ``epd-encode-worker``'s flags,
its ``EPD_<FLAG>`` environment variables, secret files and ``--help`` are generated from these
fields; a program embedding a worker constructs one directly, validated the same way."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from epdserve.process_settings import (
    AdvertisedHost,
    AnyPort,
    ByteSize,
    Dtype,
    NonNegativeSeconds,
    PositiveByteSize,
    PositiveInt,
    PositiveSeconds,
    SettingError,
    TowerCompile,
    TransportNames,
    VisionAttention,
)
from epdserve.process_settings.groups import (
    ClosedListener,
    ModelNaming,
    RoomEndpointPolicy,
    TransportSettings,
)
from epdserve.process_settings.secrets import HandshakeToken, IntakeToken
from epdserve.vision.limits import MAX_PIXELS
from epdserve.wire.addresses import DEFAULT_BOOTSTRAP_PORT, DEFAULT_INTAKE_PORT
from epdserve.wire.offers import DEFAULT_TRANSPORTS, TRANSPORT_NAMES
from handshake.settings import RoomTableSettings

# The batching window's ceiling: it trades a lone item's latency for batches that form under load,
# and a few milliseconds are enough to gather a burst's items (docs/performance.md).
MAX_BATCH_WINDOW_S = 0.05


@dataclass(frozen=True)
class DeviceDefaults:
    """The batch budget and the preprocessing threads a worker takes unless told otherwise, by
    the type of its tower's device."""

    batch_patches: int
    batch_items: int
    queue_items: int  # a burst's items wait here (their files only) while their deadline allows
    preprocess_workers: int


DEVICE_DEFAULTS = {
    # The CPU: the tower takes the cores; small batches keep a lone item's latency down.
    "cpu": DeviceDefaults(
        batch_patches=16384, batch_items=8, queue_items=4096, preprocess_workers=1
    ),
    # A GPU: batches that fill the card (an H100 ran the Qwen2.5-VL-7B tower faster up to batch
    # 32 at 224x224, docs/performance.md): 64 images of 224x224, 32 of 448x448, 8 of 896x896;
    # decode and preprocessing on half the cores, so the CPU keeps up with the tower.
    "cuda": DeviceDefaults(
        batch_patches=32768,
        batch_items=64,
        queue_items=16384,
        preprocess_workers=max(1, min(8, (os.cpu_count() or 2) // 2)),
    ),
}


class WorkerConfig(
    RoomTableSettings,
    HandshakeToken,
    IntakeToken,
    ModelNaming,
    RoomEndpointPolicy,
    ClosedListener,
    TransportSettings,
):
    """EPD encode worker: runs a vision tower over batches of items and delivers each item's rows
    to the prefill receiver that reserved memory for it."""

    model_config = SettingsConfigDict(env_prefix="EPD_")
    PROG: ClassVar[str] = "epd-encode-worker"

    model: str = Field(min_length=1, description="checkpoint directory (full VLM or vision-only)")
    dtype: Dtype = Field("bfloat16", description="tower dtype: bfloat16, float16, float32")
    device: str = Field("cpu", description="torch device for the tower, e.g. cuda:0")
    vision_attention: VisionAttention = Field(
        "auto",
        description="the tower's attention: varlen (one call per layer over the whole batch: "
        "Flash varlen on CUDA in bf16/fp16, padded SDPA elsewhere), reference (transformers' "
        "per-sequence loop; bit-exact batch invariance on the CPU), auto (varlen where Flash "
        "runs: CUDA, compute capability 8.0 on, bf16/fp16)",
    )
    compile: TowerCompile = Field(
        "auto",
        description="torch.compile of the tower's blocks and mergers on the varlen path (dynamic "
        "shapes; compiled and warmed up over the batch shapes the worker forms before /readyz "
        "says ready): on, off, auto (on where Inductor's GPU backend runs: CUDA with Triton and "
        "a C compiler; the reason logged once when off)",
    )
    compile_cache_dir: str | None = Field(
        None,
        min_length=1,
        description="directory of torch.compile's cache (Inductor's and Triton's compiled code), "
        "kept across restarts: a worker started again over it loads its graphs instead of "
        "compiling them (default: Inductor's, under the temp directory)",
    )
    preprocess_workers: PositiveInt | None = Field(
        None,
        description="threads decoding and preprocessing a batch's items in parallel, one torch "
        "thread each (default: 1 on the CPU, half the cores up to 8 on CUDA)",
    )
    preprocess_device: Literal["cpu", "tower"] = Field(
        "cpu",
        description="where an image's resize, rescale and normalisation run: cpu, or the "
        "tower's device (its uint8 pixels are uploaded instead of float patches)",
    )
    host: AdvertisedHost = Field(
        "127.0.0.1",
        description="address peers use to reach this worker (rooms, Mooncake); not 0.0.0.0",
    )
    bind: str = Field(
        "0.0.0.0", min_length=1, description="address the bootstrap and intake ports listen on"
    )
    bootstrap_port: AnyPort = Field(
        DEFAULT_BOOTSTRAP_PORT,
        description="handshake (room) REST port; also /healthz /readyz /metrics (0: any free port)",
    )
    intake_port: AnyPort = Field(
        DEFAULT_INTAKE_PORT, description="ZMQ ROUTER port for items (0: any free port)"
    )
    transports: TransportNames = Field(
        DEFAULT_TRANSPORTS,
        description=f"comma-separated, in order of preference: {', '.join(TRANSPORT_NAMES)}",
    )
    batch_patches: PositiveInt | None = Field(
        None, description="tower input patches per batch (default: 16384 on the CPU, 32768 on CUDA)"
    )
    batch_items: PositiveInt | None = Field(
        None, description="items per batch (default: 8 on the CPU, 64 on CUDA)"
    )
    batch_window_s: NonNegativeSeconds = Field(
        0.002,
        le=MAX_BATCH_WINDOW_S,
        description="how long a batch not yet full waits for more items, from its oldest item's "
        "arrival (0: take what is queued)",
    )
    queue_items: PositiveInt | None = Field(
        None,
        description="items waiting for the tower before intake refuses (default: 4096 on the "
        "CPU, 16384 on CUDA)",
    )
    max_queue_wait_s: PositiveSeconds = Field(
        30.0,
        description="longest an item may wait for the tower, estimated from the work queued "
        "ahead of it and the tower's measured pace: intake refuses a longer wait (busy, with "
        "when to retry), and never more than half the room's lifetime",
    )
    queue_bytes: PositiveByteSize = Field(
        1 << 30, description="payload bytes waiting for the tower before intake refuses"
    )
    max_payload_bytes: PositiveByteSize = Field(
        64 << 20, description="largest accepted item payload (bytes; K, M, G suffixes)"
    )
    max_image_pixels: PositiveInt = Field(
        MAX_PIXELS,
        description="largest image decoded, in pixels, refused at intake from its header or shape",
    )
    max_video_seconds: PositiveSeconds = Field(
        1800.0, description="longest video decoded (its header's frames / rate), refused at intake"
    )
    max_video_frames: PositiveInt = Field(
        768, description="most frames of one video (after sampling) through the tower"
    )
    max_video_pixels: PositiveInt = Field(
        1 << 28,
        description="most decoded pixels of one video's sampled frames (3 bytes each in memory)",
    )
    batch_pixels: PositiveInt | None = Field(
        None, description="decoded pixels per batch (default: twice --max-image-pixels)"
    )
    ring_bytes: PositiveByteSize = Field(512 << 20, description="send ring size (registered once)")
    ring_slot_bytes: PositiveByteSize = Field(1 << 20, description="send ring slot size")
    cache_bytes: ByteSize = Field(1 << 30, description="embedding cache size (0 = off)")
    receiver_wait_s: PositiveSeconds = Field(
        30.0, description="how long an encoded item waits for its receiver; then its room fails"
    )
    write_timeout_s: PositiveSeconds = Field(30.0, description="deadline of one write")
    room_timeout_s: PositiveSeconds = Field(
        5.0, description="deadline of one call to another endpoint's room API"
    )
    checksum: bool = Field(
        True,
        description="commit with an xxh3-64 checksum of the rows (without it, receivers "
        "must run with require_checksum off)",
    )
    send_workers: PositiveInt = Field(8, description="sender threads")
    media_niceness: int = Field(
        2,
        ge=0,
        le=19,
        description="added to the nice value of the media threads (decode + preprocessing, "
        "tower), so the room API, intake and sends are scheduled first on a busy CPU (0: off)",
    )
    probe_interval_s: PositiveSeconds = Field(
        10.0,
        description="idle tower health probe interval; /readyz "
        "fails after three intervals without a good encode",
    )

    @model_validator(mode="after")
    def _consistent(self) -> WorkerConfig:
        defaults = DEVICE_DEFAULTS.get(self.device.partition(":")[0], DEVICE_DEFAULTS["cpu"])
        for name in ("batch_patches", "batch_items", "queue_items", "preprocess_workers"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(defaults, name))
        if self.batch_pixels is None:
            object.__setattr__(self, "batch_pixels", 2 * self.max_image_pixels)
        if self.bootstrap_port and self.bootstrap_port == self.intake_port:
            raise SettingError(f"--bootstrap-port and --intake-port are both {self.intake_port}")
        if self.ring_slot_bytes > self.ring_bytes:
            raise SettingError(
                f"--ring-slot-bytes {self.ring_slot_bytes} is larger than the ring "
                f"(--ring-bytes {self.ring_bytes})"
            )
        if self.batch_pixels < self.max_image_pixels:
            raise SettingError(
                f"--batch-pixels {self.batch_pixels} is below --max-image-pixels "
                f"{self.max_image_pixels}"
            )
        self.closed(
            self.bind,
            {"--token-file": self.handshake_token, "--intake-token-file": self.intake_token},
        )
        return self
