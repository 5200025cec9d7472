"""schemathesis against the app's own OpenAPI: no 5xx, responses match the schema, bad data refused.

``positive_data_acceptance`` is left out: for 64-bit bounds (room ids, generations, checksums)
the generator compares candidates as JSON floats and offers integers just past the bound (such as
2**64 + 382 for ``< 2**64``) as valid. The exact boundaries are tested by hand below instead.
"""

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from epdserve.wire.rooms import MAX_ROOM_ID
from handshake.app import create_app
from tests.profiles import examples

schema = schemathesis.openapi.from_asgi("/openapi.json", create_app())


@schema.parametrize()
@settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms(case):
    case.call_and_validate(excluded_checks=[positive_data_acceptance])


def test_64_bit_boundaries_are_exact():
    with TestClient(create_app()) as client:

        def status(path, body):
            return client.post(path, json=body).status_code

        assert (
            status("/v1/rooms/cancel", {"rooms": [MAX_ROOM_ID]}) == 200
        )  # unknown room: per-room 404 inside
        assert status("/v1/rooms/cancel", {"rooms": [MAX_ROOM_ID + 1]}) == 422
        commit = {
            "room": 1,
            "generation": (1 << 63) - 1,
            "transport": "shm",
            "rows": 1,
            "width": 1,
            "dtype": "uint8",
            "checksum": (1 << 64) - 1,
        }
        assert status("/v1/rooms/commit", {"commits": [commit]}) == 200
        assert status("/v1/rooms/commit", {"commits": [{**commit, "checksum": 1 << 64}]}) == 422
        assert status("/v1/rooms/commit", {"commits": [{**commit, "generation": 1 << 63}]}) == 422
        assert (
            status("/v1/rooms/commit", {"commits": [{**commit, "rows": 2.0}]}) == 200
        )  # integral float
        assert status("/v1/rooms/commit", {"commits": [{**commit, "rows": 2.5}]}) == 422
