"""``GatewaySettings``: every setting of ``epd-gateway``, once; its flags, ``EPD_GATEWAY_<FLAG>``
environment variables, secret files and ``--help`` are generated from these fields."""

from __future__ import annotations

import json
from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic_settings import CliSuppress, NoDecode, SettingsConfigDict

from epdserve.dispatcher.settings import EncodeWorkerTargets, HttpUrl
from epdserve.gateway.placement import PLACEMENT_PATTERN
from epdserve.process_settings import (
    ByteSize,
    NonNegativeInt,
    NonNegativeSeconds,
    Port,
    PositiveInt,
    PositiveSeconds,
    SettingError,
)
from epdserve.process_settings.groups import ClosedListener
from epdserve.process_settings.secrets import read_secret
from epdserve.wire.modality import BY_VLLM_NAME


def _media_limits(value: object) -> dict[str, int] | None:
    """vLLM's ``--limit-mm-per-prompt`` JSON (``{"image": 8, "video": 0}``); blank: none."""
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{value!r} is not JSON: {exc.msg}") from None
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        kind in BY_VLLM_NAME and isinstance(count, int) and count >= 0
        for kind, count in value.items()
    ):
        raise ValueError(
            f"{value!r}: a JSON object of {', '.join(BY_VLLM_NAME)} -> a count of at least 0"
        )
    return dict(value)


# NoDecode: the environment's value is the flag's JSON text
MediaLimits = Annotated[dict[str, int] | None, NoDecode, BeforeValidator(_media_limits)]


class GatewaySettings(EncodeWorkerTargets, ClosedListener):
    """OpenAI's chat completions API in front of encode workers and vLLM. --model is the
    checkpoint vLLM serves, read for its image processor config only (rows per image, as the
    encode workers compute them)."""

    model_config = SettingsConfigDict(env_prefix="EPD_GATEWAY_")
    PROG: ClassVar[str] = "epd-gateway"

    host: str = Field("0.0.0.0", min_length=1, description="address to listen on")
    port: Port = Field(8000, description="port to listen on")
    api_key_file: str | None = Field(
        None,
        description="file holding the API key clients send (Authorization: Bearer) to /v1, as "
        "vLLM's --api-key; needed to listen beyond loopback (or --insecure-listen)",
    )
    api_key: CliSuppress[str | None] = Field(None, repr=False, exclude=True)
    vllm_api_key_file: str | None = Field(
        None, description="file holding vLLM's --api-key, sent with every call to vLLM"
    )
    vllm_api_key: CliSuppress[str | None] = Field(None, repr=False, exclude=True)
    docs: bool = Field(False, description="serve /docs and /openapi.json")
    drain_s: PositiveSeconds = Field(
        25.0,
        description="on SIGTERM, how long answers in flight (streams included) may take to "
        "finish before the gateway stops; keep it below the pod's terminationGracePeriodSeconds",
    )
    vllm_url: HttpUrl = Field(
        description="the vLLM OpenAI server with the EPD connector, http://host:port"
    )
    engine_url: HttpUrl = Field(
        description="the EPD connector's HTTP port in vLLM (its http_port), http://host:port: "
        "the gateway reads there what vLLM runs (/v1/engine: the model's fingerprint, "
        "--mm-processor-kwargs, --limit-mm-per-prompt) and follows it"
    )
    worker_wait_s: NonNegativeSeconds = Field(
        30.0,
        description="once vLLM's engine is known, stay not ready up to this long while an encode "
        "worker is still starting (unreachable or not ready); each worker's state is in /readyz",
    )
    max_image_bytes: ByteSize = Field(
        20 << 20, description="largest image taken (data URI or fetched)"
    )
    max_video_bytes: ByteSize = Field(
        64 << 20, description="largest video taken (data URI or fetched)"
    )
    fetch_timeout_s: PositiveSeconds = Field(
        10.0, description="time to fetch one http(s) image or video, redirects included"
    )
    max_redirects: NonNegativeInt = Field(
        3, description="redirects followed when fetching an image"
    )
    allow_private_urls: bool = Field(
        False, description="fetch image URLs on loopback, private and link-local addresses"
    )
    limit_mm_per_prompt: MediaLimits = Field(
        None,
        description='items of each modality per prompt (JSON, e.g. {"image": 8}): vLLM\'s '
        "own (read from the engine) unless given, and then it must be the same; a request "
        "with more is refused here (400) before any worker encodes it",
    )
    max_body_bytes: ByteSize = Field(100 << 20, description="largest request body taken")
    max_receiving_bytes: ByteSize = Field(
        1 << 30,
        description="bytes of request bodies being received at once (not yet counted in "
        "--max-in-flight); past it a request gets 503 and Retry-After",
    )
    body_timeout_s: PositiveSeconds = Field(
        30.0,
        description="time to receive a request's whole body; a slower upload gets 408 (it is "
        "not counted in --max-in-flight until its body is in)",
    )
    # each request in flight holds its body: this and --max-receiving-bytes bound its memory
    max_in_flight: PositiveInt = Field(
        256, description="chat requests served at once; one more gets 503 and Retry-After"
    )
    request_timeout_s: PositiveSeconds = Field(600.0, description="time for vLLM's whole answer")
    stage_wait_s: NonNegativeSeconds = Field(
        30.0,
        description="forward a request once its encode workers hold its items' rows (waiting "
        "at most this; 0: at once), so that vLLM waits for a write, not an encode; rooms at the "
        "workers only (not with --rooms-url)",
    )
    placement: str = Field(
        "cost",
        pattern=PLACEMENT_PATTERN,
        description="where images are encoded: cost (by the route, encode workers or vLLM's own "
        "tower, whose time to first token, learned from the recent requests, is predicted "
        "sooner), workers (on the encode workers whenever one takes them), or min-items=N (a "
        "request of fewer than N distinct images is encoded by vLLM inline, SGLang's adaptive "
        "dispatch rule)",
    )
    max_inline_patches: NonNegativeInt = Field(
        16384,
        description="tower patches vLLM encodes inline at once for images the busy encode "
        "workers would keep past their deadline (overflow); past it such a request gets 503 and "
        "Retry-After (0: never overflow)",
    )
    retry_colocated: bool = Field(
        True,
        description="when a request's encode-worker images fail inside vLLM, "
        "send it once more with the images inline (vLLM encodes them)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="debug, info, warning, error"
    )

    @model_validator(mode="before")
    @classmethod
    def _read_keys(cls, data):
        if isinstance(data, dict):
            for key, path in (("api_key", "api_key_file"), ("vllm_api_key", "vllm_api_key_file")):
                if not data.get(key) and data.get(path):
                    data = {**data, key: read_secret(data[path], "--" + path.replace("_", "-"))}
        return data

    @model_validator(mode="after")
    def _closed(self) -> GatewaySettings:
        self.closed(self.host, {"--api-key-file": self.api_key})
        return self

    @model_validator(mode="after")
    def _vllm_urls_given(self) -> GatewaySettings:
        for name in ("vllm_url", "engine_url"):
            if getattr(self, name) is None:
                flag = "--" + name.replace("_", "-")
                raise SettingError(f"{flag} (or {self.env_name(name)}) is required")
        return self
