"""The malformed-input fault scenario: garbage ZMQ frames to a worker's intake, garbage REST
bodies to every HTTP listener and an SHM handle naming no segment, each of which must be refused
with a reason while every listener keeps serving.
"""

from __future__ import annotations

import json
import random
import time
from typing import TYPE_CHECKING

from epdserve.bench.faults.lab import FaultOutcome
from epdserve.bench.faults.scenario_steps import serves, small_images

if TYPE_CHECKING:
    from epdserve.bench.faults.lab import Conn, FaultLab


MALFORMED_FRAMES = [
    [b""],
    [b"not json"],
    [b"\xff\xfe\x00garbage"],
    [b"{}", b"x", b"y"],
    [b"[" * 100_000],  # deep nesting
    [b'{"request_id": "x", "source": "bytes", "encode_handshake": {"bootstrap_room": NaN}}', b"x"],
    [json.dumps({"request_id": "a" * 129, "source": "bytes"}).encode(), b"x"],
    [b" " * (70 << 10)],  # metadata frame larger than the limit
    [
        json.dumps(
            {
                "request_id": "a",
                "source": "bytes",
                "encode_handshake": {
                    "bootstrap_room": 7,
                    "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": 1,
                },
            }
        ).encode(),
        b"not an image",
    ],
    [
        json.dumps(
            {
                "request_id": "a",
                "source": "pixels",
                "shape": [4, 4, 3],
                "encode_handshake": {
                    "bootstrap_room": 8,
                    "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": 1,
                },
            }
        ).encode(),
        b"\x00" * 47,
    ],
    [
        json.dumps(
            {
                "request_id": "a",
                "source": "shm",
                "shm": {"shm_name": "../../etc/passwd", "shape": [1, 1, 3], "dtype": "uint8"},
                "encode_handshake": {
                    "bootstrap_room": 10,
                    "bootstrap_host": "h",
                    "bootstrap_port": 1,
                },
            }
        ).encode()
    ],
]
MALFORMED_BODIES = [
    b"",
    b"null",
    b"[]",
    b"{",
    b"\xff\xfe",
    b"[" * 100_000,
    b'{"receivers": [{"room": 1e400}]}',
    json.dumps({"rooms": [0]}).encode(),
    json.dumps({"count": -1}).encode(),
    b" " * (2 << 20),
]


async def malformed_input(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """Malformed ZMQ frames to worker ``a``'s intake and malformed REST bodies to every HTTP
    listener (worker rooms, standalone handshake, epd-prefill): each is refused (a reply with a
    reason, or a 4xx), never a 5xx, and every listener keeps serving."""
    import aiohttp
    import zmq
    import zmq.asyncio

    from epdserve.wire.intake import IntakeReply

    outcome = FaultOutcome("malformed_input")
    a = lab.roles["a"]
    socket_ = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    socket_.setsockopt(zmq.LINGER, 0)
    socket_.connect(a.worker.intake_endpoint)
    replies = []
    try:
        for frames in MALFORMED_FRAMES:
            started = time.monotonic()
            await socket_.send_multipart(frames)
            if await socket_.poll(5000):
                reply = IntakeReply.model_validate_json(await socket_.recv())
                replies.append(reply)
                outcome.affected.append(
                    {
                        "state": "REFUSED" if not reply.ok else "ACCEPTED",
                        "reason": reply.reason,
                        "ttf_s": time.monotonic() - started,
                    }
                )
            else:
                outcome.affected.append({"state": "NO_REPLY", "reason": None, "ttf_s": None})
    finally:
        socket_.close(0)
    statuses = []
    for url, paths in (
        (a.url, ("/v1/rooms", "/v1/rooms/register", "/v1/rooms/commit", "/v1/rooms/watch")),
        (
            lab.roles["handshake"].url,
            ("/v1/rooms/fail", "/v1/rooms/cancel", "/v1/rooms/begin-write"),
        ),
        (lab.roles["prefill"].url, ("/v1/prefill",)),
    ):
        for path in paths:
            for body in MALFORMED_BODIES:
                started = time.monotonic()
                # a body over a server's limit is refused from its Content-Length and the connection
                # closed: with Expect: 100-continue the client reads that answer before sending the
                # body (without it, the refusal can be lost to the connection closing mid-send)
                try:
                    async with conn._session.post(
                        url + path,
                        data=body,
                        expect100=len(body) > (1 << 20),
                        headers={"content-type": "application/json"},
                    ) as response:
                        await response.read()
                        status = response.status
                except aiohttp.ClientError as exc:
                    status, error = (
                        None,
                        f"{type(exc).__name__}: {exc}",
                    )  # no answer at all: a finding
                statuses.append(status)
                if len(body) > (1 << 20):
                    outcome.notes.setdefault("oversized_statuses", {})[url + path] = status
                if status is None or not 400 <= status < 500:
                    outcome.notes.setdefault("bad_statuses", []).append(
                        (url + path, body[:40], status if status is not None else error)
                    )
                outcome.affected.append(
                    {"state": f"HTTP {status}", "reason": path, "ttf_s": time.monotonic() - started}
                )
    # a well-formed intake SHM handle naming no segment: accepted, then its room fails with the
    # reason
    (bad_shm,) = lab.describe(small_images(rng, 1))
    await conn.mint([bad_shm], a.url)
    from epdserve.wire.intake import IntakeRequest

    request = IntakeRequest(
        request_id="bad-shm",
        content_hash=1,
        encode_handshake=bad_shm.encode_handshake,
        source="shm",
        shm={"shm_name": "epd-in-does-not-exist", "shape": [4, 4, 3], "dtype": "uint8"},
    )
    started = time.monotonic()
    reply = await conn.intake(a).send(request)
    views = await conn.wait_rooms(
        a.url,
        [bad_shm.encode_handshake.bootstrap_room],
        lambda vs: bool(vs) and next(iter(vs.values())).state.terminal,
        timeout_s=10,
    )
    view = next(iter(views.values()))
    outcome.affected.append(
        {
            "state": "ACCEPTED" if view.state.value == "SUCCESS" else "REFUSED",
            "reason": view.reason,
            "ttf_s": time.monotonic() - started,
        }
    )
    outcome.notes["bad_shm_handle"] = {
        "intake_ok": reply.ok,
        "room": view.state.value,
        "reason": view.reason,
    }
    outcome.notes["intake_replies"] = len(replies)
    outcome.notes["http_statuses"] = sorted(set(statuses), key=str)
    outcome.expected = (
        len(replies) == len(MALFORMED_FRAMES)
        and not any(r.ok for r in replies)
        and all(s is not None and 400 <= s < 500 for s in statuses)
        and view.state.value == "FAILED"
    )
    for entry in outcome.affected:
        entry["state"] = "FAILED" if entry["state"] != "ACCEPTED" else "DONE"
    outcome.notes["serves_after"] = await serves(lab, conn, rng)
    return outcome
