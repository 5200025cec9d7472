"""The Grafana dashboard (k8s/components/grafana-dashboard/epd-dashboard.json): a well-formed
dashboard whose every query names metrics, and groups by labels, that the real processes serve:
an encode worker and a receiver that delivered an item, and the gateway's metrics."""

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.metrics import exposition_registry
from epdserve.multimodal.items import MultimodalInputs
from epdserve.testing.images import synthetic_image
from epdserve.vision.tower import VisionTower
from prefill_side import JobState
from tests.encode_helpers import dispatch_to, loopback_stack

DASHBOARD = (
    Path(__file__).resolve().parent.parent
    / "k8s"
    / "components"
    / "grafana-dashboard"
    / "epd-dashboard.json"
)
SCRAPE_LABELS = {"instance", "job", "pod", "namespace", "le"}  # Prometheus and the histograms add
# what the issue asks a dashboard to show, by the series that show it
REQUIRED = {
    "epd_encoder_queue_depth",
    "epd_encoder_batch_items_sum",
    "epd_encoder_encode_seconds_bucket",
    "epd_encoder_transfer_seconds_bucket",
    "epd_encoder_intake_total",
    "epd_encoder_items_total",
    "epd_encoder_cache_hits_total",
    "epd_encoder_coalesced_items_total",
    "epd_encoder_ring_occupancy",
    "epd_prefill_items_total",
    "epd_prefill_pool_leased_slots",
    "epd_prefill_pool_quarantined_slots",
    "epd_gateway_requests_total",
    "epd_gateway_colocated_fallbacks_total",
    "epd_gateway_time_to_first_token_seconds_bucket",
    # where each image is encoded (docs/vllm.md), and whether --placement cost predicts right
    "epd_gateway_placements_total",
    "epd_gateway_inline_patches",
    "epd_gateway_inline_patches_peak",
    "epd_gateway_placement_prediction_error_ratio_bucket",
    "epd_gateway_placement_cost_seconds",
    "epd_gateway_engine_load_requests",
    "epd_gateway_engine_load_source",
}


def _touch_labels(registry_owner) -> None:
    """One child per labelled metric, so that its labels show in the exposition."""
    for metric in vars(registry_owner).values():
        names = getattr(metric, "_labelnames", ())
        if names:
            metric.labels(*["x"] * len(names))


def _series(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from an exposition."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


@pytest.fixture(scope="module")
def served(checkpoints) -> dict[str, set[str]]:

    from epdserve.gateway.app import GatewayMetrics

    tower = VisionTower.load(checkpoints["qwen2_5_vl"])
    with loopback_stack(tower) as (worker, receiver, _):
        items = dispatch_to(worker, tower.processor, [synthetic_image(64, 64, 1)], "dash")
        job = receiver.start("dash", MultimodalInputs([items[0].to_mm_item(0)]))
        assert job.wait(20) is JobState.DONE, job.reasons
        _touch_labels(worker.metrics)
        _touch_labels(receiver.metrics)
        with urllib.request.urlopen(
            f"http://127.0.0.1:{worker.bootstrap_port}/metrics", timeout=5
        ) as response:
            series = _series(response.read().decode())
        series.update(
            _series(generate_latest(exposition_registry(receiver.registry, "m")).decode())
        )
    gateway = GatewayMetrics("m")
    _touch_labels(gateway)
    series.update(_series(generate_latest(gateway.registry).decode()))
    return series


def test_the_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus" and "model_name" in variables
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert graphs and all(panel["targets"] for panel in graphs)
    for panel in graphs:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        box = panel["gridPos"]
        assert 0 <= box["x"] and box["x"] + box["w"] <= 24 and box["h"] > 0, panel["title"]


def test_every_query_names_metrics_and_labels_the_processes_serve(served):
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            names = set(re.findall(r"\b(epd_[a-z0-9_]+)\b", expr))
            assert names, expr
            for name in names:
                assert name in served, f"{panel['title']}: no process serves {name}"
                assert "model_name" in served[name], f"{name} has no model_name label"
            labels = set().union(*(served[name] for name in names)) | SCRAPE_LABELS
            grouped = [
                part.strip()
                for group in re.findall(r"by \(([^)]*)\)", expr)
                for part in group.split(",")
            ]
            selected = re.findall(r"(\w+)=~?\"", expr)  # label matchers in {...}
            for label in grouped + selected:
                assert label in labels, f"{panel['title']}: {names} have no label {label}"
            queried |= names
    assert REQUIRED <= queried, REQUIRED - queried
