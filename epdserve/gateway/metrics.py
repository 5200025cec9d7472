"""The gateway's Prometheus families, each labelled ``model_name``: requests by outcome, images by
encoder, colocated fallbacks by reason, placements by route and reason, the patches vLLM encodes
inline, each route's learned cost, the error of its predictions and the engine's load they count
with its source (``--placement cost``),
dispatch time, time to first token, requests in flight, encode workers by state (an incompatible
one serves another model than vLLM's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epdserve.metrics import LATENCY_BUCKETS

# measured over predicted: a quarter .. eight times
ERROR_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)


class GatewayMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        self.requests = Counter(
            "epd_gateway_requests",
            "Chat requests by outcome",
            labels + ["outcome"],
            registry=self.registry,
        )
        self.images = Counter(
            "epd_gateway_images",
            "Images and videos by who encoded them (encode_worker, colocated)",
            labels + ["encoder"],
            registry=self.registry,
        )
        self.colocated = Counter(
            "epd_gateway_colocated_fallbacks",
            "Images sent to vLLM inline instead of an encode worker, by reason",
            labels + ["reason"],
            registry=self.registry,
        )
        self.placements = Counter(
            "epd_gateway_placements",
            "Images and videos by where they were encoded (route: encode_worker, vllm, refused) "
            "and why (gateway.placement.Reason)",
            labels + ["route", "reason"],
            registry=self.registry,
        )
        self.inline_patches = Gauge(
            "epd_gateway_inline_patches",
            "Tower patches of the images vLLM encodes inline now (requests before their first "
            "token); overflow of busy encode workers stays under --max-inline-patches",
            labels,
            registry=self.registry,
        )
        self.inline_patches_peak = Gauge(
            "epd_gateway_inline_patches_peak",
            "The most tower patches vLLM encoded inline at once since the gateway started",
            labels,
            registry=self.registry,
        )
        self.placement_cost = Gauge(
            "epd_gateway_placement_cost_seconds",
            "--placement cost: each route's learned time to first token (the median of its "
            "recent requests) by size class (the request's tower patches, at most)",
            labels + ["route", "size_class"],
            registry=self.registry,
        )
        self.prediction_error = Histogram(
            "epd_gateway_placement_prediction_error_ratio",
            "--placement cost: a request's measured time to first token over the one predicted "
            "for the route it took, where measured before (not a prior; 1: right; above: slower "
            "than predicted)",
            labels + ["route"],
            buckets=ERROR_RATIO_BUCKETS,
            registry=self.registry,
        )
        self.engine_load = Gauge(
            "epd_gateway_engine_load_requests",
            "--placement cost: the requests in vLLM (running and waiting) the prediction of "
            "vLLM's own tower counts: the larger of vLLM's gauges and the gateway's own",
            labels,
            registry=self.registry,
        )
        self.engine_load_source = Gauge(
            "epd_gateway_engine_load_source",
            "Where the engine's load comes from (1: the source now): vllm_metrics (vLLM's "
            "/metrics gauges, or the gateway's own count where larger), gateway (the gateway's "
            "own count: vLLM's gauges unreadable)",
            labels + ["source"],
            registry=self.registry,
        )
        self.dispatch = Histogram(
            "epd_gateway_dispatch_seconds",
            "Request start -> every image placed",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.staged = Histogram(
            "epd_gateway_stage_wait_seconds",
            "Every image placed -> every image's rows held by its encode worker (or its room "
            "ended), before the request goes to vLLM",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_token = Histogram(
            "epd_gateway_time_to_first_token_seconds",
            "Request start -> first token relayed (streaming) or the answer",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "epd_gateway_requests_in_flight",
            "Chat requests being served now",
            labels,
            registry=self.registry,
        )
        self.workers = Gauge(
            "epd_gateway_encode_workers",
            "Encode workers by state: ready (in rotation), unready, incompatible (another model "
            "than vLLM's: /readyz says what differs)",
            labels + ["state"],
            registry=self.registry,
        )
        self.model_name = model_name

    def placed(self, route: str, reason: str) -> None:
        self.placements.labels(self.model_name, route, reason).inc()

    def inline_now(self, patches: int, peak: int) -> None:
        self.inline_patches.labels(self.model_name).set(patches)
        self.inline_patches_peak.labels(self.model_name).set(peak)

    def costs_now(self, costs: dict[tuple[str, str], float]) -> None:
        for (route, size_class), seconds in costs.items():
            self.placement_cost.labels(self.model_name, route, size_class).set(seconds)

    def engine_load_now(self, requests: int, source: str, sources: tuple[str, ...]) -> None:
        self.engine_load.labels(self.model_name).set(requests)
        for each in sources:
            self.engine_load_source.labels(self.model_name, each).set(each == source)

    def workers_now(self, states: dict[str, int]) -> None:
        for state, count in states.items():
            self.workers.labels(self.model_name, state).set(count)

    def count(self, outcome: str) -> None:
        self.requests.labels(self.model_name, outcome).inc()
