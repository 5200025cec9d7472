"""Fault scenarios on requests that break the contract between dispatcher, worker and receiver: a
room used twice (at one worker's intake, within one request, by two receivers), an item larger
than the whole receive pool, placeholders one row short, and a receiver whose row layout (width
or dtype) differs from the worker's tower.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING

from epdserve.bench.faults.lab import WIDTH, FaultOutcome
from epdserve.bench.faults.scenario_steps import new_request_id, small_images, until_registered
from epdserve.testing.images import synthetic_image

if TYPE_CHECKING:
    from epdserve.bench.faults.lab import Conn, FaultLab


async def duplicate_room_at_intake(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """The same room sent twice to worker ``a``'s intake, the second time with another image of
    the same size (a buggy or hostile dispatcher): the second message is refused while the first
    is in flight, and the receiver gets the first image's rows, bit-exact."""
    outcome = FaultOutcome("duplicate_room_at_intake")
    request_id = new_request_id("dup", rng)
    a, prefill = lab.roles["a"], lab.roles["prefill"]
    side = rng.choice((224, 336, 448))
    original, impostor = lab.describe(
        [synthetic_image(side, side, rng.randrange(1 << 30)) for _ in range(2)]
    )
    original.index = 0
    await conn.mint([original], a.url)
    impostor.encode_handshake = original.encode_handshake
    first = await conn.send(a, original, request_id)
    started = time.monotonic()
    second = await conn.send(a, impostor, request_id + "-again")
    outcome.affected.append(
        {
            "state": "FAILED" if not second.ok else "DONE",
            "reason": second.reason,
            "ttf_s": time.monotonic() - started,
        }
    )
    outcome.notes["intake"] = [first.model_dump(mode="json"), second.model_dump(mode="json")]
    posted = await conn.post(prefill, request_id, [original])
    conn.tally(outcome, posted, [original], {})
    outcome.expected = first.ok and not second.ok and outcome.delivered == 1
    return outcome


async def duplicate_room_in_one_request(
    lab: FaultLab, conn: Conn, rng: random.Random
) -> FaultOutcome:
    """One request names one room for two items: the second item is refused at once (no slot is
    reserved for it), the first arrives bit-exact, and no slot is left leased."""
    outcome = FaultOutcome("duplicate_room_in_one_request")
    request_id = new_request_id("twins", rng)
    a, prefill = lab.roles["a"], lab.roles["prefill"]
    (first,) = lab.describe(small_images(rng, 1))
    (second,) = lab.describe([first.data])
    first.index, second.index = 0, 1
    await conn.mint([first], a.url)
    second.encode_handshake = first.encode_handshake
    posted = conn.post(prefill, request_id, [first, second])
    await conn.send(a, first, request_id)
    result = await posted
    conn.tally(outcome, result, [first, second], {1: result.sent}, expect_reason="duplicate")
    outcome.expected = outcome.expected and result.row(0)["state"] == "DONE"
    return outcome


async def duplicate_room_two_receivers(
    lab: FaultLab, conn: Conn, rng: random.Random
) -> FaultOutcome:
    """Two requests (in two prefill processes) register the same room: the later registration is
    refused at once and its slot released; the first receiver gets the item bit-exact."""
    outcome = FaultOutcome("duplicate_room_two_receivers")
    request_id = new_request_id("shared", rng)
    a = lab.roles["a"]
    shared = lab.describe(small_images(rng, 1))
    shared[0].index = 0
    await conn.mint(shared, a.url)
    first_post = conn.post(lab.roles["prefill"], request_id + "-r1", shared)
    await until_registered(conn, a.url, [shared[0].encode_handshake.bootstrap_room])
    second = await conn.post(lab.roles["pv"], request_id + "-r2", shared)
    await conn.send(a, shared[0], request_id + "-r1")
    first = await first_post
    conn.tally(outcome, first, shared, {})
    conn.tally(outcome, second, shared, {0: second.sent}, expect_reason="different receiver")
    outcome.expected = outcome.expected and first.row(0)["state"] == "DONE"
    return outcome


async def duplicate_room(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """The three duplicate-room faults in a row, as one soak event."""
    outcome = FaultOutcome("duplicate_room")
    for part in (
        duplicate_room_at_intake,
        duplicate_room_in_one_request,
        duplicate_room_two_receivers,
    ):
        result = await part(lab, conn, rng)
        outcome.affected += result.affected
        outcome.delivered += result.delivered
        outcome.corrupted += result.corrupted
        outcome.collateral += result.collateral
        outcome.expected = outcome.expected and result.expected
        outcome.notes[part.__name__] = result.notes
    return outcome


async def item_too_large(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """An item whose placeholders claim more rows than the whole receive pool holds: refused at
    once, its room cancelled so the worker drops it; its sibling arrives."""
    outcome = FaultOutcome("item_too_large")
    request_id = new_request_id("big", rng)
    items = lab.describe(small_images(rng, 2))
    a, prefill = lab.roles["a"], lab.roles["prefill"]
    await conn.mint(items, a.url)
    huge_rows = lab.config.pool_bytes // (WIDTH * 4) + 1

    def claim_huge(body):
        start = body["items"][1]["offsets"][0][0]
        body["items"][1]["offsets"] = [[start, start + huge_rows - 1]]
        body["items"][1]["grid_thw"] = None

    posted = conn.post(prefill, request_id, items, body_edit=claim_huge)
    for item in items:
        await conn.send(a, item, request_id)
    result = await posted
    conn.tally(outcome, result, items, {1: result.sent}, expect_reason="cannot reserve")
    from epdserve.wire.rooms import RoomState

    views = await conn.wait_rooms(
        a.url,
        [items[1].encode_handshake.bootstrap_room],
        lambda vs: bool(vs) and next(iter(vs.values())).state.terminal,
        timeout_s=10,
    )
    outcome.notes["room_state"] = next(iter(views.values())).state.value
    outcome.expected = outcome.expected and outcome.notes["room_state"] == RoomState.CANCELLED.value
    return outcome


async def rows_mismatch(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """The request places one placeholder fewer than the encoder produces rows for an item: the
    worker refuses to write (the contract is checked before any byte moves) and fails the room
    with the reason; the sibling arrives."""
    outcome = FaultOutcome("rows_mismatch")
    request_id = new_request_id("rows", rng)
    items = lab.describe(small_images(rng, 2))
    a, prefill = lab.roles["a"], lab.roles["prefill"]
    await conn.mint(items, a.url)

    def one_short(body):
        start, end = body["items"][1]["offsets"][0]
        body["items"][1]["offsets"] = [[start, end - 1]]
        body["items"][1]["grid_thw"] = None

    posted = conn.post(prefill, request_id, items, body_edit=one_short)
    for item in items:
        await conn.send(a, item, request_id)
    result = await posted
    conn.tally(outcome, result, items, {1: result.sent}, expect_reason="contract mismatch")
    return outcome


async def layout_mismatch(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """A receiver whose width or dtype differs from worker ``a``'s tower (the receiver library in
    this process, as an engine embeds it, over SHM): the worker refuses to write and the item fails
    fast with both layouts in the reason; the receiver's slot is released."""
    from epdserve.multimodal.items import MultimodalDataItem, MultimodalInputs
    from epdserve.wire.modality import Modality
    from prefill_side import PrefillReceiver, ReceiverConfig

    width, dtype = rng.choice([(WIDTH - 8, "float32"), (WIDTH, "bfloat16"), (WIDTH * 2, "float32")])
    outcome = FaultOutcome("layout_mismatch", notes={"receiver": [width, dtype]})
    receiver = PrefillReceiver(
        ReceiverConfig(
            width=width,
            dtype=dtype,
            pool_bytes=16 << 20,
            slot_bytes=1 << 18,
            transports=("shm",),
            item_timeout_s=10,
        )
    )
    try:
        (item,) = lab.describe(small_images(rng, 1))
        await conn.mint([item], lab.roles["a"].url)
        mm = MultimodalDataItem(
            Modality.IMAGE,
            offsets=[[0, item.rows - 1]],
            encode_handshake=item.encode_handshake.model_dump(),
        )
        job = receiver.start(new_request_id("layout", rng), MultimodalInputs([mm]))
        await conn.send(lab.roles["a"], item, "layout")
        await asyncio.wrap_future(job.future)
        failed_at = job.started + job.outcomes[0].seconds
        # the mismatch is observable once the encoder has the rows: when the worker's room failed
        reason = job.reasons.get(0)
        outcome.affected.append(
            {
                "state": job.outcomes[0].state,
                "reason": reason,
                "ttf_s": max(0.0, failed_at - job.started) if reason else None,
            }
        )
        outcome.notes["pool"] = receiver.pool.stats()
        outcome.expected = (
            reason is not None
            and "contract mismatch" in reason
            and receiver.pool.stats()["leased_slots"] == 0
        )
    finally:
        receiver.close()
    return outcome
