"""What vLLM runs, read from the engine itself, and the gateway's own sizing made to agree with it.

The EPD connector serves its ``EngineDescription`` at ``GET <engine-url>/v1/engine``: the model's
fingerprint (what vLLM loaded and applies), its ``--mm-processor-kwargs`` and its
``--limit-mm-per-prompt``. The gateway takes those three from there, never from a second copy:

* the processor kwargs and the per-prompt limits are vLLM's, unless the gateway was given its own,
  which must then be the same;
* the image and video processors the gateway sizes items with (its ``--model``'s configs, with
  vLLM's kwargs) must make the settings vLLM's fingerprint records, or the gateway would send
  vLLM grids it sizes otherwise;
* the fingerprint is what every item sent to a worker says, and what keeps a worker of another
  model out of rotation (``dispatcher.workers``).

Any disagreement is an ``EngineMismatch``: the gateway refuses to serve, and says what differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from pydantic import ValidationError

from epdserve.fingerprints import processor_settings
from epdserve.process_settings import SettingError
from epdserve.wire.fingerprint import EngineDescription

ENGINE_PATH = "/v1/engine"


class EngineMismatch(Exception):
    """The gateway's flags or checkpoint disagree with the engine it fronts."""


class EngineUnreadable(Exception):
    """The engine's description could not be read (yet): why."""


async def read_engine(session: aiohttp.ClientSession, url: str) -> EngineDescription:
    """The engine's description at ``url`` (``EngineUnreadable`` with why, when it cannot be)."""
    try:
        async with session.get(url + ENGINE_PATH) as response:
            if response.status != 200:
                raise EngineUnreadable(f"{url}{ENGINE_PATH} answered {response.status}")
            return EngineDescription.model_validate_json(await response.read())
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EngineUnreadable(f"{url}{ENGINE_PATH} unreachable: {type(exc).__name__}") from None
    except ValidationError as exc:
        raise EngineUnreadable(
            f"{url}{ENGINE_PATH} is no engine description: {exc.errors(include_url=False)[:2]}"
        ) from None


def _sizing_settings(settings: dict | None) -> dict | None:
    """A processor's settings without its class: the gateway only sizes with it (PIL's or
    torchvision's, the same sizes)."""
    if settings is None:
        return None
    return {key: value for key, value in settings.items() if key != "class"}


@dataclass(frozen=True)
class EngineModel:
    """The engine's description, and what the gateway sizes items with for it."""

    description: EngineDescription
    processor: object  # the image processor
    video_processor: object | None  # None: videos are refused (400)
    family: object  # epdserve.vision.families.TowerFamily
    limits: dict[str, int]  # items of each modality in one prompt

    @property
    def fingerprint(self) -> str:
        return self.description.fingerprint.compact

    @classmethod
    def agree(cls, settings, description: EngineDescription) -> EngineModel:
        """The gateway's sizing for ``description``'s engine (``settings``: its own); an
        ``EngineMismatch`` saying what differs when they cannot agree."""
        given = settings.model_fields_set
        kwargs = description.mm_processor_kwargs
        if "mm_processor_kwargs" in given and settings.mm_processor_kwargs != kwargs:
            raise EngineMismatch(
                f"--mm-processor-kwargs {settings.mm_processor_kwargs} differs from vLLM's "
                f"{kwargs}: leave it out (the gateway takes vLLM's)"
            )
        limits = description.limit_mm_per_prompt
        own_limits = settings.limit_mm_per_prompt
        if own_limits is not None and any(limits.get(k) != v for k, v in own_limits.items()):
            raise EngineMismatch(
                f"--limit-mm-per-prompt {own_limits} differs from vLLM's {limits}: leave it out "
                "(the gateway takes vLLM's)"
            )
        try:
            family = settings.family()
            processor = settings.image_processor(kwargs)
            video_processor = settings.video_processor(kwargs)
        except SettingError as exc:
            raise EngineMismatch(str(exc)) from None
        fingerprint = description.fingerprint
        if family.model_type != fingerprint.model_type:
            raise EngineMismatch(
                f"--model {settings.model} is a {family.model_type} checkpoint; vLLM runs "
                f"{fingerprint.model_type}"
            )
        for name, mine, engine in (
            ("image", processor, fingerprint.preprocessing),
            ("video", video_processor, fingerprint.video),
        ):
            own = _sizing_settings(processor_settings(mine))
            if own is not None and engine is not None and own != _sizing_settings(engine):
                different = sorted(
                    k
                    for k in own.keys() | engine.keys()
                    if k != "class" and (own.get(k) != engine.get(k))
                )
                raise EngineMismatch(
                    f"--model {settings.model}'s {name} processor, with vLLM's kwargs {kwargs}, "
                    f"differs from vLLM's in {', '.join(different)}: "
                    + "; ".join(
                        f"{k} {own.get(k)} here, {engine.get(k)} at vLLM" for k in different
                    )
                )
        return cls(
            description,
            processor,
            video_processor if fingerprint.video is not None else None,
            family,
            limits,
        )
