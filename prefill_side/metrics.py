"""The receiver's Prometheus families, in the registry it is given (``model_name`` is added
where they are served): items by transport and outcome, latency, bytes, fallbacks, and the pool
and transports as they stand."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from metrics import LATENCY_BUCKETS
from prefill_side.receive_pool import ReceivePool


class ReceiverMetrics:
    def __init__(self, registry: CollectorRegistry, receive_pool: ReceivePool):
        self.items = Counter(
            "epd_prefill_items",
            "Items by transport and outcome",
            ["transport", "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "epd_prefill_receive_seconds",
            "Start of job to item published",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.bytes = Counter(
            "epd_prefill_bytes", "Bytes received", ["transport"], registry=registry
        )
        self.fallbacks = Counter(
            "epd_prefill_fallbacks", "Items encoded by the local tower", registry=registry
        )
        pool = receive_pool.pool
        Gauge(
            "epd_prefill_pool_leased_slots", "Receive pool slots leased", registry=registry
        ).set_function(lambda: pool.stats()["leased_slots"])
        Gauge(
            "epd_prefill_pool_quarantined_slots",
            "Receive pool slots in quarantine",
            registry=registry,
        ).set_function(lambda: pool.stats()["quarantined_slots"])
        offered = Gauge(
            "epd_prefill_transport_offered",
            "1 while the transport is offered to writers, "
            "0 once lost (the SHM pool segment unlinked)",
            ["transport"],
            registry=registry,
        )
        for name in receive_pool.transports:
            offered.labels(name).set_function(lambda name=name: name not in receive_pool.lost)

    def failed(self) -> None:
        """An item failed (no transport delivered it)."""
        self.items.labels("none", "failed").inc()
