"""Security properties (issue 8): authenticated intake and room API, no pickle (or any other code-
carrying format) on a wire, bounded sizes. The threat model and the list of bounds are in
docs/reliability.md; SHM name validation and O_NOFOLLOW are tested in test_shm.py and
test_fuzz_wire.py, the handshake's bearer token in test_handshake_api.py."""

import ast
import pathlib

import pytest

from encode_worker.config import WorkerConfig
from encode_worker.worker import EncodeWorker
from epdserve.data_plane.loopback import LoopbackTransport
from epdserve.testing.receive_items import loopback_encode_handshake, loopback_handshake
from epdserve.vision.images import image_from_bytes
from epdserve.vision.small_checkpoints import build_vision_only
from epdserve.wire.intake import IntakeClient, IntakeReply, IntakeStatus
from epdserve.wire.room_client import HandshakeError, SyncHandshakeClient
from epdserve.wire.rooms import RoomState
from tests.encode_helpers import Receiver, png

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = (
    "epdserve/multimodal",
    "epdserve/data_plane",
    "handshake",
    "encode_worker",
    "prefill_side",
    "epdserve/dispatcher",
)
# modules that turn bytes into arbitrary objects (or code)
UNSAFE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "marshal",
    "shelve",
    "dill",
    "cloudpickle",
    "joblib",
    "jsonpickle",
    "yaml",
}
UNSAFE_CALLS = {
    ("torch", "load"),
    ("numpy", "load"),
    ("np", "load"),
    ("multiprocessing", "Pipe"),
    ("multiprocessing", "Queue"),
    ("builtins", "eval"),
    (None, "eval"),
    (None, "exec"),
}


def _product_files():
    for package in PRODUCT:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_no_pickle_or_code_on_any_wire():
    """No product module imports a deserializer that can build arbitrary objects, loads tensors with
    torch.load / numpy.load, or evaluates text. Wire formats are JSON (pydantic models with every
    field bounded) and raw bytes (image files, uint8 pixels, embedding rows)."""
    found = []
    for path in _product_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [
                    (path, alias.name)
                    for alias in node.names
                    if alias.name.split(".")[0] in UNSAFE_MODULES
                ]
            elif (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[0] in UNSAFE_MODULES
            ):
                found.append((path, node.module))
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                    if (func.value.id, func.attr) in UNSAFE_CALLS:
                        found.append((path, f"{func.value.id}.{func.attr}"))
                elif isinstance(func, ast.Name) and (None, func.id) in UNSAFE_CALLS:
                    found.append((path, func.id))
    assert not found, found
    assert len(list(_product_files())) > 30  # the scan saw the product


@pytest.fixture(scope="module")
def locked_worker(tmp_path_factory):
    """An encode worker (real ZMQ intake, real uvicorn room API) that requires an intake token and a
    bearer token, with a 256 KiB payload limit."""
    model = build_vision_only("qwen2_5_vl", str(tmp_path_factory.mktemp("tower")))
    loopback = LoopbackTransport()
    config = WorkerConfig(
        model=model,
        transports=("loopback",),
        bootstrap_port=0,
        intake_port=0,
        bind="127.0.0.1",
        ring_bytes=4 << 20,
        ring_slot_bytes=1 << 16,
        cache_bytes=0,
        receiver_wait_s=10,
        intake_token="intake-s3cret",
        handshake_token="rooms-s3cret",
        max_payload_bytes=256 << 10,
    )
    worker = EncodeWorker(config, transports={"loopback": loopback}).start()
    receiver = Receiver(worker.table, {"loopback": loopback})
    yield worker, receiver
    worker.stop()
    receiver.close()


def _request(worker, room, token=None):
    body = {
        "request_id": f"sec-{room}",
        "source": "bytes",
        "encode_handshake": loopback_handshake(room, worker.bootstrap_port),
    }
    if token is not None:
        body["token"] = token
    return body


def test_intake_requires_its_token(locked_worker):
    worker, receiver = locked_worker
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        image = png(64, 64, 1)
        (room,) = worker.table.mint(1, 60)
        for token in (None, "wrong", "intake-s3cret-but-longer", ""):
            reply = intake.send(_request(worker, room, token), image)
            assert reply == IntakeReply(
                status=IntakeStatus.REFUSED, room=room, reason="missing or wrong intake token"
            )
        assert (
            worker.table.view(room).state is RoomState.PENDING
        )  # a refused message touches nothing
        assert intake.send(_request(worker, room, "intake-s3cret"), image).ok
        tower = worker.tower
        inputs = tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
        (rows,) = tower.rows_per_item(inputs["image_grid_thw"])
        receiver.reserve(room, rows, tower.info.wire_width, tower.dtype)
        assert receiver.wait(room)[0] is RoomState.SUCCESS
    finally:
        intake.close()


def test_room_api_requires_the_bearer_token(locked_worker):
    worker, _ = locked_worker
    url = f"http://127.0.0.1:{worker.bootstrap_port}"
    for token in (None, "wrong"):
        client = SyncHandshakeClient(url, token=token, retries=0)
        try:
            with pytest.raises(HandshakeError) as refused:
                client.mint(1)
            assert refused.value.status == 401
        finally:
            client.close()
    client = SyncHandshakeClient(url, token="rooms-s3cret")
    try:
        assert client.mint(1)
    finally:
        client.close()


def test_frames_over_the_size_bounds_are_dropped_or_refused(locked_worker):
    """A payload over max_payload_bytes is refused with the reason; a message over the socket's
    MAXMSGSIZE (payload limit + 1 MiB) is never read: ZMQ drops that peer's connection. Either way
    the intake keeps serving."""
    worker, _ = locked_worker
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}", timeout_s=2)
    try:
        (room,) = worker.table.mint(1, 60)
        reply = intake.send(
            _request(worker, room, "intake-s3cret"), b"\x89PNG" + b"\x00" * (256 << 10)
        )
        assert reply.ok is False and "exceeds" in reply.reason
        with pytest.raises(TimeoutError):
            intake.send_raw([b"{}", b"\x00" * (2 << 20)])  # over MAXMSGSIZE: dropped unread
    finally:
        intake.close()
    fresh = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        (room,) = worker.table.mint(1, 60)
        assert fresh.send(_request(worker, room, "intake-s3cret"), png(64, 64, 2)).ok
    finally:
        fresh.close()


def test_intake_reaches_no_room_endpoint_the_deployment_did_not_sign(locked_worker):
    """An item whose room lives at another endpoint, unsigned or signed with another token's key:
    refused at intake, and that endpoint gets no request (nor the worker's bearer token); signed
    with the deployment's key, the same address is taken."""
    from epdserve.wire.room_signatures import RoomSigner
    from tests.image_server import recording

    worker, _ = locked_worker
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        with recording() as (port, seen):
            address = loopback_encode_handshake(77, port)
            for handshake, why in (
                (address, "is not signed by the deployment"),
                (RoomSigner("another-token").sign(address, 60), "is not the deployment's"),
            ):
                body = {**_request(worker, 77, "intake-s3cret")}
                body["encode_handshake"] = handshake.model_dump(exclude_none=True)
                reply = intake.send(body, png(64, 64, 2))
                assert reply.status is IntakeStatus.REFUSED and why in reply.reason, reply
            assert seen == []
            signed = RoomSigner("rooms-s3cret").sign(address, 60)
            body = {**_request(worker, 78, "intake-s3cret")}
            body["encode_handshake"] = signed.model_copy(update={"bootstrap_room": 78}).model_dump()
            assert intake.send(body, png(64, 64, 3)).status is IntakeStatus.REFUSED  # room moved
            body["encode_handshake"] = (
                RoomSigner("rooms-s3cret")
                .sign(loopback_encode_handshake(78, port), 60)
                .model_dump()
            )
            assert intake.send(body, png(64, 64, 4)).ok
    finally:
        intake.close()
