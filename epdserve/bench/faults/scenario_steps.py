"""What the fault scenarios share: ordinary and big synthetic images, waits for rooms to be
registered or written, request ids, several ``describe`` groups as one request, and ``serves``,
the check that a role still serves after a fault.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from epdserve.testing.images import synthetic_image

if TYPE_CHECKING:
    from epdserve.bench.faults.lab import Conn, FaultLab
    from epdserve.testing.cluster import Role


def small_images(rng: random.Random, count: int) -> list[bytes]:
    """Ordinary items: 224..448 px (64..256 rows, 0.5..2 MB of fp32 rows at the lab's width)."""
    sides = (224, 280, 336, 392, 448)
    return [
        synthetic_image(rng.choice(sides), rng.choice(sides), rng.randrange(1 << 30))
        for _ in range(count)
    ]


def big_images(rng: random.Random, count: int) -> list[bytes]:
    """Items whose write takes long enough to be caught in flight: ~1M pixels, ~10 MB of rows."""
    return [synthetic_image(1000, 1000, rng.randrange(1 << 30), "JPEG") for _ in range(count)]


async def until_writing(conn: Conn, url: str, rooms: list[int], timeout_s: float = 30.0) -> dict:
    """Wait until any of ``rooms`` is WRITING (or all are past it); the views."""
    from epdserve.wire.rooms import RoomState

    return await conn.wait_rooms(
        url,
        rooms,
        lambda views: (
            any(v.state is RoomState.WRITING for v in views.values())
            or (len(views) == len(rooms) and all(v.state.terminal for v in views.values()))
        ),
        timeout_s,
    )


async def until_registered(conn: Conn, url: str, rooms: list[int], timeout_s: float = 30.0) -> dict:
    from epdserve.wire.rooms import RoomState

    return await conn.wait_rooms(
        url,
        rooms,
        lambda views: (
            len(views) == len(rooms)
            and all(v.state is not RoomState.PENDING for v in views.values())
        ),
        timeout_s,
    )


def new_request_id(kind: str, rng: random.Random) -> str:
    return f"{kind}-{rng.randrange(1 << 40):x}"


def one_request(*groups) -> list:
    """The items of several ``describe`` calls (each numbered from 0) as one request, numbered in
    order."""
    items = [item for group in groups for item in group]
    for index, item in enumerate(items):
        item.index = index
    return items


async def serves(
    lab: FaultLab,
    conn: Conn,
    rng: random.Random,
    worker: str | Role = "a",
    prefill: str | Role = "prefill",
    transport: str | None = None,
) -> bool:
    """A normal two-item request through ``worker`` into ``prefill`` arrives bit-exact (over
    ``transport``, if given)."""
    items = lab.describe(small_images(rng, 2))
    role = lab.roles[worker] if isinstance(worker, str) else worker
    prefill = lab.roles[prefill] if isinstance(prefill, str) else prefill
    await conn.mint(items, role.url)
    request_id = new_request_id(f"serves-{role.name}", rng)
    posted = conn.post(prefill, request_id, items)
    for item in items:
        await conn.send(role, item, request_id)
    result = await posted
    ok = all(
        row["state"] == "DONE"
        and row["checksum"] == lab.reference(item.data)
        and (transport is None or row["transport"] == transport)
        for row, item in zip(result.report["items"], items)
    )
    if not ok:
        lab.serve_failures.append(
            {"worker": role.name, "prefill": prefill.name, "items": result.report["items"]}
        )
    return ok
