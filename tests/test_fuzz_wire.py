"""Property-based fuzzing (hypothesis) of every parser that reads bytes from another process:
ZMQ intake frames, the handshake bodies, epd-prefill's request (as bytes and through its ASGI app,
plus schemathesis on its OpenAPI), SHM names and handles, and commit acceptance. Each parser must
either accept the input, with every bound the model states holding, or refuse it with its own
error type: never another exception, never a 5xx. Example counts are fixed here (``settings``) and
quoted in docs/reliability.md; ``pytest tests/test_fuzz_wire.py --hypothesis-show-statistics``
prints them.
"""

import concurrent.futures
import json
import re
import threading
import time
from types import SimpleNamespace

import pytest
import schemathesis
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from epdserve.data_plane.commit import (
    Commit,
    ContractError,
    EmbeddingLayout,
    accept_commit,
    checksum,
)
from epdserve.data_plane.pool import MemoryRegion, SlotPool
from epdserve.data_plane.shm import ShmError, ShmSegment, ShmTensorHandle, validate_name
from epdserve.prefill_server.app import PrefillRequest, create_app
from epdserve.wire import rooms as models
from epdserve.wire.intake import (
    MAX_BATCH_ITEMS,
    MAX_METADATA_BYTES,
    IntakeGate,
    IntakeRefused,
    IntakeRequest,
    parse_batch,
    parse_request,
)
from epdserve.wire.offers import MAX_ROOM_ID, MAX_ROWS, MAX_WIDTH, ShmOffer
from handshake.rooms import RoomLimits
from prefill_side import ItemOutcome, JobState
from tests.profiles import examples

FAST = settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=examples(1000))
SLOW = settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=examples(200))

# JSON values with the numbers that break naive parsers: huge, negative, fractional, near
# 2**63/2**64
numbers = st.one_of(
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from(
        [0, 1, -1, MAX_ROOM_ID, MAX_ROOM_ID + 1, (1 << 64) - 1, 1 << 64, 2.0, 2.5, 1e308]
    ),
    st.floats(allow_nan=False, allow_infinity=False),
)
json_values = st.recursive(
    st.none() | st.booleans() | numbers | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
handshakes = st.fixed_dictionaries(
    {
        "bootstrap_room": numbers,
        "bootstrap_host": st.sampled_from(["127.0.0.1", "h", "", "a/b", "x" * 300]),
        "bootstrap_port": numbers,
    }
)


def _intake_dicts():
    """Intake metadata: mostly near-valid (right keys, values fuzzed), sometimes anything."""
    near = st.fixed_dictionaries(
        {
            "request_id": st.text(max_size=140),
            "source": st.sampled_from(["bytes", "pixels", "shm", "other"]),
            "encode_handshake": handshakes,
        },
        optional={
            "shape": st.lists(numbers, max_size=4),
            "content_hash": numbers,
            "model": st.text(max_size=10),
            "token": st.text(max_size=10),
            "modality": st.sampled_from(["IMAGE", "AUDIO"]),
            "shm": st.fixed_dictionaries(
                {
                    "shm_name": st.text(max_size=30),
                    "shape": st.lists(numbers, max_size=4),
                    "dtype": st.sampled_from(["uint8", "float32"]),
                }
            ),
            "extra": json_values,
        },
    )
    return st.one_of(near, st.dictionaries(st.text(max_size=10), json_values, max_size=6))


# ---- ZMQ intake frames -------------------------------------------------------------------------


def _check_intake(frames, max_payload, token):
    try:
        request, payload = parse_request(
            frames, IntakeGate(max_payload_bytes=max_payload, token=token, model="m")
        )
    except IntakeRefused as exc:
        assert str(exc)
        return False
    assert isinstance(request, IntakeRequest) and 1 <= len(frames) <= 2
    assert len(frames[0]) <= MAX_METADATA_BYTES
    assert 1 <= request.encode_handshake.bootstrap_room <= MAX_ROOM_ID
    assert token is None or request.token == token
    if request.source == "shm":
        assert payload is None and validate_name(request.shm.shm_name)
    else:
        assert payload and len(payload) <= max_payload
        if request.source == "pixels":
            height, width, channels = request.shape
            assert channels == 3 and height * width * 3 == len(payload)
    return True


@FAST
@given(st.lists(st.binary(max_size=200), max_size=4), st.sampled_from([None, "secret"]))
def test_intake_frames_of_random_bytes(frames, token):
    _check_intake(frames, 1 << 16, token)


@FAST
@given(
    _intake_dicts(),
    st.one_of(st.none(), st.binary(max_size=64)),
    st.sampled_from([None, "secret"]),
    st.integers(min_value=0, max_value=64),
)
def test_intake_metadata_json(metadata, payload, token, max_payload):
    frames = [json.dumps(metadata).encode()] + ([payload] if payload is not None else [])
    _check_intake(frames, max_payload, token)


@FAST
@given(st.integers(min_value=0, max_value=400), st.integers(min_value=1, max_value=8))
def test_intake_truncated_and_oversized(cut, extra):
    """Any prefix of a valid message's metadata is refused; a payload one byte over the limit is."""
    valid = {
        "request_id": "r",
        "source": "pixels",
        "shape": [2, 2, 3],
        "encode_handshake": {"bootstrap_room": 5, "bootstrap_host": "h", "bootstrap_port": 9},
    }
    metadata = json.dumps(valid).encode()
    if cut < len(metadata):
        with pytest.raises(IntakeRefused):
            parse_request(
                [metadata[:cut], b"\x00" * 12], IntakeGate(max_payload_bytes=64, model="m")
            )
    assert _check_intake([metadata, b"\x00" * 12], 12, None)
    with pytest.raises(IntakeRefused):
        parse_request(
            [json.dumps({**valid, "source": "bytes"}).encode(), b"\x00" * (12 + extra)],
            IntakeGate(max_payload_bytes=12, model="m"),
        )
    with pytest.raises(IntakeRefused):
        parse_request(
            [b" " * (MAX_METADATA_BYTES + extra)], IntakeGate(max_payload_bytes=12, model="m")
        )


@FAST
@given(
    st.lists(_intake_dicts(), max_size=4),
    st.lists(st.binary(max_size=64), max_size=5),
    st.sampled_from([None, "secret"]),
)
def test_intake_batches(items, payloads, token):
    """A batch is refused whole (no room) only when its metadata cannot be read; payload frames
    that are not one per item with a payload refuse every item, naming its room; otherwise each
    item is parsed as it would be alone, with the payload frame it is matched to."""
    frames = [json.dumps({"items": items}).encode(), *payloads]
    try:
        parsed = parse_batch(frames, IntakeGate(max_payload_bytes=64, token=token, model="m"))
    except IntakeRefused as exc:
        assert exc.room is None and str(exc)
        return
    assert 1 <= len(parsed) == len(items) <= MAX_BATCH_ITEMS
    if len(payloads) != sum(item["source"] != "shm" for item in items):
        assert [refusal.room for refusal in parsed] == [
            item["encode_handshake"]["bootstrap_room"] for item in items
        ]
        assert all("payload frames" in str(refusal) for refusal in parsed)
        return
    for index, item in enumerate(parsed):
        if isinstance(item, IntakeRefused):
            assert str(item)
            continue
        request, payload = item
        alone = [request.model_dump_json().encode()] + ([payload] if payload is not None else [])
        assert _check_intake(alone, 64, token)
        if payload is not None:  # the payload frame of its place among the items with one
            assert payload is payloads[sum(i["source"] != "shm" for i in items[:index])]


# ---- handshake bodies --------------------------------------------------------------------------

# one valid registration, begin and commit of room 3, for the tests that need a valid body or frame
VALID_REGISTRATION = {
    "room": 3,
    "generation": 1,
    "rows": 2,
    "width": 4,
    "dtype": "float32",
    "offers": [{"kind": "loopback", "region": 1, "offset": 0, "capacity": 32}],
}
VALID_BEGIN = {"room": 3, "generation": 1, "transport": "shm"}
VALID_COMMIT = {
    "room": 3,
    "generation": 1,
    "transport": "shm",
    "rows": 2,
    "width": 4,
    "dtype": "float32",
}
BODIES = [
    models.MintRequest,
    models.RegisterRequest,
    models.BeginWriteRequest,
    models.CommitRequest,
    models.FailRequest,
    models.CancelRequest,
    models.WatchRequest,
]
_room = st.one_of(numbers, st.integers(min_value=1, max_value=MAX_ROOM_ID))
_offer = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["shm", "mooncake", "loopback", "rdma"]),
            "namespace": st.text(max_size=5),
            "segment": st.text(max_size=20),
            "offset": numbers,
            "capacity": numbers,
            "session": st.text(max_size=20),
            "address": numbers,
            "region": numbers,
        }
    ),
)
_registration = st.fixed_dictionaries(
    {
        "room": _room,
        "generation": numbers,
        "rows": numbers,
        "width": numbers,
        "dtype": st.sampled_from(["float32", "bfloat16", "complex64", ""]),
        "offers": st.lists(_offer, max_size=4),
    },
    optional={"deadline_s": numbers},
)
_commit = st.fixed_dictionaries(
    {
        "room": _room,
        "generation": numbers,
        "transport": st.sampled_from(["shm", "mooncake", "tcp"]),
        "rows": numbers,
        "width": numbers,
        "dtype": st.sampled_from(["float32", "int8"]),
    },
    optional={
        "checksum": numbers,
        "grid_thw": st.lists(numbers, max_size=4),
        "shm_segment": st.text(max_size=20),
        "timings": st.dictionaries(
            st.sampled_from(["queue_s", "encode_s", "cache_hit", "x"]), numbers
        ),
    },
)
_bodies = st.one_of(
    st.fixed_dictionaries({"count": numbers, "ttl_s": numbers}),
    st.fixed_dictionaries(
        {"receivers": st.lists(_registration, max_size=3)}, optional={"wait_s": numbers}
    ),
    st.fixed_dictionaries(
        {
            "writes": st.lists(
                st.fixed_dictionaries(
                    {"room": _room, "generation": numbers, "transport": st.text(max_size=9)}
                ),
                max_size=3,
            )
        }
    ),
    st.fixed_dictionaries({"commits": st.lists(_commit, max_size=3)}),
    st.fixed_dictionaries(
        {
            "failures": st.lists(
                st.fixed_dictionaries(
                    {"room": _room, "reason": st.text(max_size=600), "settled": json_values}
                ),
                max_size=3,
            )
        }
    ),
    st.fixed_dictionaries(
        {
            "rooms": st.lists(
                st.one_of(_room, st.fixed_dictionaries({"room": _room, "after_version": numbers})),
                max_size=3,
            )
        },
        optional={"reason": st.text(max_size=9), "wait_s": numbers},
    ),
    json_values,
)


def _within_bounds(body) -> None:
    """Every accepted body respects the bounds the wire promises."""
    for value in body.model_dump().values():
        for entry in value if isinstance(value, list) else []:
            if isinstance(entry, dict):
                if "room" in entry:
                    assert 1 <= entry["room"] <= MAX_ROOM_ID
                if "rows" in entry:
                    assert 0 < entry["rows"] <= MAX_ROWS and 0 < entry["width"] <= MAX_WIDTH
                if "generation" in entry:
                    assert 0 <= entry["generation"] < 1 << 63
            elif isinstance(entry, int):
                assert 1 <= entry <= MAX_ROOM_ID


ROUTES = {
    models.MintRequest: "/v1/rooms",
    models.RegisterRequest: "/v1/rooms/register",
    models.BeginWriteRequest: "/v1/rooms/begin-write",
    models.CommitRequest: "/v1/rooms/commit",
    models.FailRequest: "/v1/rooms/fail",
    models.CancelRequest: "/v1/rooms/cancel",
    models.WatchRequest: "/v1/rooms/watch",
}


def _check_body(model, raw: bytes) -> bool:
    """Parse ``raw`` as ``model`` and post it to the model's route of the real app. A body that
    parses keeps the wire's bounds, round-trips, and is answered 200 (a mint: or 503, rooms full, or
    400 for a TTL over the table's lifetime);
    any other is answered 422 with FastAPI's declared shape, one ``{type, loc, msg}`` per error of
    the model, ``loc`` under ``body``. True if the body was valid."""
    response = _handshake_client().post(
        ROUTES[model], content=raw, headers={"content-type": "application/json"}
    )
    assert str(response.status_code) in _declared_statuses(ROUTES[model]), response.status_code
    try:
        parsed = model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        assert errors
        assert response.status_code == 422, (response.status_code, response.text)
        detail = response.json()["detail"]
        assert [(d["type"], d["loc"], d["msg"]) for d in detail] == [
            (e["type"], ["body", *e["loc"]], e["msg"]) for e in errors
        ]
        return False
    _within_bounds(parsed)
    assert model.model_validate_json(parsed.model_dump_json()) == parsed  # what we send, we accept
    if (
        model is models.MintRequest and parsed.ttl_s > RoomLimits.max_ttl_s
    ):  # over the table's own bound
        assert response.status_code == 400 and "room lifetime" in response.text, response.text
    else:
        assert response.status_code in ((200, 503) if model is models.MintRequest else (200,)), (
            response.text
        )
    return True


_DECLARED: dict[str, set[str]] = {}


def _declared_statuses(path: str) -> set[str]:
    """The statuses the app's OpenAPI declares for POST ``path``."""
    if not _DECLARED:
        spec = _handshake_client().get("/openapi.json").json()
        _DECLARED.update(
            {p: set(v["post"]["responses"]) for p, v in spec["paths"].items() if "post" in v}
        )
    return _DECLARED[path]


@FAST
@given(_bodies, st.sampled_from(BODIES))
def test_handshake_bodies(body, model):
    _check_body(model, json.dumps(body).encode())


@FAST
@example(b"{}", models.MintRequest)
@example(b'{"count": 2, "ttl_s": 5}', models.MintRequest)
@example(b'{"rooms": [{"room": 2, "after_version": 3}]}', models.WatchRequest)
@example(b'{"rooms": [7], "reason": "r"}', models.CancelRequest)
@example(b'{"failures": [{"room": 5, "reason": "x", "settled": true}]}', models.FailRequest)
@given(st.binary(max_size=300), st.sampled_from(BODIES))
def test_handshake_bodies_of_random_bytes(raw, model):
    _check_body(model, raw)


def test_a_valid_body_of_each_kind_is_accepted():
    """The checks above see valid bodies of every route (random bytes alone rarely are one)."""
    valid = {
        models.MintRequest: {"count": 1},
        models.RegisterRequest: {"receivers": [VALID_REGISTRATION]},
        models.BeginWriteRequest: {"writes": [VALID_BEGIN]},
        models.CommitRequest: {"commits": [VALID_COMMIT]},
        models.FailRequest: {"failures": [{"room": 3, "reason": "x"}]},
        models.CancelRequest: {"rooms": [3]},
        models.WatchRequest: {"rooms": [{"room": 3}]},
    }
    assert set(valid) == set(BODIES)
    for model, body in valid.items():
        assert _check_body(model, json.dumps(body).encode()), model
        assert not _check_body(model, json.dumps({**body, "extra": 1}).encode()), model


@SLOW
@given(
    st.integers(min_value=0, max_value=10_000),
    st.sampled_from(["/v1/rooms/register", "/v1/rooms/commit"]),
)
def test_truncated_handshake_bodies_get_4xx(cut, path):
    """Any prefix of a valid body through the real app (front door, body routes): a 4xx, never a
    5xx."""
    body = {
        "/v1/rooms/register": {"receivers": [VALID_REGISTRATION]},
        "/v1/rooms/commit": {"commits": [VALID_COMMIT]},
    }[path]
    raw = json.dumps(body).encode()
    response = _handshake_client().post(
        path, content=raw[: cut % (len(raw) + 1)], headers={"content-type": "application/json"}
    )
    assert response.status_code < 500


# ---- the room stream's frames ------------------------------------------------------------------

_writes = st.lists(
    st.fixed_dictionaries(
        {"room": _room, "generation": numbers, "transport": st.text(max_size=9)},
        optional={"writer": st.text(max_size=9), "write_timeout_s": numbers},
    ),
    max_size=3,
)
_stream_frames = st.one_of(
    st.fixed_dictionaries(
        {"op": st.just("open"), "rooms": st.lists(_room, max_size=3)}, optional={"ttl_s": numbers}
    ),
    st.fixed_dictionaries(
        {"op": st.just("register"), "receivers": st.lists(_registration, max_size=3)}
    ),
    st.fixed_dictionaries(
        {"op": st.just("cancel"), "rooms": st.lists(_room, max_size=3)},
        optional={"reason": st.text(max_size=600)},
    ),
    st.fixed_dictionaries(
        {
            "op": st.sampled_from(["watch_staged", "watch_registered", "watch", "mint"]),
            "rooms": st.lists(_room, max_size=3),
        }
    ),
    st.fixed_dictionaries({"op": st.just("begin_write"), "writes": _writes}),
    st.fixed_dictionaries({"op": st.just("commit"), "commits": st.lists(_commit, max_size=3)}),
    st.dictionaries(st.text(max_size=10), json_values, max_size=4),
    json_values,
)


def _check_stream_frame(raw: bytes) -> str:
    """``raw`` as a frame of the room stream, parsed and sent to the real server end (in-process):
    a frame that parses keeps the wire's bounds and round-trips, and the stream answers a probe
    after it (every frame out is a ``BatchResponse``); any other closes that stream with 1007 and
    a reason, and the server takes a new stream. What the frame was, for ``event``."""
    from starlette.websockets import WebSocketDisconnect

    try:
        frame = models.STREAM_FRAME.validate_json(raw)
    except ValidationError as exc:
        assert exc.errors(include_url=False)
        frame = None
    else:
        _within_bounds(frame)
        assert models.STREAM_FRAME.validate_json(frame.model_dump_json()) == frame
    global _PROBE_ROOM
    _PROBE_ROOM += 1
    with _handshake_client().websocket_connect(models.STREAM_PATH) as websocket:
        websocket.send_bytes(raw)
        websocket.send_text(models.StreamOpen(rooms=[_PROBE_ROOM], ttl_s=5).model_dump_json())
        try:
            answered = False
            while not answered:
                results = models.BatchResponse.model_validate_json(_receive_text(websocket))
                answered = any(result.room == _PROBE_ROOM for result in results.results)
        except WebSocketDisconnect as exc:
            assert frame is None, frame
            assert exc.code == 1007 and exc.reason.startswith("malformed frame"), exc
        else:
            assert frame is not None, raw
    return f"a {frame.op} frame" if frame is not None else "refused"


_PROBE_ROOM = MAX_ROOM_ID // 2  # (rooms the probes open, one each)


def _receive_text(websocket, timeout_s: float = 10.0) -> str:
    """The test client's next frame, or a failure after ``timeout_s`` (its own wait has no
    bound): received on a daemon thread, which a stream that never answers leaves blocked."""
    import queue

    box: queue.Queue = queue.Queue()

    def receive() -> None:
        try:
            box.put((True, websocket.receive_text()))
        except BaseException as exc:  # (handed to the test's thread, raised there)
            box.put((False, exc))

    threading.Thread(target=receive, daemon=True).start()
    try:
        received, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"the room stream answered nothing within {timeout_s} s") from None
    if not received:
        raise value
    return value


def test_a_valid_frame_of_each_kind_is_answered():
    """The checks above see valid frames of every op (random ones rarely are), and the same frame
    with a key too many refused."""
    frames = [
        {"op": "open", "rooms": [3], "ttl_s": 30},
        {"op": "register", "receivers": [VALID_REGISTRATION]},
        {"op": "cancel", "rooms": [4]},
        {"op": "watch_staged", "rooms": [3]},
        {"op": "watch_registered", "rooms": [3]},
        {"op": "begin_write", "writes": [VALID_BEGIN]},
        {"op": "commit", "commits": [VALID_COMMIT]},
    ]
    assert {frame["op"] for frame in frames} == {
        model.model_fields["op"].default
        for name, model in vars(models).items()
        if name.startswith("Stream") and "op" in getattr(model, "model_fields", {})
    }
    for frame in frames:
        assert _check_stream_frame(json.dumps(frame).encode()) == f"a {frame['op']} frame"
        assert _check_stream_frame(json.dumps({**frame, "extra": 1}).encode()) == "refused"


@SLOW
@given(_stream_frames)
def test_room_stream_frames(frame):
    event(_check_stream_frame(json.dumps(frame).encode()))


@SLOW
@example(b"")
@example(b'{"op": "open", "rooms": [1]}')
@example(b'{"op": "register", "receivers": []}')
@given(st.binary(max_size=300))
def test_room_stream_frames_of_random_bytes(raw):
    event(_check_stream_frame(raw))


_HANDSHAKE_CLIENT = None


def _handshake_client():
    global _HANDSHAKE_CLIENT
    if _HANDSHAKE_CLIENT is None:
        from handshake.app import create_app as handshake_app

        _HANDSHAKE_CLIENT = TestClient(handshake_app(), raise_server_exceptions=False)
    return _HANDSHAKE_CLIENT


# ---- epd-prefill's request ---------------------------------------------------------------------


class _StubJob:
    """Every item fails at once: the fuzzing is about the request, not the receive path."""

    def __init__(self, inputs):
        self.inputs = inputs
        self.outcomes = [
            ItemOutcome(i, state="FAILED", reason="stub") for i in range(len(inputs.mm_items))
        ]
        self.future = concurrent.futures.Future()
        self.future.set_result(None)
        self.started = time.monotonic()

    def poll(self):
        return JobState.FAILED

    def cancel(self, reason=""):
        pass


class _StubReceiver:
    registry = CollectorRegistry()
    config = SimpleNamespace(handshake_token=None)  # its /v1 open, as a receiver's without one

    def start(self, request_id, inputs):
        return _StubJob(inputs)

    def health(self):
        return {
            "transports": ["loopback"],
            "lost": {},
            "cannot_receive": None,
            "not_ready": None,
            "pool": {"slots": 1, "free_slots": 1, "leased_slots": 0, "quarantined_slots": 0},
        }


PREFILL_APP = create_app(_StubReceiver(), max_body_bytes=1 << 16)
_prefill_items = st.lists(
    st.one_of(
        json_values,
        st.fixed_dictionaries(
            {"offsets": st.lists(st.lists(numbers, max_size=3), max_size=3)},
            optional={
                "encode_handshake": st.one_of(st.none(), handshakes),
                "image_b64": st.text(max_size=12),
                "grid_thw": st.lists(numbers, max_size=4),
            },
        ),
    ),
    max_size=3,
)
_prefill_bodies = st.one_of(
    st.fixed_dictionaries(
        {"request_id": st.text(max_size=140), "items": _prefill_items},
        optional={"verify": json_values, "timeout_s": numbers},
    ),
    json_values,
)


@FAST
@given(_prefill_bodies)
def test_prefill_request_model(body):
    try:
        parsed = PrefillRequest.model_validate_json(json.dumps(body))
    except ValidationError:
        return
    assert 1 <= len(parsed.items) <= 64 and 0 < parsed.timeout_s <= 600
    for item in parsed.items:
        assert all(start >= 0 and end >= 0 for start, end in item.offsets)


@SLOW
@given(
    st.one_of(_prefill_bodies.map(lambda body: json.dumps(body).encode()), st.binary(max_size=200))
)
def test_prefill_app_never_answers_5xx(raw):
    with TestClient(PREFILL_APP, raise_server_exceptions=False) as client:
        response = client.post(
            "/v1/prefill", content=raw, headers={"content-type": "application/json"}
        )
    assert response.status_code < 500, response.text


def test_prefill_app_out_of_range_numbers_and_oversized_bodies():
    """The two cases the fuzzing above found: 1e400 (inf after parsing) got a 500; bodies had no
    bound."""
    with TestClient(PREFILL_APP, raise_server_exceptions=False) as client:
        assert (
            client.post(
                "/v1/prefill",
                content=b'{"request_id": 1e400}',
                headers={"content-type": "application/json"},
            ).status_code
            == 422
        )
        assert (
            client.post(
                "/v1/prefill",
                content=b" " * ((1 << 16) + 1),
                headers={"content-type": "application/json"},
            ).status_code
            == 413
        )


prefill_schema = schemathesis.openapi.from_asgi("/openapi.json", PREFILL_APP)


@prefill_schema.parametrize()
@settings(max_examples=examples(100), deadline=None, suppress_health_check=list(HealthCheck))
def test_prefill_api_has_no_5xx(case):
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    case.call_and_validate(excluded_checks=[positive_data_acceptance])


# ---- epd-prefill with the real receiver ------------------------------------------------------
# The same app around a real PrefillReceiver (loopback transport, a small pool) whose items have
# their rooms at a real handshake server in this process. Rooms are minted per example and are
# written by a test-side encoder ("written"), written with a wrong checksum ("corrupt"), left
# unwritten ("fresh"), cancelled before the request ("cancelled"), named twice ("dup"), or are
# fuzzed numbers; the endpoint is the server or a port where nothing listens. No 5xx; a report has
# one settled entry per item; a DONE item carries exactly the rows written for its room; no slot
# stays leased once a request's rooms end, and every quarantined slot comes back (module teardown).


def _mostly(valid, junk, one_in: int = 8):
    """``valid``, but one draw in ``one_in`` from ``junk`` (one junk field refuses the whole
    body)."""
    return st.integers(0, one_in - 1).flatmap(
        lambda n: junk if n == 1 else valid
    )  # the ends: drawn often


_ROOM_KINDS = ("written", "written", "corrupt", "corrupt", "fresh", "cancelled", "dup")
_real_handshakes = st.fixed_dictionaries(
    {
        "bootstrap_room": _mostly(st.sampled_from(_ROOM_KINDS), numbers),
        "bootstrap_host": st.just("127.0.0.1"),
        "bootstrap_port": _mostly(st.just("server"), st.just("closed"), 6),
    }
)
_real_offsets = st.lists(st.integers(0, 60), min_size=2, max_size=6, unique=True).map(
    lambda ends: [list(span) for span in zip(sorted(ends)[::2], sorted(ends)[1::2])]
)  # increasing, disjoint
_real_items = st.lists(
    _mostly(
        st.fixed_dictionaries(
            {
                "offsets": _mostly(
                    _real_offsets, st.lists(st.lists(numbers, max_size=3), max_size=3)
                ),
                "encode_handshake": _mostly(_real_handshakes, st.none(), 5),
            },
            optional={
                "image_b64": _mostly(st.sampled_from(["", "aGVsbG8="]), st.text(max_size=12)),
                "grid_thw": _mostly(
                    st.sampled_from([[1, 2, 2], [1, 4, 4]]), st.lists(numbers, max_size=4)
                ),
            },
        ),
        json_values,
        12,
    ),
    min_size=1,
    max_size=4,
)
_real_bodies = _mostly(
    st.fixed_dictionaries(
        {"request_id": st.text(min_size=1, max_size=20), "items": _real_items},
        optional={
            "verify": _mostly(st.booleans(), json_values),
            "timeout_s": _mostly(st.sampled_from([0.05, 0.3, 2.0, 60]), numbers),
        },
    ),
    json_values,
    12,
)
REAL_WIDTH = 8


@pytest.fixture(scope="module")
def real_prefill():
    """(app, receiver, table, handshake server, loopback transport, a port where nothing
    listens)."""
    import socket

    from epdserve.data_plane.loopback import LoopbackTransport
    from handshake.app import create_app as handshake_app
    from handshake.rooms import RoomTable
    from handshake.server import ThreadedServer
    from prefill_side import PrefillReceiver, ReceiverConfig

    table = RoomTable()
    server = ThreadedServer(handshake_app(table)).start()
    loopback = LoopbackTransport()
    receiver = PrefillReceiver(
        ReceiverConfig(
            width=REAL_WIDTH,
            dtype="float32",
            pool_bytes=16 << 10,
            slot_bytes=1 << 10,
            transports=("loopback",),
            item_timeout_s=0.5,
            poll_s=0.2,
            quarantine_s=0.5,
        ),
        transports={"loopback": loopback},
    )
    closed = socket.socket()  # bound, never listening: a connection to it is refused
    closed.bind(("127.0.0.1", 0))
    try:
        yield (
            create_app(receiver, max_body_bytes=1 << 16),
            receiver,
            table,
            server,
            loopback,
            closed.getsockname()[1],
        )
        end = time.monotonic() + 10  # every quarantine (0.5 s) ends, and then every slot is free
        while receiver.pool.stats()["free_slots"] != receiver.pool.slot_count:
            assert time.monotonic() < end, f"slots never came back: {receiver.pool.stats()}"
            time.sleep(0.05)
    finally:
        closed.close()
        receiver.close()
        server.stop()


def _place_rooms(body, table, port: int, closed_port: int) -> list[tuple[int, int, str]]:
    """Replace the room kinds and endpoint names in ``body`` by real rooms and ports (in place);
    (item index, room, kind) for the rooms minted here."""
    placed, last = [], None
    items = body.get("items") if isinstance(body, dict) else None
    for index, item in enumerate(items if isinstance(items, list) else []):
        handshake = item.get("encode_handshake") if isinstance(item, dict) else None
        if not isinstance(handshake, dict) or "bootstrap_port" not in handshake:
            continue
        handshake["bootstrap_port"] = (
            port if handshake["bootstrap_port"] == "server" else closed_port
        )
        kind = handshake.get("bootstrap_room")
        if not isinstance(kind, str):
            continue
        if kind == "dup" and last is not None:
            room, kind = last
        else:
            (room,) = table.mint(1, 60)
            if kind == "cancelled":
                table.cancel(room, "cancelled before the request")
            last = (room, kind)
        handshake["bootstrap_room"] = room
        placed.append((index, room, kind))
    return placed


def _encode_side(
    table, transport, plan: dict[int, str], over: threading.Event, seconds: float = 20
) -> dict[int, int]:
    """A test-side encoder for the rooms in ``plan`` (room -> "written" or "corrupt"): once a
    receiver registered, begin the write, copy random rows into its slot through ``transport`` and
    commit them (with a checksum one off for "corrupt"); rooms that end first are left alone, and
    so are rooms still unregistered once the request is ``over`` (after one last look). The
    checksum of the rows committed, by room (SUCCESS only)."""
    from epdserve.data_plane.dtypes import dtype_from_wire
    from epdserve.data_plane.transport import TransferState
    from epdserve.wire.rooms import BeginWrite, CommitBody, RoomState

    committed, todo = {}, dict(plan)
    end = time.monotonic() + seconds
    while todo:
        last_look = over.is_set()
        for room, kind in list(todo.items()):
            view = table.view(room)
            if view.state is RoomState.PENDING:
                continue
            del todo[room]
            registration = view.registration
            if view.state.terminal or registration is None:
                continue
            began = table.begin_write(
                BeginWrite(room=room, generation=registration.generation, transport="loopback")
            )
            if began.state is not RoomState.WRITING:
                continue
            rows = torch.randn(registration.rows, registration.width).to(
                dtype_from_wire(registration.dtype)
            )
            (offer,) = [offer for offer in registration.offers if offer.kind == "loopback"]
            assert transport.submit(rows, offer, time.monotonic() + 5).wait() is TransferState.DONE
            sent = (checksum(rows) + (kind == "corrupt")) % (1 << 64)
            done = table.commit(
                CommitBody(
                    room=room,
                    generation=registration.generation,
                    transport="loopback",
                    rows=registration.rows,
                    width=registration.width,
                    dtype=registration.dtype,
                    checksum=sent,
                )
            )
            if done.state is RoomState.SUCCESS:
                committed[room] = sent
        if last_look:
            break
        if time.monotonic() >= end:
            raise TimeoutError(f"rooms still waiting for a receiver after {seconds} s: {todo}")
        time.sleep(0.002)
    return committed


_PREFILL_DECLARED: set[str] = set()


def _prefill_declared(app) -> set[str]:
    """The statuses epd-prefill's OpenAPI declares for POST /v1/prefill."""
    if not _PREFILL_DECLARED:
        spec = TestClient(app).get("/openapi.json").json()
        _PREFILL_DECLARED.update(spec["paths"]["/v1/prefill"]["post"]["responses"])
    return _PREFILL_DECLARED


@settings(max_examples=examples(150), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    _mostly(
        _real_bodies.map(lambda body: ("json", body)),
        st.binary(max_size=120).map(lambda raw: ("raw", raw)),
    )
)
def test_prefill_app_with_the_real_receiver(real_prefill, case):
    app, receiver, table, server, loopback, closed_port = real_prefill
    kind, body = case
    placed = _place_rooms(body, table, server.port, closed_port) if kind == "json" else []
    raw = json.dumps(body).encode() if kind == "json" else body
    plan = {room: room_kind for _, room, room_kind in placed if room_kind in ("written", "corrupt")}
    over = threading.Event()
    encoder = concurrent.futures.ThreadPoolExecutor(1)
    committed = encoder.submit(_encode_side, table, loopback, plan, over)
    encoder.shutdown(wait=False)
    response = TestClient(app, raise_server_exceptions=False).post(
        "/v1/prefill", content=raw, headers={"content-type": "application/json"}
    )
    over.set()  # no receiver registers a room of this request any more
    assert response.status_code < 500, response.text
    committed = committed.result(timeout=20)
    # every slot of the request is freed or quarantined once its room ends (a timed-out request's
    # report comes first: its rooms are cancelled and end after)
    end = time.monotonic() + 10
    while receiver.pool.stats()["leased_slots"]:
        assert time.monotonic() < end, f"a slot stays leased: {receiver.pool.stats()}"
        time.sleep(0.01)
    event(f"HTTP {response.status_code}")
    if response.status_code != 200:  # refused with a status its OpenAPI declares (400, 422)
        assert str(response.status_code) in _prefill_declared(app), response.text
        return
    report = response.json()
    assert len(report["items"]) == len(body["items"])
    assert all(item["state"] in ("DONE", "FAILED", "SKIPPED") for item in report["items"]), report
    assert report["state"] == (
        "FAILED" if any(i["state"] == "FAILED" for i in report["items"]) else "DONE"
    )
    kinds = {index: (room, room_kind) for index, room, room_kind in placed}
    for index, item in enumerate(report["items"]):
        event(
            f"item {item['state']}: "
            f"{re.sub(r'[0-9]+', 'N', (item['reason'] or '').split(':')[0])[:40]}"
        )
        if (
            item["state"] == "DONE"
        ):  # only from a room the encoder side committed, with exactly its rows
            room, room_kind = kinds[index]
            assert room_kind != "corrupt" and item["checksum"] == committed[room], (item, room_kind)
            assert item["width"] == REAL_WIDTH and item["transport"] == "loopback"
        elif item["state"] == "FAILED":
            assert item["reason"], item


# ---- SHM names and handles ---------------------------------------------------------------------


@FAST
@given(
    st.one_of(
        st.text(max_size=120),
        st.from_regex(r"epd-[A-Za-z0-9_-]{1,100}", fullmatch=True),
        st.sampled_from(
            [
                "epd-../x",
                "epd-a/b",
                "epd-\x00",
                "../../etc/passwd",
                "epd-" + "a" * 101,
                "epd-ok\n",
                "/dev/shm/epd-x",
                "epd-",
            ]
        ),
    )
)
def test_shm_names(name):
    """validate_name, the wire pattern of offers and commits, and attach agree; an accepted name is
    one path component of ours that cannot leave /dev/shm."""
    try:
        validate_name(name)
        valid = True
    except ValueError:
        valid = False
    try:
        ShmOffer(kind="shm", namespace="n", segment=name, offset=0, capacity=1)
        wire_valid = True
    except ValidationError:
        wire_valid = False
    assert valid == wire_valid
    if valid:
        assert (
            name.startswith("epd-") and "/" not in name and ".." not in name and "\x00" not in name
        )
        assert len(name) <= 104
    try:
        ShmSegment.attach(name)
        raise AssertionError(f"attached {name!r}")
    except ValueError:
        assert not valid
    except ShmError:
        assert valid  # a valid name of no segment: ENOENT, opened with O_NOFOLLOW inside /dev/shm


@FAST
@given(
    st.dictionaries(
        st.sampled_from(["shm_name", "shape", "dtype", "x"]),
        st.one_of(
            json_values,
            st.lists(numbers, max_size=3),
            st.sampled_from(["epd-h-1", "uint8", "float32", "complex64"]),
        ),
        max_size=4,
    )
)
def test_shm_handles_from_the_wire(data):
    try:
        handle = ShmTensorHandle.from_wire(data)
    except (KeyError, TypeError, ValueError, OverflowError):
        return
    validate_name(handle.shm_name)
    assert all(dim >= 0 for dim in handle.shape)


# ---- commit acceptance -------------------------------------------------------------------------

_POOL = SlotPool(MemoryRegion.anonymous(1 << 16), 1 << 10, quarantine_s=60)
_commits = st.fixed_dictionaries(
    {
        "generation": numbers,
        "rows": numbers,
        "width": numbers,
        "dtype": st.sampled_from(["float32", "bfloat16", "uint8", "int64", "x"]),
    },
    optional={"checksum": numbers},
)


@FAST
@given(
    _commits,
    st.integers(min_value=1, max_value=8),
    st.integers(min_value=1, max_value=16),
    st.booleans(),
    st.booleans(),
)
def test_commit_acceptance(fields, rows, width, release_first, flip):
    """A commit is accepted only for the live lease's generation, the reserved layout and (when
    sent) the slot's checksum; the view it returns is exactly the reservation. Anything else is a
    ContractError (or, for malformed fields, a ValidationError), never another exception."""
    layout = EmbeddingLayout(rows, width, "float32")
    lease = _POOL.lease(layout.nbytes)
    try:
        view = _POOL.view(lease)
        view.copy_(torch.randint(0, 255, (view.numel(),), dtype=torch.uint8))
        rows_tensor = view.view(torch.float32).view(rows, width)
        good = {
            "generation": lease.generation,
            "rows": rows,
            "width": width,
            "dtype": "float32",
            "checksum": checksum(rows_tensor),
        }
        for candidate in (
            fields,
            {**good, **{k: v for k, v in fields.items() if k == "checksum"}},
            good,
        ):
            try:
                commit = Commit.model_validate_json(json.dumps(candidate))
            except ValidationError:
                continue
            live = _POOL.is_current(lease)
            if flip:
                view[0] ^= 1  # a byte that differs from what the sender checksummed
            try:
                accepted = accept_commit(_POOL, lease, layout, commit)
            except ContractError:
                accepted = None
            finally:
                if flip:
                    view[0] ^= 1
            matches = (
                live
                and commit.generation == lease.generation
                and commit.layout == layout
                and (commit.checksum is None or (commit.checksum == good["checksum"] and not flip))
            )
            assert (accepted is not None) == matches, (candidate, flip)
            if accepted is not None:
                assert accepted.shape == (rows, width) and accepted.data_ptr() == view.data_ptr()
            if release_first:
                _POOL.release(lease)  # a released lease accepts nothing any more
    finally:
        _POOL.release(lease)
