"""Load held, small: more items at once than an encode worker's queue holds, through the real
dispatcher into real worker and prefill processes (``bench.overload``, the benchmark's own code);
every item ends DONE or FAILED with a reason, none is lost or hangs, and the worker's refusals were
explicit. Behaviour only: no timing is asserted."""

import pytest

from epdserve.bench.benchmarks.overload import phase
from epdserve.bench.benchmarks.towers import bench_tower
from epdserve.testing.images import synthetic_image

pytestmark = pytest.mark.processes


def test_a_burst_larger_than_the_queue_loses_no_item():
    requests, per_request = 12, 5
    images = [synthetic_image(112, 112, seed) for seed in range(requests * per_request)]
    result = phase(
        bench_tower(depth=2, hidden=64, width=1024),
        workers=1,
        images=images,
        requests=requests,
        images_per_request=per_request,
        deadline_s=60,
        probe_interval_s=0.05,
        worker_extra=("--queue-items", "4", "--batch-items", "2"),
    )
    assert result["lost"] == 0 and result["reports_past_deadline"] == 0
    assert sum(result["outcomes"].values()) == requests * per_request
    assert set(result["outcomes"]) <= {"DONE", "FAILED"}
    assert result["intake_refusals"] > 0  # the queue was full: refused, retried or failed
    assert result["outcomes"].get("DONE", 0) > 0
    assert result["handshake_probe_ms"]["count"] > 0
