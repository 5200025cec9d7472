"""A receive job's items as the tests and benchmarks build them: each with an encode handshake
naming its room on a handshake server on 127.0.0.1."""

from __future__ import annotations

from epdserve.multimodal.items import MultimodalDataItem, MultimodalInputs
from epdserve.wire.addresses import EncodeHandshake
from epdserve.wire.modality import Modality

HOST = "127.0.0.1"


def loopback_handshake(room: int, port: int) -> dict:
    """An item's encode handshake: room ``room`` on the handshake server at 127.0.0.1:``port``."""
    return {"bootstrap_room": room, "bootstrap_host": HOST, "bootstrap_port": port}


def loopback_encode_handshake(room: int, port: int) -> EncodeHandshake:
    """``loopback_handshake(room, port)`` as the typed message."""
    return EncodeHandshake(**loopback_handshake(room, port))


def loopback_job_inputs(rooms: list[int], rows: int, port: int) -> MultimodalInputs:
    """A receive job's inputs: one image item of ``rows`` rows per room, each room on the
    handshake server at 127.0.0.1:``port``."""
    return MultimodalInputs(
        [
            MultimodalDataItem(
                Modality.IMAGE,
                offsets=[[0, rows - 1]],
                encode_handshake=loopback_handshake(room, port),
            )
            for room in rooms
        ]
    )
