"""Every role as a real process on loopback: encode workers (`epd-encode-worker`), reference
prefill processes (`epd-prefill`), and the dispatcher here, over Mooncake TCP and SHM."""

import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest

from epdserve.dispatcher import Dispatcher, WorkerSet
from epdserve.dispatcher.cli import prefill_body
from epdserve.testing.cluster import _HANDED_OUT, ROOT, LocalCluster, free_port
from epdserve.testing.images import synthetic_image
from epdserve.vision.small_checkpoints import build_vision_only
from epdserve.wire.room_client import HandshakeClient
from epdserve.wire.rooms import RoomState
from tests.segments import left_since, segments

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = build_vision_only("qwen2_5_vl", str(tmp_path_factory.mktemp("tower")), out_width=512)
    before = segments()
    with LocalCluster(model) as running:
        roles = {
            "a": running.start_encode_worker("worker-a"),
            # b leaves (SIGKILL) in test_a_worker_leaving_mid_run_...; the tests after it use a
            "b": running.start_encode_worker("worker-b"),
            "mooncake": running.start_prefill("prefill-mooncake", transports="mooncake"),
            "shm": running.start_prefill(
                "prefill-shm",
                transports="shm",
                pool_bytes=8 << 20,
                extra=(
                    "--slot-bytes",
                    str(256 << 10),
                    "--fallback",
                    "local_tower",
                    "--item-timeout-s",
                    "10",
                ),
            ),
        }
        running.wait_ready()
        yield running, roles
        codes = running.stop()
    assert {name: code for name, code in codes.items() if name != "worker-b"} == dict.fromkeys(
        ("worker-a", "prefill-mooncake", "prefill-shm"), 0
    )  # clean SIGTERM exits
    time.sleep(0.2)
    assert left_since(before) == set()


def _processor(cluster):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(cluster.model_dir)


async def _request(
    cluster, workers: list, prefill, images, request_id, verify=True, without_room=()
):
    """Dispatch, then post to the prefill process; items in ``without_room`` go without a room."""
    worker_set = WorkerSet([role.worker for role in workers], check_timeout_s=1)
    await worker_set.refresh()
    dispatcher = Dispatcher(worker_set, _processor(cluster), intake_timeout_s=2)
    try:
        items = await dispatcher.dispatch(request_id, images)
    finally:
        await dispatcher.close()
        await worker_set.close()
    body = prefill_body(request_id, items, verify)
    for index in without_room:
        body["items"][index]["encode_handshake"] = None
        body["items"][index]["image_b64"] = prefill_body(request_id, [items[index]], True)["items"][
            0
        ]["image_b64"]
    async with aiohttp.ClientSession() as session:
        async with session.post(prefill.url + "/v1/prefill", json=body) as response:
            assert response.status == 200, await response.text()
            return items, await response.json()


def _metric(role, name: str) -> float:
    with urllib.request.urlopen(role.url + "/metrics", timeout=5) as response:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in response.read().decode().splitlines()
            if line.startswith(name)
        )


@pytest.mark.parametrize("transport", ["mooncake", "shm"])
def test_mixed_items_arrive_bit_exact(cluster, transport):
    running, roles = cluster
    seed = {"mooncake": 10, "shm": 20}[
        transport
    ]  # images of their own: no cache hits from the other case
    images = [
        synthetic_image(448, 448, seed),
        synthetic_image(640, 480, seed + 1, "JPEG"),
        synthetic_image(256, 320, seed + 2),
    ]
    items, report = asyncio.run(
        _request(
            running,
            [roles["a"], roles["b"]],
            roles[transport],
            images,
            f"mixed-{transport}",
            without_room=(1,),
        )
    )
    assert report["state"] == "DONE", report
    by_index = report["items"]
    for index in (0, 2):
        assert by_index[index]["transport"] == transport and by_index[index]["verified"] is True
        assert by_index[index]["rows"] == items[index].rows and by_index[index]["width"] == 512
        assert by_index[index]["encoder"]["encode_s"] > 0
    assert (
        by_index[1]["transport"] == "local" and by_index[1]["rows"] == items[1].rows
    )  # colocated item


def test_a_repeated_image_meets_its_worker_and_cache(cluster):
    running, roles = cluster
    image = synthetic_image(448, 448, 31)
    first, report1 = asyncio.run(
        _request(running, [roles["a"], roles["b"]], roles["shm"], [image], "repeat-1")
    )
    second, report2 = asyncio.run(
        _request(running, [roles["a"], roles["b"]], roles["shm"], [image], "repeat-2")
    )
    assert first[0].worker == second[0].worker  # routing affinity by content hash
    assert report1["items"][0]["encoder"]["cache_hit"] is False
    assert (
        report2["items"][0]["encoder"]["cache_hit"] is True
        and report2["items"][0]["verified"] is True
    )


def test_a_worker_leaving_mid_run_fails_its_items_fast_and_the_rest_move_on(cluster):
    running, roles = cluster
    images = [synthetic_image(320, 320, 40 + i) for i in range(12)]
    leaver = roles["b"]

    async def scenario():
        worker_set = WorkerSet([roles["a"].worker, leaver.worker], check_timeout_s=1)
        await worker_set.refresh()
        dispatcher = Dispatcher(worker_set, _processor(running), intake_timeout_s=2)
        try:
            placed = await dispatcher.dispatch("leave-1", images)
            on_leaver = [item for item in placed if item.worker == leaver.worker.name]
            assert on_leaver, "the ring sent nothing to worker b; pick other images"
            running.kill(leaver)  # SIGKILL: its rooms and queued items die with it
            async with aiohttp.ClientSession() as session:
                started = time.monotonic()
                async with session.post(
                    roles["shm"].url + "/v1/prefill", json=prefill_body("leave-1", placed, True)
                ) as response:
                    report = await response.json()
                elapsed = time.monotonic() - started
            after = await dispatcher.dispatch("leave-2", images)  # b fails, its items move to a
            return placed, report, elapsed, after, worker_set.status()
        finally:
            await dispatcher.close()
            await worker_set.close()

    placed, report, elapsed, after, status = asyncio.run(scenario())
    for item, row in zip(placed, report["items"]):
        assert row["state"] == "DONE"
        if item.worker == leaver.worker.name:  # its room endpoint died: fast failure, fallback
            assert row["fallback"] is True and "unreachable" in row["reason"]
        else:
            assert row["fallback"] is False and row["verified"] is True
    assert all(item.worker == roles["a"].worker.name and item.error is None for item in after)
    assert status[leaver.worker.name] != "ready"


def test_a_request_larger_than_the_receive_pool_is_refused_and_frees_its_rooms(cluster):
    running, roles = cluster
    big = [
        synthetic_image(1024, 768, 60 + i, "JPEG") for i in range(6)
    ]  # 6 x 999 rows x 2 KB > 8 MiB pool
    items, report = asyncio.run(
        _request(running, [roles["a"]], roles["shm"], big, "too-big", verify=False)
    )
    refused = [row for row in report["items"] if row["state"] != "DONE" or row["fallback"]]
    assert refused and all("cannot reserve" in row["reason"] for row in refused), [
        r["reason"] for r in refused
    ]

    async def room_states():
        client = HandshakeClient(roles["a"].url)
        try:
            return [
                (await client.get(item.encode_handshake.bootstrap_room)).state for item in items
            ]
        finally:
            await client.close()

    states = asyncio.run(room_states())
    assert states.count(RoomState.CANCELLED) == len(
        refused
    )  # the worker was told: it holds nothing
    assert states.count(RoomState.SUCCESS) == len(items) - len(refused)
    _, after = asyncio.run(
        _request(running, [roles["a"]], roles["shm"], [synthetic_image(448, 448, 70)], "after")
    )
    assert after["state"] == "DONE"  # nothing stuck
    assert _metric(roles["shm"], "epd_prefill_pool_leased_slots") == 0


def test_epd_dispatch_sends_files_and_reports_what_the_prefill_process_received(cluster, tmp_path):
    running, roles = cluster
    paths = []
    for index, (width, height) in enumerate([(448, 448), (300, 200)]):
        path = tmp_path / f"image{index}.png"
        path.write_bytes(synthetic_image(width, height, 80 + index))
        paths.append(str(path))
    worker = roles["a"].worker
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "epdserve.dispatcher.cli",
            "--model",
            running.model_dir,
            "--request-id",
            "cli-1",
            "--workers",
            f"{worker.host}:{worker.bootstrap_port}:{worker.intake_port}",
            "--prefill",
            roles["mooncake"].url,
            "--verify",
            *paths,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert [item["worker"] for item in output["items"]] == [worker.name] * 2
    assert all(item["dispatch_ms"] > 0 for item in output["items"])
    assert output["prefill"]["state"] == "DONE"
    assert [row["verified"] for row in output["prefill"]["items"]] == [True, True]
    assert [row["rows"] for row in output["prefill"]["items"]] == [
        item["rows"] for item in output["items"]
    ]


def test_a_port_handed_out_is_not_handed_out_again_before_its_role_binds_it(monkeypatch):
    """free_port checks a port is free now; a role binds it only once started, so a second call
    meanwhile (a stack's next port, drawn at random) must not return the same one: a Stack's
    connector port once equalled its encode worker's, and vLLM could not serve on it."""
    first, second = free_port(), free_port()
    drawn = iter([[first, second]] * 2)  # both calls draw the same ports, first first
    monkeypatch.setattr(random.SystemRandom, "sample", lambda self, population, k: next(drawn))
    _HANDED_OUT.clear()
    assert free_port() == first
    assert free_port() == second
