"""The transport registry (``wire.offers.TRANSPORTS``) is what every reader uses: the
handshake models' names and offers bound, ``--transports``, and ``build_transports``."""

import subprocess
import sys
import typing

import pytest
from pydantic import ValidationError

from epdserve.process_settings import TransportNames
from epdserve.wire.offers import MAX_OFFERS, TRANSPORT_NAMES, TRANSPORTS, transport_spec
from epdserve.wire.rooms import BeginWrite, CommitBody, Registration


def test_registry_order_and_flags():
    assert TRANSPORT_NAMES == ("shm", "mooncake", "loopback")  # the sender's preference
    assert [s.name for s in TRANSPORTS if s.registers_send_memory] == ["mooncake"]
    assert [s.name for s in TRANSPORTS if s.needs_shm_pool] == ["shm"]
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
        transport_spec("carrier-pigeon")


def test_handshake_models_read_the_registry():
    for model in (BeginWrite, CommitBody):
        assert typing.get_args(model.model_fields["transport"].annotation) == TRANSPORT_NAMES
    with pytest.raises(ValidationError):
        BeginWrite(room=1, generation=1, transport="carrier-pigeon")
    offers = [
        {"kind": "shm", "namespace": "n", "segment": "epd-pool-x", "offset": 0, "capacity": 64},
        {"kind": "mooncake", "session": "127.0.0.1:15000", "address": 4096, "capacity": 64},
        {"kind": "loopback", "region": 1, "offset": 0, "capacity": 64},
    ]
    assert len(offers) == MAX_OFFERS
    body = {"room": 1, "generation": 1, "rows": 2, "width": 4, "dtype": "float32"}
    assert [o.kind for o in Registration(**body, offers=offers).offers] == [
        "shm",
        "mooncake",
        "loopback",
    ]
    with pytest.raises(
        ValidationError, match="runs past"
    ):  # an offer's span: Mooncake's is its address
        Registration(**body, offers=[{**offers[1], "address": (1 << 64) - 32}])


def test_cli_transports_flag_reads_the_registry():
    from pydantic import TypeAdapter

    names = TypeAdapter(TransportNames)
    assert names.validate_python("loopback, shm,shm") == ("loopback", "shm")
    with pytest.raises(ValidationError, match="give one or more of shm, mooncake, loopback"):
        names.validate_python("carrier-pigeon")


def test_registry_handshake_and_settings_load_without_torch():
    """The standalone handshake server and the room clients stay light: no torch in them."""
    code = (
        "import sys, epdserve.wire.offers, epdserve.wire.rooms, handshake.server, "
        "epdserve.wire.room_client, epdserve.wire.addresses, epdserve.process_settings, "
        "encode_worker.config; print('torch' in sys.modules)"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )


def test_build_transports_builds_registered_classes():
    from epdserve.data_plane.loopback import LoopbackTransport
    from epdserve.data_plane.transport import build_transports

    built = build_transports(["loopback"])
    assert list(built) == ["loopback"] and type(built["loopback"]) is LoopbackTransport
    with pytest.raises(ValueError, match="unknown transport"):
        build_transports(["carrier-pigeon"])
