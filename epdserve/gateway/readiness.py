"""Whether the gateway can serve, and what against: vLLM's engine followed.

What vLLM runs is read from vLLM itself (``engine``: its model's fingerprint, its processor kwargs
and per-prompt limits, from the EPD connector's ``/v1/engine``) until known, then again every
``ENGINE_INTERVAL_S``; the gateway sizes items as vLLM would (the dispatcher is made for the
engine, and sized again when its model changes), refuses to serve when its own flags or checkpoint
disagree with vLLM's, and keeps a worker of another model out of rotation. It is ready once it
knows the engine and has probed its workers (and, for ``--worker-wait-s`` from then, waited for
those still starting). On the same loop, vLLM's load is read from its ``/metrics``
(``engine_load``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from epdserve.dispatcher.dispatch import Dispatcher
from epdserve.dispatcher.workers import WorkerSet
from epdserve.gateway.engine import EngineMismatch, EngineModel, EngineUnreadable, read_engine
from epdserve.gateway.engine_load import EngineLoad
from epdserve.gateway.settings import GatewaySettings
from epdserve.wire.addresses import Endpoint
from epdserve.wire.fingerprint import EngineDescription

log = logging.getLogger(__name__)
ENGINE_INTERVAL_S = 2.0  # how often the engine's description is read again once known
ENGINE_RETRY_S = 0.5  # ... while it is not known yet


class Readiness:
    """vLLM's engine as the gateway follows it (``follow``), the dispatcher made for it, its
    load (``load``), and whether the gateway is ready (``not_ready``)."""

    def __init__(
        self,
        settings: GatewaySettings,
        workers: WorkerSet,
        load: EngineLoad,
        on_refusal: Callable[[str], None],
    ):
        """``on_refusal(reason)``: called once when the gateway's flags or checkpoint disagree
        with the engine's; until then, and after, the gateway is not ready."""
        self.settings = settings
        self.workers = workers
        self.load = load
        self.on_refusal = on_refusal
        self.engine: EngineModel | None = None  # what vLLM runs, once read from vLLM
        self.engine_known_at = 0.0
        self.engine_problem = f"vLLM's engine not read yet ({settings.engine_url})"
        self.refused: str | None = None
        self.dispatcher: Dispatcher | None = None  # made once the engine is known

    async def follow(self) -> None:
        """Read the engine's description until known, then again every ``ENGINE_INTERVAL_S``;
        once it is known, vLLM's load each time (every call bounded by the session's 2 s)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            while self.refused is None:
                try:
                    self._learn(await read_engine(session, self.settings.engine_url))
                except EngineUnreadable as exc:
                    if self.engine is None:
                        self.engine_problem = str(exc)
                if self.engine is not None:
                    await self.load.read(session)
                await asyncio.sleep(ENGINE_INTERVAL_S if self.engine else ENGINE_RETRY_S)

    def _learn(self, description: EngineDescription) -> None:
        """The engine as vLLM describes it now: sizing made to agree with it, its model the one
        items are sent for and workers are judged by; a disagreement refuses to serve."""
        if self.engine is not None and description == self.engine.description:
            return
        try:
            engine = EngineModel.agree(self.settings, description)
        except EngineMismatch as exc:
            self.refused = f"cannot serve vLLM at {self.settings.vllm_url}: {exc}"
            log.error("%s", self.refused)
            self.on_refusal(self.refused)
            return
        if self.engine is None:
            log.info(
                "vLLM runs %s (model %s; limits %s)",
                description.served_model_name,
                engine.fingerprint,
                engine.limits,
            )
            self.engine_known_at = time.monotonic()
            self.dispatcher = Dispatcher(
                self.workers,
                engine.processor,
                engine.video_processor,
                rooms_url=self.settings.rooms_url,
                served_model=self.settings.served_model_name,
                handshake_token=self.settings.handshake_token,
                intake_token=self.settings.intake_token,
                intake_timeout_s=self.settings.intake_timeout_s,
                sizing=engine.family.sizing,
                max_image_pixels=self.settings.max_image_pixels,
                fingerprint=engine.fingerprint,
            )
        else:
            log.warning("vLLM's model changed: now %s", engine.fingerprint)
            self.dispatcher.size_for(
                engine.processor, engine.video_processor, engine.family.sizing, engine.fingerprint
            )
        self.engine = engine
        self.workers.set_engine(description.fingerprint)

    def worker_lost(self, endpoint: Endpoint, reason: str) -> None:
        """A worker's room stream closed under waiting items: it leaves the ring now, not at
        its next check."""
        if endpoint.authority in self.workers.status():
            self.workers.mark_down(self.workers.address(endpoint.authority), reason)

    def not_ready(self) -> str | None:
        """Why the gateway should get no requests now, or None: it must know the engine, have
        probed its workers since, and (for ``--worker-wait-s`` from then) have seen each worker
        ready or of another model."""
        if self.refused is not None:
            return self.refused
        if self.engine is None:
            return self.engine_problem
        if self.workers.rounds == 0:
            return "probing the encode workers"
        waited = time.monotonic() - self.engine_known_at
        if not self.workers.settled() and waited < self.settings.worker_wait_s:
            return f"waiting up to {self.settings.worker_wait_s:g} s for encode workers to start"
        return None

    @property
    def video_seconds(self) -> bool:
        """Whether the model's positions take a video's seconds per temporal patch (Qwen2.5-VL)."""
        engine = self.engine
        return (
            engine is not None
            and engine.video_processor is not None
            and (engine.family.video_seconds)
        )

    @property
    def video_timestamps(self) -> bool:
        """Whether the model's prompt states each temporal patch's time (Qwen3-VL, Qwen3.5)."""
        engine = self.engine
        return (
            engine is not None
            and engine.video_processor is not None
            and engine.family.video_timestamps
        )

    @property
    def grid_only_requests(self) -> bool:
        """Whether vLLM takes a placed item as its grid alone (else the request carries the item
        itself: Gemma 3)."""
        engine = self.engine
        return engine is None or engine.family.grid_only_requests
