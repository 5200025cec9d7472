"""``PrefillSettings``: every setting of ``epd-prefill``, once (its flags, ``EPD_PREFILL_<FLAG>``
variables and ``--help`` are generated from them): the receiver's, its Mooncake engine's and the
model's groups, and the process's own."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from epdserve.process_settings import (
    Dtype,
    NonNegativeInt,
    Port,
    PositiveByteSize,
    PositiveInt,
    SettingError,
)
from epdserve.process_settings.groups import (
    ClosedListener,
    ModelNaming,
    ReceiverTransportSettings,
)
from epdserve.process_settings.secrets import HandshakeToken
from prefill_side.settings import ReceiverSettings

MAX_BODY_BYTES = 256 << 20  # a request's whole body: items, and image bytes when they travel


class PrefillSettings(
    HandshakeToken, ReceiverSettings, ReceiverTransportSettings, ModelNaming, ClosedListener
):
    """Reference prefill process: receives each item's rows from the encode workers. Rows arrive in
    the encode workers' dtype: --dtype must be theirs, and --width their tower's row width (--model
    gives it). A mismatch fails every item."""

    model_config = SettingsConfigDict(env_prefix="EPD_PREFILL_")
    PROG: ClassVar[str] = "epd-prefill"

    host: str = Field("0.0.0.0", min_length=1, description="address to listen on")
    port: Port = Field(9100, description="port of /v1/prefill, /healthz, /readyz, /metrics")
    model: str | None = Field(
        None,
        description="checkpoint for verification / fallback; also gives --width and "
        "--deepstack-width",
    )
    width: NonNegativeInt = Field(
        0, description="wire width of one row (the encode workers' tower's; default: from --model)"
    )
    deepstack_width: NonNegativeInt = Field(
        0, description="the last columns of a row that are DeepStack levels (default: from --model)"
    )
    dtype: Dtype = Field(
        "bfloat16",
        description="dtype of the rows: the encode workers' --dtype (bfloat16, float16, float32)",
    )
    fallback: Literal["fail", "local_tower"] = Field(
        "fail",
        description="an item whose rows do not arrive: fail it, or encode it here (needs --model)",
    )
    tower_calls: PositiveInt = Field(
        1,
        description="local tower forward passes at once (colocated items, fallback, verification)",
    )
    max_body_bytes: PositiveByteSize = Field(
        MAX_BODY_BYTES, description="largest accepted request body"
    )

    @model_validator(mode="after")
    def _consistent(self) -> PrefillSettings:
        # its /v1/prefill takes the handshake token as its bearer
        self.closed(self.host, {"--token-file": self.handshake_token})
        if self.slot_bytes > self.pool_bytes:
            raise SettingError(
                f"--slot-bytes {self.slot_bytes} is larger than --pool-bytes {self.pool_bytes}"
            )
        return self
