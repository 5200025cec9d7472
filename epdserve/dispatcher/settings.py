"""Where the encode workers are and how to reach them, as process settings: ``epd-dispatch`` and
``epd-gateway`` take the same flags for it."""

from __future__ import annotations

from typing import Annotated

import yarl
from pydantic import BeforeValidator, Field, model_validator
from pydantic_settings import NoDecode

from epdserve.dispatcher.workers import WorkerAddress
from epdserve.process_settings import (
    Port,
    PositiveInt,
    PositiveSeconds,
    SettingError,
    check_checkpoint,
)
from epdserve.process_settings.groups import ModelNaming
from epdserve.process_settings.secrets import HandshakeToken, IntakeToken
from epdserve.vision.limits import MAX_PIXELS
from epdserve.wire.addresses import DEFAULT_BOOTSTRAP_PORT, DEFAULT_INTAKE_PORT


def _workers(value: object) -> tuple[WorkerAddress, ...]:
    parts = value.split(",") if isinstance(value, str) else list(value)
    return tuple(
        part if isinstance(part, WorkerAddress) else WorkerAddress.parse(part)
        for part in parts
        if not isinstance(part, str) or part.strip()
    )


def http_url(value: object) -> str | None:
    """An ``http(s)://host[:port]`` URL without its trailing slash; blank is none."""
    if value is None or not str(value).strip():
        return None
    url = yarl.URL(str(value))
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"{value!r} is not an http:// URL")
    return str(value).rstrip("/")


def _blank_is_none(value: object) -> object:
    return None if isinstance(value, str) and not value.strip() else value


WorkerList = Annotated[tuple[WorkerAddress, ...], NoDecode, BeforeValidator(_workers)]
HttpUrl = Annotated[str | None, BeforeValidator(http_url)]
OptionalText = Annotated[str | None, BeforeValidator(_blank_is_none)]


class EncodeWorkerTargets(HandshakeToken, IntakeToken, ModelNaming):
    """The encode workers (a static list or a DNS name), their rooms, and the model whose image
    and video processor configs size each item (rows per item, as the workers compute them)."""

    model: str = Field(
        min_length=1,
        description="checkpoint directory whose image and video processor configs the encode "
        "workers use",
    )
    workers: WorkerList = Field(
        (),
        description="static encode workers: comma-separated "
        "host[:bootstrap_port[:intake_port]], e.g. 10.0.0.5,[fd00::6]:9000:9001",
    )
    dns: OptionalText = Field(
        None, description="DNS name listing the encode workers (a Kubernetes headless Service)"
    )
    bootstrap_port: Port = Field(
        DEFAULT_BOOTSTRAP_PORT, description="workers' bootstrap (rooms) port, with --dns"
    )
    intake_port: Port = Field(DEFAULT_INTAKE_PORT, description="workers' intake port, with --dns")
    rooms_url: HttpUrl = Field(
        None,
        description="standalone handshake endpoint for all rooms (default: each item's worker)",
    )
    near: OptionalText = Field(
        None, description="host of the prefill engine: its encode workers go first (same-node SHM)"
    )
    intake_timeout_s: PositiveSeconds = Field(
        5.0,
        description="time for a worker's intake to answer an item; past it the worker is "
        "marked down and the item placed elsewhere (or sent to vLLM inline)",
    )
    max_image_pixels: PositiveInt = Field(
        MAX_PIXELS,
        description="largest image (width x height, from its header) sent on; a larger one is "
        "refused (400), never decoded by anyone: the workers' --max-image-pixels",
    )

    @model_validator(mode="after")
    def _some_workers(self):
        if not self.workers and not self.dns:
            raise SettingError(
                "give the encode workers: --workers host[:bootstrap_port[:intake_port]],... "
                "or --dns NAME"
            )
        return self

    def family(self):
        """``--model``'s vision family (``vision.families``): its sizing rules and more."""
        from epdserve.vision.families import FAMILIES, TowerLoadError, detect_family

        try:
            return FAMILIES[detect_family(check_checkpoint(self.model, weights=False))]
        except TowerLoadError as exc:
            raise SettingError(f"--model {self.model}: {exc}") from None

    def image_processor(self, processor_kwargs: dict | None = None):
        """``--model``'s image processor (checked: a checkpoint directory with its config), as
        its model's processor applies it, with ``processor_kwargs`` over it (default:
        ``--mm-processor-kwargs``; ``vision.image_processor``)."""
        from epdserve.vision.image_processor import load_image_processor

        directory = check_checkpoint(self.model, weights=False)
        kwargs = self.mm_processor_kwargs if processor_kwargs is None else processor_kwargs
        try:
            return load_image_processor(directory, kwargs)
        except (OSError, ValueError) as exc:
            raise SettingError(
                f"--model {self.model}: cannot read its image processor config: {exc}"
            ) from None

    def video_processor(self, processor_kwargs: dict | None = None):
        """``--model``'s video processor (``processor_kwargs`` as ``image_processor``'s); None
        (logged) when the checkpoint has none."""
        from epdserve.vision.video import load_video_processor

        return load_video_processor(
            check_checkpoint(self.model, weights=False),
            self.mm_processor_kwargs if processor_kwargs is None else processor_kwargs,
        )
