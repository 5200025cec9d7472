"""`epd-encode-worker` as its own process: real Mooncake TCP and SHM writes into this process,
readiness and metrics over HTTP, and a clean SIGTERM."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from unittest import mock

import pytest
import torch

from epdserve.data_plane.mooncake import MooncakeTransport
from epdserve.data_plane.shm_transport import ShmTransport
from epdserve.testing.cluster import free_port
from epdserve.testing.receive_items import loopback_handshake
from epdserve.vision.images import image_from_bytes
from epdserve.vision.small_checkpoints import build_full
from epdserve.vision.tower import VisionTower
from epdserve.wire.intake import IntakeClient
from epdserve.wire.room_client import SyncHandshakeClient
from epdserve.wire.rooms import RoomState
from tests.encode_helpers import RestReceiver, png
from tests.segments import left_since, segments
from tests.waiting import eventually

pytestmark = pytest.mark.processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_ready(url: str, seconds: float = 60, path: str = "/readyz") -> None:
    """Until ``url + path`` answers 200; ``TimeoutError`` if it does not within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url + path, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url}{path} did not answer 200 within {seconds} s")


def wait_room(client, room: int, state: RoomState, seconds: float = 30):
    """Long-poll ``room`` until it is in ``state``; fail if it ends in another, or is not there
    within ``seconds``."""
    end = time.monotonic() + seconds
    version = 0
    while time.monotonic() < end:
        (result,) = client.watch({room: version}, 1.0)
        assert result.ok, result.error
        if result.view.state is state:
            return result.view
        assert not result.view.state.terminal, result.view
        version = result.view.version
    raise TimeoutError(f"room {room} not {state.value} within {seconds} s")


def ring_occupancy(url: str) -> float:
    """The worker's ``epd_encoder_ring_occupancy`` gauge, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        for family in text_string_to_metric_families(response.read().decode()):
            if family.name == "epd_encoder_ring_occupancy":
                (sample,) = family.samples
                return sample.value
    raise AssertionError("no epd_encoder_ring_occupancy in /metrics")


def spawn_worker(directory):
    bootstrap, intake = free_port(), free_port()
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        OMP_WAIT_POLICY="PASSIVE",
        EPD_MODEL=directory,
        EPD_BOOTSTRAP_PORT=str(bootstrap),
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "encode_worker.cli",
            "--dtype",
            "float32",
            "--bind",
            "127.0.0.1",
            "--intake-port",
            str(intake),
            "--transports",
            "shm,mooncake",
            "--ring-bytes",
            str(32 << 20),
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{bootstrap}"
    try:
        wait_ready(url)
    except BaseException:  # never leave a worker that did not come up running
        process.kill()
        process.wait(30)
        raise
    return process, url, intake


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_full("qwen2_5_vl", str(tmp_path_factory.mktemp("q25")))


@pytest.fixture(scope="module")
def worker_process(checkpoint):
    before = segments()
    process, url, intake = spawn_worker(checkpoint)
    try:
        yield process, url, intake, VisionTower.load(checkpoint)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    assert process.returncode == 0
    assert left_since(before) == set()


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_delivery_across_processes(worker_process, transport):
    process, url, intake_port, tower = worker_process
    made = {"shm": ShmTransport, "mooncake": MooncakeTransport.for_process}[transport]()
    client = SyncHandshakeClient(url)
    receiver = RestReceiver(client, {transport: made})
    intake = IntakeClient(f"tcp://127.0.0.1:{intake_port}")
    try:
        images = [png(64, 64, 11), png(300, 200, 12)]
        rooms = client.mint(len(images))
        for index, (room, image) in enumerate(zip(rooms, images)):
            expected = tower.encode_items(**_inputs(tower, image))[0]
            if index == 0:  # receiver first
                receiver.reserve(room, expected.shape[0], expected.shape[1], expected.dtype)
            else:
                # the ring is empty again (the first item's slot freed): a staged item shows in it
                eventually(
                    lambda: ring_occupancy(url) == 0,
                    "the send ring empty after the first item",
                    seconds=30,
                )
            reply = intake.send(
                {
                    "request_id": f"{transport}{index}",
                    "source": "bytes",
                    "encode_handshake": loopback_handshake(room, int(url.rsplit(":", 1)[1])),
                },
                image,
            )
            assert reply.ok, reply
            if index == 1:  # encoder first: the rows wait in the ring for the receiver
                eventually(
                    lambda: ring_occupancy(url) > 0, "the rows staged in the send ring", seconds=30
                )
                receiver.reserve(room, expected.shape[0], expected.shape[1], expected.dtype)
            state, got, view = receiver.wait(room)
            assert state is RoomState.SUCCESS, view.reason
            assert view.transport == transport
            assert torch.equal(got, expected)
    finally:
        intake.close()
        client.close()
        receiver.close()


def _inputs(tower, image):
    inputs = tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
    return {"pixel_values": inputs["pixel_values"], "grid_thw": inputs["image_grid_thw"]}


def test_probes_and_metrics(worker_process, checkpoint):
    """Dashboards written for vLLM's metrics work as they are: every family has ``model_name``,
    counters are counters (``_total``), latency buckets start at 100 us, and probes and scrapes are
    not counted as room traffic."""
    from prometheus_client.parser import text_string_to_metric_families

    process, url, _, _ = worker_process
    for probe in ("/health", "/healthz", "/readyz", "/metrics"):
        with urllib.request.urlopen(url + probe, timeout=5) as response:
            assert response.status == 200
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
    for name in ("epd_encoder_queue_depth", "epd_encoder_ring_occupancy", "epd_handshake_rooms"):
        assert families[name].type == "gauge", name
    for name in (
        "epd_encoder_intake",
        "epd_encoder_items",
        "epd_encoder_cache_hits",
        "epd_encoder_cache_misses",
        "epd_encoder_cache_evictions",
        "epd_encoder_coalesced_items",
        "epd_encoder_encode_cpu_seconds",
        "epd_encoder_preprocess_cpu_seconds",
        "epd_handshake_transitions",
    ):
        assert families[name].type == "counter", name
    for name in ("epd_encoder_transfer_seconds", "epd_handshake_request_seconds"):
        assert families[name].type == "histogram", name
    model_names = {
        sample.labels.get("model_name")
        for family in families.values()
        if family.name.startswith("epd_")
        for sample in family.samples
    }
    assert model_names == {os.path.basename(os.path.normpath(checkpoint))}
    queue = families["epd_encoder_queue_seconds"].samples
    assert min(float(s.labels["le"]) for s in queue if "le" in s.labels) == 0.0001
    routes = {s.labels.get("route") for s in families["epd_handshake_request_seconds"].samples}
    assert not routes & {"/health", "/healthz", "/readyz", "/metrics"}


def test_every_flag_has_an_env_var_and_the_flag_wins():
    from encode_worker.config import WorkerConfig

    with mock.patch.dict(
        os.environ, {"EPD_BATCH_ITEMS": "3", "EPD_CHECKSUM": "0", "EPD_BIND": "127.0.0.1"}
    ):
        assert WorkerConfig.from_command_line(["--model", "m"]).batch_items == 3
        assert not WorkerConfig.from_command_line(["--model", "m"]).checksum
        flags = WorkerConfig.from_command_line(["--model", "m", "--batch-items", "5", "--checksum"])
        assert flags.batch_items == 5 and flags.checksum
    names = {WorkerConfig.env_name(field) for field in WorkerConfig.model_fields}
    assert len(names) == len(WorkerConfig.model_fields) and "EPD_RING_SLOT_BYTES" in names


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_prefill_receiver_across_processes(worker_process, transport):
    from epdserve.multimodal.items import Modality, MultimodalDataItem, MultimodalInputs
    from prefill_side import JobState, PrefillReceiver, ReceiverConfig

    process, url, intake_port, tower = worker_process
    port = int(url.rsplit(":", 1)[1])
    receiver = PrefillReceiver(
        ReceiverConfig(
            width=tower.info.wire_width,
            dtype="float32",
            pool_bytes=16 << 20,
            slot_bytes=1 << 16,
            transports=(transport,),
        )
    )
    client = SyncHandshakeClient(url)
    intake = IntakeClient(f"tcp://127.0.0.1:{intake_port}")
    try:
        images = [png(64, 64, 31), png(300, 200, 32), png(200, 120, 33)]
        rooms = client.mint(len(images))
        expected = [tower.encode_items(**_inputs(tower, image))[0] for image in images]
        items = [
            MultimodalDataItem(
                Modality.IMAGE,
                offsets=[[0, rows.shape[0] - 1]],
                encode_handshake=loopback_handshake(room, port),
            )
            for room, rows in zip(rooms, expected)
        ]
        job = receiver.start("req", MultimodalInputs(items))
        for index, (room, image) in enumerate(zip(rooms, images)):
            assert intake.send(
                {
                    "request_id": f"p{index}",
                    "source": "bytes",
                    "encode_handshake": loopback_handshake(room, port),
                },
                image,
            ).ok
        assert job.wait(30) is JobState.DONE, job.reasons
        assert all(o.transport == transport for o in job.outcomes)
        for item, rows in zip(items, expected):
            assert torch.equal(item.encoded, rows)
    finally:
        intake.close()
        client.close()
        receiver.close()


def test_encode_worker_killed_fails_the_job_fast_and_falls_back(checkpoint):
    from epdserve.multimodal.items import Modality, MultimodalDataItem, MultimodalInputs
    from prefill_side import JobState, PrefillReceiver, ReceiverConfig

    tower = VisionTower.load(checkpoint)
    process, url, _ = spawn_worker(checkpoint)
    port = int(url.rsplit(":", 1)[1])
    receiver = PrefillReceiver(
        ReceiverConfig(
            width=tower.info.wire_width,
            dtype="float32",
            pool_bytes=16 << 20,
            slot_bytes=1 << 16,
            transports=("shm",),
            fallback="local_tower",
        ),
        local_tower=tower,
    )
    client = SyncHandshakeClient(url)
    try:
        image = png(96, 64, 41)
        rows = tower.encode_items(**_inputs(tower, image))[0]
        (room,) = client.mint(1)
        item = MultimodalDataItem(
            Modality.IMAGE,
            offsets=[[0, rows.shape[0] - 1]],
            feature=image,
            encode_handshake=loopback_handshake(room, port),
        )
        job = receiver.start("req", MultimodalInputs([item]))
        wait_room(
            client, room, RoomState.REGISTERED
        )  # the pixels never arrive, and then the worker dies
        process.kill()
        assert job.wait(10) is JobState.DONE  # not at its item timeout: the worker is unreachable
        outcome = job.outcomes[0]
        assert outcome.fallback and "unreachable" in outcome.reason
        assert torch.equal(item.encoded, rows)
    finally:
        client.close()
        receiver.close()
        process.kill()
        process.wait(10)


def test_reference_prefill_process_receives_and_verifies(worker_process, checkpoint):
    """Three processes: this one dispatches, the encode worker encodes, epd-prefill receives."""
    import base64
    import json

    process, url, intake_port, tower = worker_process
    port = int(url.rsplit(":", 1)[1])
    prefill_port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_WAIT_POLICY="PASSIVE")
    prefill = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epdserve.prefill_server.cli",
            "--host",
            "127.0.0.1",
            "--port",
            str(prefill_port),
            "--model",
            checkpoint,
            "--dtype",
            "float32",
            "--transports",
            "shm,mooncake",
            "--pool-bytes",
            str(16 << 20),
            "--slot-bytes",
            str(1 << 16),
        ],
        env=env,
    )
    client = SyncHandshakeClient(url)
    intake = IntakeClient(f"tcp://127.0.0.1:{intake_port}")
    try:
        wait_ready(f"http://127.0.0.1:{prefill_port}", path="/healthz")
        images = [png(64, 64, 51), png(200, 300, 52)]
        rooms = client.mint(len(images))
        items = []
        for room, image in zip(rooms, images):
            rows = tower.encode_items(**_inputs(tower, image))[0].shape[0]
            items.append(
                {
                    "offsets": [[5, 5 + rows - 1]],
                    "image_b64": base64.b64encode(image).decode(),
                    "encode_handshake": loopback_handshake(room, port),
                }
            )
        for index, (room, image) in enumerate(zip(rooms, images)):
            assert intake.send(
                {
                    "request_id": f"x{index}",
                    "source": "bytes",
                    "encode_handshake": loopback_handshake(room, port),
                },
                image,
            ).ok
        request = urllib.request.Request(
            f"http://127.0.0.1:{prefill_port}/v1/prefill",
            data=json.dumps({"request_id": "r", "items": items, "verify": True}).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            report = json.loads(response.read())
        assert report["state"] == "DONE", report
        for item in report["items"]:
            assert (
                item["state"] == "DONE" and item["transport"] == "shm" and item["verified"] is True
            )
            assert item["width"] == tower.info.wire_width
    finally:
        intake.close()
        client.close()
        prefill.send_signal(signal.SIGTERM)
        prefill.wait(30)
