"""epd-prefill (prefill_server) on a real uvicorn server on loopback, over a real encode
worker: hostile and careless requests get a clear answer, and every slot they reserved comes
back."""

import base64
import glob
import json
import os
import threading
import urllib.error
import urllib.request

import pytest

from epdserve.data_plane.loopback import LoopbackFault
from epdserve.prefill_server.app import create_app
from epdserve.testing.receive_items import loopback_handshake
from epdserve.vision.images import image_from_bytes
from epdserve.vision.small_checkpoints import build_full
from epdserve.vision.tower import VisionTower
from epdserve.wire.intake import IntakeClient
from handshake.server import ThreadedServer, open_listener_warning
from tests.encode_helpers import loopback_stack, png
from tests.handshake_helpers import get_json
from tests.waiting import eventually

SLOT = 1 << 16


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    return VisionTower.load(build_full("qwen2_5_vl", str(tmp_path_factory.mktemp("q25"))))


@pytest.fixture
def served(tower):
    """An encode worker, and epd-prefill's app (with the local tower) around a receiver with a
    four-slot pool, on loopback."""
    with loopback_stack(
        tower,
        local_tower=tower,
        worker=dict(cache_bytes=0, write_timeout_s=5),
        receiver=dict(pool_bytes=4 * SLOT, slot_bytes=SLOT, quarantine_s=1.0),
    ) as stack:
        worker, receiver, loopback = stack
        server = ThreadedServer(create_app(receiver, tower)).start()
        intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
        try:
            yield worker, receiver, loopback, server.url, intake
        finally:
            intake.close()
            server.stop()
    left = glob.glob(f"/dev/shm/epd-*-{os.getpid()}-*")
    assert not left, f"leaked SHM segments: {left}"


def post(url, body):
    request = urllib.request.Request(
        url + "/v1/prefill",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def rows_of(tower, image):
    (rows,) = tower.rows_per_item(
        tower.processor(images=[image_from_bytes(image)], return_tensors="pt")["image_grid_thw"]
    )
    return rows


def room_item(worker, room, rows, **handshake):
    return {
        "offsets": [[0, rows - 1]],
        "encode_handshake": {**loopback_handshake(room, worker.bootstrap_port), **handshake},
    }


def send(intake, worker, room, image):
    reply = intake.send(
        {
            "request_id": f"r{room}",
            "source": "bytes",
            "encode_handshake": loopback_handshake(room, worker.bootstrap_port),
        },
        image,
    )
    assert reply.ok, reply


def no_slot_held(receiver):
    stats = receiver.pool.stats()
    return stats["leased_slots"] == 0 and stats["quarantined_slots"] == 0


def test_room_zero_is_refused_by_the_schema(served, tower):
    """``bootstrap_room: 0`` passed the schema, failed the registration with a 500 and kept its
    slot: twelve such requests exhausted the pool for good while /healthz said 200."""
    worker, receiver, _, url, intake = served
    for attempt in range(12):
        status, body = post(
            url, {"request_id": f"zero-{attempt}", "items": [room_item(worker, 0, 4)]}
        )
        assert status == 422 and "greater than or equal to 1" in body["detail"][0]["msg"]
        assert body["detail"][0]["loc"][:5] == [
            "body",
            "items",
            0,
            "encode_handshake",
            "bootstrap_room",
        ]
    assert no_slot_held(receiver) and get_json(url + "/readyz")[0] == 200
    image = png(64, 64, 60)
    (room,) = worker.table.mint(1, 60)
    send(intake, worker, room, image)
    status, body = post(
        url, {"request_id": "after", "items": [room_item(worker, room, rows_of(tower, image))]}
    )
    assert status == 200 and body["state"] == "DONE", body


def test_a_host_that_makes_no_url_fails_its_item_not_the_request(served, tower):
    """A bootstrap_host the wire pattern allows but no URL can hold ("[") crashed the job: a 500,
    and the slots of the request's items stayed leased."""
    worker, receiver, _, url, intake = served
    image = png(64, 64, 61)
    for attempt in range(6):
        (room,) = worker.table.mint(1, 60)
        send(intake, worker, room, image)
        rows = rows_of(tower, image)
        status, body = post(
            url,
            {
                "request_id": f"host-{attempt}",
                "items": [
                    room_item(worker, room + 1, 4, bootstrap_host="["),
                    room_item(worker, room, rows),
                ],
            },
        )
        assert status == 200, body
        bad, good = body["items"]
        assert bad["state"] == "FAILED" and "invalid encode_handshake" in bad["reason"]
        assert good["state"] == "DONE" and good["rows"] == rows
    assert no_slot_held(receiver)


def test_a_timeout_answers_at_once_with_each_items_outcome_and_frees_the_slots(served, tower):
    """A request that reached its timeout_s ended in a 500 (CancelledError), and while a write was
    in flight the answer waited for the writer. Now: 200 at once, the unsettled item FAILED
    "timed out", the settled one DONE; the slot comes back when the writer reports."""
    worker, receiver, loopback, url, intake = served
    slow_image, local_image = png(64, 64, 62), png(64, 64, 63)
    (slow_room,) = worker.table.mint(1, 60)
    send(intake, worker, slow_room, slow_image)
    eventually(
        lambda: worker.ring.stats()["leased_slots"] > 0, "the rows staged, waiting for the receiver"
    )
    loopback.inject(
        LoopbackFault("delay", 4.0)
    )  # the write is in flight for 4 s (its deadline: 5 s)
    status, body = post(
        url,
        {
            "request_id": "slow",
            "timeout_s": 1.5,
            "items": [
                room_item(worker, slow_room, rows_of(tower, slow_image)),
                {
                    "offsets": [[0, rows_of(tower, local_image) - 1]],
                    "image_b64": base64.b64encode(local_image).decode(),
                },
            ],
        },
    )
    assert status == 200 and body["state"] == "FAILED", body
    slow, local = body["items"]
    assert (
        slow["state"] == "FAILED"
        and slow["reason"].startswith("timed out")
        and slow["rows"] is None
    )
    assert local["state"] == "DONE" and local["transport"] == "local"
    assert (
        worker.table.view(slow_room).state.value == "WRITING"
    )  # answered before the writer reported
    eventually(
        lambda: worker.table.view(slow_room).state.value == "CANCELLED", "the writer reported"
    )
    eventually(lambda: no_slot_held(receiver), "the slow item's slot back")


def test_a_colocated_item_must_fill_its_placeholders(served, tower):
    """An item with image bytes and no room (the local tower's) was DONE with 256 rows for a 4-row
    placeholder span: the row contract was skipped on that path."""
    _, _, _, url, _ = served
    image = png(448, 448, 64)
    assert rows_of(tower, image) == 256
    encoded = base64.b64encode(image).decode()
    status, body = post(
        url,
        {
            "request_id": "colocated",
            "items": [
                {"offsets": [[5, 8]], "image_b64": encoded},
                {"offsets": [[0, 255]], "image_b64": encoded, "grid_thw": [1, 16, 64]},
                {"offsets": [[0, 127], [300, 427]], "image_b64": encoded, "grid_thw": [1, 32, 32]},
            ],
        },
    )
    assert status == 200, body
    short, other_grid, right = body["items"]
    assert short["state"] == "FAILED" and short["rows"] is None
    assert (
        "the image makes 256 rows (grid [1, 32, 32]) but the item's placeholders hold 4"
        in short["reason"]
    )
    assert (
        other_grid["state"] == "FAILED"
        and "differs from the item's image_grid_thw" in other_grid["reason"]
    )
    assert right["state"] == "DONE" and right["rows"] == 256 and right["transport"] == "local"


def test_readiness_follows_the_receive_pool(served, tower):
    """/readyz did not exist (and /healthz said 200 whatever the pool held): now it is 503 with the
    reason while no slot is free, and 200 again once slots come back."""
    worker, receiver, _, url, _ = served
    status, body = get_json(url + "/readyz")
    assert (
        status == 200
        and body["ready"]
        and body["pool"]["free_slots"] == 4
        and body["transports"] == ["loopback"]
    )
    rooms = worker.table.mint(4, 60)  # registered, never written: each holds its slot
    result = {}
    request = threading.Thread(
        target=lambda: result.update(
            answer=post(
                url,
                {
                    "request_id": "hold",
                    "timeout_s": 60,
                    "items": [room_item(worker, room, 4) for room in rooms],
                },
            )
        )
    )
    request.start()
    eventually(lambda: receiver.pool.stats()["free_slots"] == 0, "the pool full")
    status, body = get_json(url + "/readyz")
    assert (
        status == 503
        and body["reason"] == "receive pool exhausted: 0 of 4 slots free (4 leased, 0 quarantined)"
    )
    assert get_json(url + "/healthz")[0] == 200  # alive: slots come back
    assert get_json(url + "/health") == get_json(url + "/healthz")  # the name vLLM and SGLang use
    for room in rooms:
        worker.table.cancel(room, "gateway gave up")
    request.join(30)
    assert not request.is_alive() and result["answer"][0] == 200
    eventually(lambda: get_json(url + "/readyz")[0] == 200, "ready again")


def test_the_reference_prefill_warns_when_open_to_anyone(served):
    """Without the handshake token (its /v1/prefill's bearer), listening beyond loopback is open
    to anyone (only with --insecure-listen: the settings refuse it otherwise)."""
    _, receiver, _, _, _ = served
    warning = open_listener_warning(create_app(receiver), "0.0.0.0")
    assert warning.startswith("INSECURE: EPD reference prefill listens on 0.0.0.0")
    assert open_listener_warning(create_app(receiver), "127.0.0.1") is None
