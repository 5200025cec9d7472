"""vLLM's engine load as ``--placement cost`` counts it: the requests running and waiting there.

Read from vLLM's own ``/metrics`` (Prometheus text; its gauges ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``, one sample per engine, summed) on the gateway's readiness loop,
every time it reads the engine's description. The load the cost model uses is the larger of that
and the gateway's own requests for vLLM now, counted from their admission (the requests of a
burst see each other before they reach vLLM; other clients of the same vLLM count too);
where ``/metrics`` is unreachable, or lacks the gauges, or hands back what cannot be a count (a
body over ``MAX_METRICS_BYTES``, no number, NaN, infinite, negative, over
``MAX_ENGINE_REQUESTS``), the gateway's own count alone, said once in the log and in the
``epd_gateway_engine_load_source`` gauge."""

from __future__ import annotations

import logging
import math

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from epdserve.gateway.bounded_body import read_at_most
from epdserve.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
MAX_METRICS_BYTES = 8 << 20  # a larger /metrics body is not read
MAX_ENGINE_REQUESTS = 1_000_000  # a gauge above it is not a count of requests
VLLM_METRICS = "vllm_metrics"  # the load source: vLLM's gauges (or the gateway's count, larger)
GATEWAY = "gateway"  # the load source: the gateway's own count only
SOURCES = (VLLM_METRICS, GATEWAY)


class EngineLoadUnreadable(Exception):
    """vLLM's load could not be read from its ``/metrics``: why."""


def engine_requests(text: str) -> int:
    """The requests running and waiting in vLLM, summed over its engines, from its ``/metrics``
    ``text``; ``EngineLoadUnreadable`` where a gauge is missing or a sample is no count."""
    # only the two gauges' lines are parsed: the rest (histograms) is most of the body
    lines = [line for line in text.splitlines() if line.startswith(ENGINE_GAUGES)]
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except (ValueError, IndexError, TypeError) as exc:
        raise EngineLoadUnreadable(f"unparsable gauges: {type(exc).__name__}") from None
    found = dict.fromkeys(ENGINE_GAUGES, 0.0)
    seen: set[str] = set()
    for family in families:
        for sample in family.samples:
            if sample.name not in found:
                continue
            value = sample.value
            if not math.isfinite(value) or not 0 <= value <= MAX_ENGINE_REQUESTS:
                raise EngineLoadUnreadable(f"{sample.name} is {value!r}, not a count of requests")
            found[sample.name] += value
            seen.add(sample.name)
    missing = [name for name in ENGINE_GAUGES if name not in seen]
    if missing:
        raise EngineLoadUnreadable(f"no {', '.join(missing)}")
    total = sum(found.values())
    if total > MAX_ENGINE_REQUESTS:
        raise EngineLoadUnreadable(f"{total:g} requests, not a count of requests")
    return round(total)


async def read_metrics_text(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> str:
    """vLLM's ``/metrics`` body at ``url`` (at most ``MAX_METRICS_BYTES``), or
    ``EngineLoadUnreadable`` with why."""
    try:
        async with session.get(url + METRICS_PATH, headers=headers) as response:
            if response.status != 200:
                raise EngineLoadUnreadable(f"{url}{METRICS_PATH} answered {response.status}")
            body = await read_at_most(response, MAX_METRICS_BYTES)
            if body is None:
                raise EngineLoadUnreadable(f"{url}{METRICS_PATH} is over {MAX_METRICS_BYTES} bytes")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EngineLoadUnreadable(
            f"{url}{METRICS_PATH} unreachable: {type(exc).__name__}"
        ) from None
    return body.decode("utf-8", errors="replace")


class EngineLoad:
    """The requests in vLLM now, as the cost model counts them (``requests``), and where that
    count comes from (``source``): vLLM's gauges as last read, or the gateway's own count."""

    def __init__(self, url: str, metrics: GatewayMetrics, api_key: str | None = None):
        """``url``: vLLM's OpenAI server (its ``/metrics``); ``api_key``: vLLM's ``--api-key``."""
        self.url = url
        self.metrics = metrics
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        # the gateway's requests for vLLM now: admitted (being placed, forwarded, or answered),
        # not ended; a burst's requests count from their admission, before their rows exist
        self.admitted = 0
        self.engine_requests: int | None = None  # vLLM's gauges as last read; None: unreadable
        self._problem: str | None = None  # why vLLM's gauges are not read, as last logged
        self.exported()

    @property
    def source(self) -> str:
        return GATEWAY if self.engine_requests is None else VLLM_METRICS

    @property
    def requests(self) -> int:
        """The requests in vLLM now: the larger of vLLM's gauges and the gateway's own count."""
        return max(self.engine_requests or 0, self.admitted)

    def others(self) -> int:
        """The requests in vLLM besides one the gateway admitted (vLLM's gauges do not count
        it yet; the gateway's own count does)."""
        return max(self.engine_requests or 0, self.admitted - 1)

    async def read(self, session: aiohttp.ClientSession) -> None:
        """vLLM's gauges read again; where they cannot be, the gateway's own count is the load
        (said once in the log until they can be read again)."""
        try:
            text = await read_metrics_text(session, self.url, self.headers)
            self.engine_requests = engine_requests(text)
        except EngineLoadUnreadable as exc:
            self.engine_requests = None
            if str(exc) != self._problem:
                log.warning(
                    "vLLM's load not read (%s): --placement cost counts the gateway's own "
                    "requests in vLLM",
                    exc,
                )
                self._problem = str(exc)
        else:
            if self._problem is not None:
                log.info("vLLM's load read from %s%s again", self.url, METRICS_PATH)
            self._problem = None
        self.exported()

    def exported(self) -> None:
        """The load and its source as the gateway's gauges."""
        self.metrics.engine_load_now(self.requests, self.source, SOURCES)
