"""Shared helpers for the handshake tests: a real server on loopback and ready-made bodies."""

import json
import urllib.error
import urllib.request

from epdserve.wire.offers import LoopbackOffer
from epdserve.wire.rooms import BeginWrite, CommitBody, Registration


def registration(
    room: int, generation: int = 1, rows: int = 64, width: int = 128, **extra
) -> Registration:
    return Registration(
        room=room,
        generation=generation,
        rows=rows,
        width=width,
        dtype="bfloat16",
        offers=[LoopbackOffer(kind="loopback", region=1, offset=0, capacity=rows * width * 2)],
        **extra,
    )


def begin(room: int, generation: int = 1, **extra) -> BeginWrite:
    return BeginWrite(room=room, generation=generation, transport="loopback", **extra)


def commit(
    room: int, generation: int = 1, rows: int = 64, width: int = 128, checksum: int = 7
) -> CommitBody:
    return CommitBody(
        room=room,
        generation=generation,
        transport="loopback",
        rows=rows,
        width=width,
        dtype="bfloat16",
        checksum=checksum,
    )


def get_json(url: str, timeout: float = 10) -> tuple[int, object]:
    """(status, JSON body) of a GET, error statuses included (probes answer 503 with a body)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
