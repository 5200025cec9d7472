"""Fault scenarios on processes in the middle of a request: an encode worker killed or paused
(past its write deadline) while it writes, a prefill process killed after registering its slots,
the standalone handshake killed (and an endpoint where nothing listens), and a room cancelled
while its write is held open.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from typing import TYPE_CHECKING

from epdserve.bench.faults.lab import FAST_S, FaultOutcome
from epdserve.bench.faults.scenario_steps import (
    big_images,
    new_request_id,
    one_request,
    serves,
    small_images,
    until_registered,
    until_writing,
)
from epdserve.testing.cluster import HOST, free_port

if TYPE_CHECKING:
    from epdserve.bench.faults.lab import Conn, FaultLab


async def _until_caught(
    attempt, lab: FaultLab, conn: Conn, rng: random.Random, tries: int = 3
) -> FaultOutcome:
    """Run ``attempt`` until its fault landed while a write was in flight (a write of ~10 MB takes
    tens of ms here, so a signal sent on seeing WRITING can come after the commit): every
    attempt's delivered, delivered-anyway and corrupted items count."""
    total = FaultOutcome("")
    for number in range(1, tries + 1):
        outcome = await attempt(lab, conn, rng)
        total.delivered += outcome.delivered
        total.corrupted += outcome.corrupted
        total.collateral += outcome.collateral
        total.delivered_anyway += outcome.delivered_anyway
        if outcome.notes.get("mid_transfer") or number == tries:
            outcome.delivered, outcome.corrupted, outcome.collateral = (
                total.delivered,
                total.corrupted,
                total.collateral,
            )
            outcome.delivered_anyway = total.delivered_anyway
            outcome.notes["attempts"] = number
            return outcome


async def worker_killed_mid_transfer(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """``_worker_killed_once`` until the kill lands mid-transfer."""
    return await _until_caught(_worker_killed_once, lab, conn, rng)


async def worker_paused_past_deadline(
    lab: FaultLab, conn: Conn, rng: random.Random
) -> FaultOutcome:
    """``_worker_paused_once`` until the stop lands mid-transfer."""
    return await _until_caught(_worker_paused_once, lab, conn, rng)


async def _victim_writing(lab: FaultLab, conn: Conn, rng: random.Random, request_id: str):
    """One request: two small items on worker ``a`` (the siblings) and three big ones on the victim
    worker ``v``, posted to the steady prefill process; returns once ``v`` is writing them:
    (siblings, items, the prefill request in flight, the victim rooms' views)."""
    siblings, victims = lab.describe(small_images(rng, 2)), lab.describe(big_images(rng, 3))
    items = one_request(siblings, victims)
    a, v, prefill = lab.roles["a"], lab.roles["v"], lab.roles["prefill"]
    await conn.mint(siblings, a.url)
    await conn.mint(victims, v.url)
    posted = conn.post(prefill, request_id, items)
    rooms = [item.encode_handshake.bootstrap_room for item in victims]
    await until_registered(conn, v.url, rooms)
    for item in siblings:
        await conn.send(a, item, request_id)
    for item in victims:
        await conn.send(v, item, request_id)
    return siblings, items, posted, await until_writing(conn, v.url, rooms)


async def _worker_killed_once(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """Encode worker ``v`` is SIGKILLed as soon as one of its rooms shows WRITING; the request's
    other items come from worker ``a``. Its rooms die with it: the prefill process sees the endpoint
    refuse connections and fails them, quarantining their slots (bytes may have landed)."""
    outcome = FaultOutcome("worker_killed_mid_transfer")
    siblings, items, posted, views = await _victim_writing(
        lab, conn, rng, new_request_id("kill", rng)
    )
    v = lab.roles["v"]
    killed = time.monotonic()
    lab.cluster.kill(v, signal.SIGKILL)
    outcome.notes["states_at_kill"] = sorted(view.state.value for view in views.values())
    result = await posted
    # read before the restart below: the quarantine may end while the victim starts again
    outcome.notes["quarantined_after_failure"] = (
        await asyncio.to_thread(lab.pool_stats, "prefill")
    )["quarantined"]
    affected = {index: killed for index in range(len(siblings), len(items))}
    conn.tally(outcome, result, items, affected)
    # an item committed before the kill was delivered (the kill came too late for it); the
    # others must have failed with the endpoint unreachable
    failed = [a for a in outcome.affected if a["state"] != "DONE"]
    outcome.notes["mid_transfer"] = bool(failed)
    outcome.expected = bool(failed) and all("unreachable" in (a["reason"] or "") for a in failed)
    outcome.delivered_anyway = [a for a in outcome.affected if a["state"] == "DONE"]
    outcome.affected = failed
    await asyncio.to_thread(lab.restart, "v")
    return outcome


async def _worker_paused_once(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """Encode worker ``v`` is SIGSTOPped while it writes (Mooncake), held past its write deadline,
    then resumed: its write lands late, into slots the prefill process has quarantined. Right
    after the resume, new items flow into the same pool and must arrive bit-exact."""
    outcome = FaultOutcome("worker_paused_past_deadline")
    request_id = new_request_id("stop", rng)
    siblings, items, posted, views = await _victim_writing(lab, conn, rng, request_id)
    a, v, prefill = lab.roles["a"], lab.roles["v"], lab.roles["prefill"]
    stopped = time.monotonic()
    os.kill(v.process.pid, signal.SIGSTOP)
    outcome.notes["states_at_stop"] = sorted(view.state.value for view in views.values())
    try:
        result = await asyncio.wait_for(posted, 60)
        hold = stopped + lab.config.victim_write_timeout_s + 1.0 - time.monotonic()
        if hold > 0:
            await asyncio.sleep(hold)  # past the worker's write deadline
        quarantined = lab.pool_stats("prefill")["quarantined"]
    finally:
        os.kill(v.process.pid, signal.SIGCONT)
    outcome.notes["stopped_s"] = time.monotonic() - stopped
    outcome.notes["quarantined_at_resume"] = quarantined
    # The stall is observable once the endpoint misses the answer to a long-poll slice: the
    # receiver's slice is 0.5 s, so at the latest 0.5 s after the stop.
    affected = {index: stopped for index in range(len(siblings), len(items))}
    conn.tally(outcome, result, items, affected)
    failed = [a for a in outcome.affected if a["state"] != "DONE"]
    outcome.delivered_anyway = [a for a in outcome.affected if a["state"] == "DONE"]
    outcome.affected = failed
    outcome.notes["mid_transfer"] = bool(failed)
    outcome.expected = bool(failed) and all("unreachable" in (a["reason"] or "") for a in failed)
    # the late writes land now; new tenants of the pool must not see them
    after = lab.describe(small_images(rng, 4))
    await conn.mint(after, a.url)
    posted_after = conn.post(prefill, request_id + "-after", after)
    for item in after:
        await conn.send(a, item, request_id + "-after")
    result_after = await posted_after
    conn.tally(outcome, result_after, after, {})
    # worker v resumed: it serves again (its rooms ended EXPIRED while it was stopped)
    outcome.notes["victim_serves_after_resume"] = await serves(lab, conn, rng, worker="v")
    return outcome


async def prefill_killed_after_registering(
    lab: FaultLab, conn: Conn, rng: random.Random
) -> FaultOutcome:
    """The prefill process ``pv`` registers its slots for items on workers ``a`` (SHM) and ``v``
    (Mooncake), then is SIGKILLed before the workers write. Each worker must end those rooms and
    free its send-ring slots within its write deadline, and keep serving."""
    outcome = FaultOutcome("prefill_killed_after_registering")
    # both workers have written into pv before (the Mooncake peer is known, not a first contact)
    outcome.notes["served_before"] = [
        await serves(lab, conn, rng, "a", "pv"),
        await serves(lab, conn, rng, "v", "pv"),
    ]
    request_id = new_request_id("pkill", rng)
    on_a, on_v = lab.describe(small_images(rng, 2)), lab.describe(small_images(rng, 2))
    items = one_request(on_a, on_v)
    a, v, pv = lab.roles["a"], lab.roles["v"], lab.roles["pv"]
    await conn.mint(on_a, a.url)
    await conn.mint(on_v, v.url)
    posted = conn.post(pv, request_id, items)
    await until_registered(conn, a.url, [i.encode_handshake.bootstrap_room for i in on_a])
    await until_registered(conn, v.url, [i.encode_handshake.bootstrap_room for i in on_v])
    killed = time.monotonic()
    lab.cluster.kill(pv, signal.SIGKILL)
    import aiohttp

    with contextlib.suppress(aiohttp.ClientError):
        await posted  # the connection dies with the process (anything else is raised)
    for item in on_a:
        await conn.send(a, item, request_id)
    for item in on_v:
        await conn.send(v, item, request_id)
    ends = {}
    for worker, group in (("a", on_a), ("v", on_v)):
        rooms = [i.encode_handshake.bootstrap_room for i in group]
        views = await conn.wait_rooms(
            lab.roles[worker].url,
            rooms,
            lambda vs, n=len(rooms): len(vs) == n and all(x.state.terminal for x in vs.values()),
            timeout_s=30,
        )
        ended = time.monotonic()
        for room in rooms:
            view = views[room]
            outcome.affected.append(
                {
                    "worker": worker,
                    "state": view.state.value,
                    "reason": view.reason,
                    "ttf_s": ended - killed,
                }
            )
        # the send ring frees its slots within the worker's write deadline (or at once)
        deadline = (
            lab.config.steady_write_timeout_s
            if worker == "a"
            else lab.config.victim_write_timeout_s
        )
        end = time.monotonic() + 30
        while lab.ring_occupancy(worker) > 0 and time.monotonic() < end:
            await asyncio.sleep(0.05)
        ends[worker] = {
            "ring_free_after_s": time.monotonic() - killed,
            "deadline_s": deadline,
            "ring_occupancy": lab.ring_occupancy(worker),
        }
    outcome.notes["rings"] = ends
    outcome.expected = all(
        e["ring_occupancy"] == 0 and e["ring_free_after_s"] <= e["deadline_s"] + FAST_S
        for e in ends.values()
    )
    # rooms end without a receiver: SUCCESS would mean bytes were written into a dead process's
    # memory
    outcome.notes["room_states"] = sorted(a["state"] for a in outcome.affected)
    for entry in outcome.affected:
        entry["state"] = "FAILED" if entry["state"] != "SUCCESS" else "DONE"
    await asyncio.to_thread(lab.restart, "pv")
    return outcome


async def handshake_unreachable(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """Rooms at the standalone handshake, which is SIGKILLed after the receiver registered and
    before the worker writes; one more item names an endpoint where nothing listens. Siblings
    have their rooms at worker ``a`` and must arrive."""
    outcome = FaultOutcome("handshake_unreachable")
    request_id = new_request_id("hs", rng)
    siblings, at_handshake, nowhere = (
        lab.describe(small_images(rng, 2)),
        lab.describe(small_images(rng, 2)),
        lab.describe(small_images(rng, 1)),
    )
    items = one_request(siblings, at_handshake, nowhere)
    a, prefill, hs = lab.roles["a"], lab.roles["prefill"], lab.roles["handshake"]
    await conn.mint(siblings, a.url)
    await conn.mint(at_handshake, hs.url)
    from epdserve.wire.addresses import EncodeHandshake

    dead_port = free_port()  # nothing listens there
    nowhere[0].encode_handshake = EncodeHandshake(
        bootstrap_room=rng.randrange(1, 1 << 62), bootstrap_host=HOST, bootstrap_port=dead_port
    )
    posted_at = time.monotonic()
    posted = conn.post(prefill, request_id, items)
    await until_registered(conn, hs.url, [i.encode_handshake.bootstrap_room for i in at_handshake])
    killed = time.monotonic()
    lab.cluster.kill(hs, signal.SIGKILL)
    for item in siblings + at_handshake + nowhere:
        await conn.send(a, item, request_id)
    result = await posted
    affected = {index: killed for index in range(2, 4)}
    affected[4] = posted_at  # unreachable from the start
    conn.tally(outcome, result, items, affected, expect_reason="unreachable")
    end = time.monotonic() + 30
    while lab.ring_occupancy("a") > 0 and time.monotonic() < end:
        await asyncio.sleep(0.05)
    outcome.notes["worker_ring_free_after_s"] = time.monotonic() - killed
    await asyncio.to_thread(lab.restart, "handshake")
    return outcome


async def cancel_during_write(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """A room is cancelled (REST, as a gateway or an engine's ``job.cancel`` does) while worker
    ``v`` writes into ``pv`` over Mooncake. To hold the write open, ``pv`` is paused (SIGSTOP)
    before the write begins and resumed after the cancel: the room must stay WRITING with the
    cancel recorded, then end CANCELLED once the writer reports, and the slot be freed, not
    leased."""
    from epdserve.wire.rooms import RoomState

    outcome = FaultOutcome("cancel_during_write")
    request_id = new_request_id("cancel", rng)
    items = lab.describe(small_images(rng, 2))
    v, pv = lab.roles["v"], lab.roles["pv"]
    await conn.mint(items, v.url)
    posted = conn.post(pv, request_id, items)
    sibling, victim = items
    rooms = [i.encode_handshake.bootstrap_room for i in items]
    await until_registered(conn, v.url, rooms)
    await conn.send(v, sibling, request_id)
    await conn.wait_rooms(v.url, rooms[:1], lambda vs: bool(vs) and vs[rooms[0]].state.terminal)
    os.kill(pv.process.pid, signal.SIGSTOP)
    try:
        await conn.send(v, victim, request_id)
        views = await conn.wait_rooms(
            v.url,
            rooms[1:],
            lambda vs: bool(vs) and vs[rooms[1]].state is not RoomState.REGISTERED,
            timeout_s=20,
        )
        outcome.notes["state_before_cancel"] = views[rooms[1]].state.value
        if views[rooms[1]].state.terminal:  # the write ended before the cancel could be sent
            outcome.not_applicable = f"the write ended ({views[rooms[1]].state.value}) first"
            return outcome
        (result,) = await conn.rooms(v.url).cancel([rooms[1]], "cancelled by the fault test")
        outcome.notes["state_after_cancel"] = result.view.state.value
        outcome.notes["cancel_requested"] = result.view.cancel_requested
        await asyncio.sleep(0.3)
        (held,) = await conn.rooms(v.url).watch({rooms[1]: 0})
        outcome.notes["state_while_held"] = held.view.state.value
    finally:
        resumed = time.monotonic()
        os.kill(pv.process.pid, signal.SIGCONT)
        if outcome.not_applicable is not None:  # both items are ordinary deliveries
            conn.tally(outcome, await posted, items, {})
    result = await posted
    conn.tally(outcome, result, items, {1: resumed}, expect_reason="CANCELLED")
    outcome.expected = (
        outcome.expected
        and outcome.notes["state_while_held"] == "WRITING"
        and outcome.notes["cancel_requested"] is True
    )
    return outcome
