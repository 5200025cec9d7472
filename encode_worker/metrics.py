"""The encode worker's Prometheus families, in its own registry (``model_name`` is added to each
where they are served): what intake answered, items per message, how accepted items ended,
batches, the tower's and preprocessing's time and CPU, the send path, and the queue, ring, cache
and coalescer as they stand."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from encode_worker.cache import EmbeddingCache, InFlightEncodes
from encode_worker.scheduler import BatchQueue
from epdserve.data_plane.pool import SlotPool
from epdserve.metrics import LATENCY_BUCKETS
from epdserve.wire.intake import IntakeStatus
from epdserve.wire.modality import Modality
from epdserve.wire.rooms import RoomState

# waits shorter than this are the batching window and preprocessing, not a queue: no ratio
PREDICTION_FLOOR_S = 0.1
PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0)


class WorkerMetrics:
    """The worker's families (``model_name`` is added to each where they are served). An item is
    counted twice, in two families: once by intake's answer, once by its room's end."""

    def __init__(
        self,
        registry: CollectorRegistry,
        queue: BatchQueue,
        ring: SlotPool,
        cache: EmbeddingCache,
        encodes: InFlightEncodes,
    ):
        self.registry = registry
        self.intake = Counter(
            "epd_encoder_intake",
            "Intake's answer per item: accepted, refused (room untouched), failed (room failed)",
            ["modality", "result"],
            registry=registry,
        )
        self.message_items = Histogram(
            "epd_encoder_intake_message_items",
            "Items per intake message (a dispatcher sends the items of one loop step together)",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=registry,
        )
        self.outcomes = Counter(
            "epd_encoder_items",
            "Accepted items by how their room ended: success, failed, cancelled, expired",
            ["modality", "outcome"],
            registry=registry,
        )
        self.batch_items = Histogram(
            "epd_encoder_batch_items",
            "Items per tower batch",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=registry,
        )
        self.encode_seconds = Histogram(
            "epd_encoder_encode_seconds",
            "Tower time per batch (on a GPU its time on the compute stream: the sum over time is "
            "the share of time the GPU ran the tower)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.oom_splits = Counter(
            "epd_encoder_oom_splits",
            "Batches split in two after running the tower's device out of memory",
            registry=registry,
        )
        self.encode_cpu_seconds = Counter(
            "epd_encoder_encode_cpu_seconds",
            "CPU time of the thread calling the tower (all of the tower's with one intra-op "
            "thread; the rest of the process's CPU is the worker's own)",
            registry=registry,
        )
        self.preprocess_cpu_seconds = Counter(
            "epd_encoder_preprocess_cpu_seconds",
            "CPU time decoding and preprocessing items (image or video processor) for the tower",
            registry=registry,
        )
        self.queue_seconds = Histogram(
            "epd_encoder_queue_seconds",
            "Intake to the tower starting the item's batch",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait_prediction_ratio = Histogram(
            "epd_encoder_queue_wait_prediction_ratio",
            "Intake's estimate of an item's queue wait over the wait it had (items that waited "
            f"or were predicted to wait {PREDICTION_FLOOR_S:g} s or more; 1: right)",
            buckets=PREDICTION_RATIO_BUCKETS,
            registry=registry,
        )
        self.receiver_wait_seconds = Histogram(
            "epd_encoder_receiver_wait_seconds",
            "Rows staged to the receiver registered (or the wait ended)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.transfer_seconds = Histogram(
            "epd_encoder_transfer_seconds",
            "The write alone per delivered item: submit to the transport settled",
            ["transport"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.bytes = Counter(
            "epd_encoder_bytes", "Bytes delivered", ["transport"], registry=registry
        )
        Gauge(
            "epd_encoder_queue_depth", "Items waiting for the tower", registry=registry
        ).set_function(lambda: len(queue))
        Gauge(
            "epd_encoder_ring_occupancy", "Leased fraction of the send ring", registry=registry
        ).set_function(lambda: ring.stats()["leased_slots"] / ring.slot_count)
        registry.register(_CacheCounters(cache, encodes))
        # Labelled series by (family, labels): ``labels()`` takes a lock and checks its values at
        # every call, several times per item. Bounded: every label value is an enum member or a
        # transport's registry name.
        self._series: dict[tuple, object] = {}

    def series(self, family, *labels: str):
        """``family.labels(*labels)``, made once."""
        key = (family, *labels)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = family.labels(*labels)
        return series

    def queue_wait(self, timings: dict[str, float | bool]) -> None:
        """An item's queue wait and, where intake predicted it and either is past the noise
        floor, the prediction's ratio to it."""
        actual = timings.get("queue_s")
        if actual is None:
            return
        self.queue_seconds.observe(actual)
        predicted = timings.get("predicted_queue_s")
        if predicted is not None and max(actual, predicted) >= PREDICTION_FLOOR_S:
            self.queue_wait_prediction_ratio.observe(predicted / max(actual, 1e-3))

    def count(self, modality: Modality, status: IntakeStatus | RoomState) -> None:
        """One item's intake answer (``epd_encoder_intake_total{result}``) or room end
        (``epd_encoder_items_total{outcome}``), as the enum's value in lower case."""
        family = self.intake if isinstance(status, IntakeStatus) else self.outcomes
        self.series(family, modality.name, status.value.lower()).inc()


class _CacheCounters:
    """The embedding cache's and the coalescer's own running counts, as Prometheus counters."""

    def __init__(self, cache: EmbeddingCache, encodes: InFlightEncodes):
        self.cache = cache
        self.encodes = encodes

    def collect(self):
        cache = self.cache
        for name, value, what in (
            ("cache_hits", cache.hits, "Items answered from the embedding cache"),
            ("cache_misses", cache.misses, "Items the cache did not hold"),
            ("cache_evictions", cache.evictions, "Entries evicted from the embedding cache"),
            (
                "coalesced_items",
                self.encodes.coalesced,
                "Items that waited for an identical item's encode in flight (cache hits apart)",
            ),
        ):
            yield CounterMetricFamily(f"epd_encoder_{name}", what, value=value)
