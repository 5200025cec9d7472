"""The receiver's Prometheus families, in the registry it is given (``model_name`` is added
where they are served): items by transport and outcome, latency, bytes, fallbacks, and the pool
and transports as they stand."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epdserve.metrics import LATENCY_BUCKETS
from prefill_side.receive_pool import ReceivePool

OTHER_TRANSPORT = "other"  # the label of an item a writer delivered over a transport not offered


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
        # the delivered-item series by transport, made once (``labels()`` takes a lock and checks
        # its values at every call): each offered transport's, and one for any other name a
        # writer's commit gives (the room table does not check it against the offers; counted
        # apart from them, not as a label per name)
        self._delivered = {
            name: (self.items.labels(name, "done"), self.bytes.labels(name))
            for name in (*receive_pool.transports, OTHER_TRANSPORT)
        }

    def delivered(self, transport: str | None, nbytes: int, seconds: float) -> None:
        """An item published: its transport's count and bytes, and its latency."""
        items, received = self._delivered.get(transport) or self._delivered[OTHER_TRANSPORT]
        items.inc()
        received.inc(nbytes)
        self.latency.observe(seconds)

    def failed(self) -> None:
        """An item failed (no transport delivered it)."""
        self.items.labels("none", "failed").inc()
