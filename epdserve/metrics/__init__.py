"""Prometheus conventions every EPD process shares: latency buckets fine enough for sub-millisecond
transfers, and the ``model_name`` label on every family (as vLLM's metrics carry it), added at
exposition so no metric spells it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

# Seconds. Transfers and room calls here take 0.1-1 ms, towers and requests up to seconds.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# What orchestrators and scrapers call (liveness, readiness, scrapes): not request traffic.
PROBE_PATHS = frozenset({"/health", "/healthz", "/readyz", "/metrics"})


class WithModelName:
    """Every sample of ``registry`` with ``model_name`` added (a family that has the label keeps
    its own)."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.registry = registry
        self.model_name = model_name

    def collect(self):
        for family in self.registry.collect():
            family.samples = [
                sample
                if "model_name" in sample.labels
                else sample._replace(labels={"model_name": self.model_name, **sample.labels})
                for sample in family.samples
            ]
            yield family


def exposition_registry(registry: CollectorRegistry, model_name: str | None) -> CollectorRegistry:
    """A registry to serve on ``/metrics``: ``registry``'s families, each with ``model_name``
    (``registry`` itself when there is no model to name: a standalone room authority)."""
    if not model_name:
        return registry
    served = CollectorRegistry(auto_describe=False)
    served.register(WithModelName(registry, model_name))
    return served
