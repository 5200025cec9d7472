"""Faults injected into real processes: the scenarios behind ``tests/test_faults.py`` and
``epd-bench soak``.

A ``FaultLab`` runs every role as its own process (``bench.cluster.LocalCluster``):

* steady roles, which must keep serving through every fault: a standalone handshake
  (``handshake``), encode worker ``a`` (SHM and Mooncake), optionally encode worker ``b``
  (Mooncake only: the soak's Mooncake traffic), and the prefill process ``prefill``
  (`epd-prefill`, SHM and Mooncake);
* victims, which faults are injected into and which are restarted afterwards: encode worker ``v``
  (Mooncake only, short write deadline) and the prefill process ``pv``.

Each scenario is a coroutine ``scenario(lab, conn, rng) -> FaultOutcome``: it sets up real items
(synthetic images through the real intake, rooms and receiver), injects one fault, and measures what
happened: the affected rooms' outcome, reason and time from the moment the fault became observable
to their failure in the prefill process, and whether every other item in flight arrived bit-exact
(checked against reference rows from this process's own tower). Leaks (slots, SHM segments) and
"still serving" are checked by the caller with ``lab.pool_stats`` / ``lab.ring_occupancy`` /
``lab.shm_segments`` / ``serves``.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import random
import shutil
import signal
import socket
import time
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.cluster import HOST, LocalCluster, Role, free_port
from bench.images import synthetic_image

if TYPE_CHECKING:
    from wire.intake import IntakeReply

FAST_S = 2.0  # the bound: an affected room fails within this of the fault being observable
WIDTH = 2048  # the lab tower's output width: a 1M-pixel image is ~10 MB of fp32 rows


def lab_model(directory: str) -> str:
    """The lab's checkpoint: a small real Qwen2.5-VL tower with 2048-wide rows."""
    from vision.small_checkpoints import build_vision_only

    if not os.path.exists(os.path.join(directory, "config.json")):
        build_vision_only("qwen2_5_vl", directory, out_width=WIDTH)
    return directory


@dataclass
class LabConfig:
    model: str
    dtype: str = "float32"
    steady_mooncake_worker: bool = False  # worker ``b``: Mooncake-only steady traffic (the soak)
    pool_bytes: int = 512 << 20
    victim_pool_bytes: int = 96 << 20
    slot_bytes: int = 256 << 10
    quarantine_s: float = (
        8.0  # above the workers' Mooncake transfer timeout (5 s, its minimum) + 1 s
    )
    steady_write_timeout_s: float = 5.0
    victim_write_timeout_s: float = 2.0
    item_timeout_s: float = 20.0
    log_dir: str | None = None


@dataclass
class FaultOutcome:
    kind: str
    affected: list[dict] = field(default_factory=list)  # per affected item: state, reason, ttf_s
    # items the fault was aimed at that arrived all the same (it came after their commit): DONE
    # entries kept out of ``affected`` by scenarios whose affected items must all fail
    delivered_anyway: list[dict] = field(default_factory=list)
    delivered: int = 0  # items (affected or not) that arrived bit-exact
    corrupted: int = 0  # items that arrived with bytes other than the reference's
    collateral: int = 0  # unaffected items that failed
    expected: bool = True  # the scenario's own expectation held (reason, order of events)
    notes: dict = field(default_factory=dict)

    @property
    def ttf_s(self) -> float | None:
        times = [a["ttf_s"] for a in self.affected if a.get("ttf_s") is not None]
        return max(times) if times else None

    @property
    def failed_fast(self) -> bool:
        return all(
            a["state"] != "DONE" and a.get("ttf_s") is not None and a["ttf_s"] <= FAST_S
            for a in self.affected
        )

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "affected": self.affected,
            "delivered_anyway": self.delivered_anyway,
            "delivered": self.delivered,
            "corrupted": self.corrupted,
            "collateral": self.collateral,
            "expected": self.expected,
            "ttf_s": self.ttf_s,
            "failed_fast": self.failed_fast,
            "notes": self.notes,
        }


@dataclass
class Posted:
    sent: float
    returned: float
    status: int
    report: dict

    def row(self, index: int) -> dict:
        return self.report["items"][index]

    def failed_at(self, index: int) -> float:
        """When the prefill process settled item ``index``, on this host's monotonic clock (which
        the prefill process shares: it reports its job's start on it)."""
        return (self.report.get("started_monotonic") or self.sent) + self.row(index)["seconds"]


def shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/epd-*"))


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in response.read().decode().splitlines()
            if line.startswith(name + " ") or line.startswith(name + "{")
        )


class FaultLab:
    def __init__(self, config: LabConfig):
        self.config = config
        self.cluster = LocalCluster(config.model, config.dtype, config.log_dir)
        self.roles: dict[str, Role] = {}
        self.restarts: dict[str, int] = {}
        self.pids: set[int] = set()  # every process the lab started, dead or alive
        self.serve_failures: list[
            dict
        ] = []  # what a failed `serves` check received, for the report
        self._references: dict[int, int] = {}
        self.tower = None
        self.processor = None

    # ---- processes -------------------------------------------------------------------------

    def _start(self, name: str) -> Role:
        c = self.config
        worker_common = ("--receiver-wait-s", "10", "--cache-bytes", str(64 << 20))
        if name == "handshake":
            role = self.cluster.start_handshake("handshake")
        elif name == "a":
            role = self.cluster.start_encode_worker(
                "worker-a",
                transports="shm,mooncake",
                extra=(
                    *worker_common,
                    "--ring-bytes",
                    str(64 << 20),
                    "--write-timeout-s",
                    str(c.steady_write_timeout_s),
                ),
            )
        elif name == "b":
            role = self.cluster.start_encode_worker(
                "worker-b",
                transports="mooncake",
                extra=(
                    *worker_common,
                    "--ring-bytes",
                    str(64 << 20),
                    "--write-timeout-s",
                    str(c.steady_write_timeout_s),
                ),
            )
        elif name == "v":
            role = self.cluster.start_encode_worker(
                "worker-v",
                transports="mooncake",
                extra=(
                    *worker_common,
                    "--ring-bytes",
                    str(64 << 20),
                    "--write-timeout-s",
                    str(c.victim_write_timeout_s),
                ),
            )
        elif name in ("prefill", "pv"):
            role = self.cluster.start_prefill(
                "prefill" if name == "prefill" else "prefill-v",
                transports="shm,mooncake",
                pool_bytes=c.pool_bytes if name == "prefill" else c.victim_pool_bytes,
                extra=(
                    "--slot-bytes",
                    str(c.slot_bytes),
                    "--quarantine-s",
                    str(c.quarantine_s),
                    "--item-timeout-s",
                    str(c.item_timeout_s),
                ),
            )
        else:
            raise ValueError(name)
        self.roles[name] = self.track(role)
        return role

    def track(self, role: Role) -> Role:
        self.pids.add(role.process.pid)
        return role

    def orphan_segments(self) -> set[str]:
        """/dev/shm segments created by a process of the lab that is no longer alive (segment names
        carry their creator's pid: ``epd-<kind>-<pid>-<random>``)."""
        live = {role.process.pid for role in self.cluster.roles if role.alive()}
        orphans = set()
        for path in shm_segments():
            parts = os.path.basename(path).split("-")
            if len(parts) >= 4 and parts[2].isdigit() and int(parts[2]) in self.pids - live:
                orphans.add(path)
        return orphans

    def start(self) -> FaultLab:
        from transformers import AutoImageProcessor

        from vision.tower import VisionTower

        names = ["handshake", "a", "v", "prefill", "pv"] + (
            ["b"] if self.config.steady_mooncake_worker else []
        )
        for name in names:
            self._start(name)
        self.tower = VisionTower.load(
            self.config.model, dtype=self.config.dtype
        )  # while they start
        self.processor = AutoImageProcessor.from_pretrained(self.config.model)
        self.cluster.wait_ready(180)
        return self

    def restart(self, name: str) -> Role:
        """A fresh process for a role that was killed (new ports, as a replacement pod would
        have)."""
        old = self.roles[name]
        if old.alive():
            self.cluster.kill(old)
        self.cluster.roles.remove(old)
        role = self._start(name)
        self.cluster.wait_ready(120)
        self.restarts[name] = self.restarts.get(name, 0) + 1
        return role

    def stop(self) -> dict[str, int]:
        return self.cluster.stop()

    def __enter__(self) -> FaultLab:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- observation -----------------------------------------------------------------------

    def pool_stats(self, name: str = "prefill") -> dict[str, float]:
        url = self.roles[name].url
        return {
            "leased": _metric(url, "epd_prefill_pool_leased_slots"),
            "quarantined": _metric(url, "epd_prefill_pool_quarantined_slots"),
        }

    def ring_occupancy(self, name: str) -> float:
        return _metric(self.roles[name].url, "epd_encoder_ring_occupancy")

    def rss(self, name: str) -> dict[str, int]:
        """Resident memory of a role's process (kB): total, anonymous, shared-memory mappings."""
        fields = {}
        with open(f"/proc/{self.roles[name].process.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssShmem", "RssFile"):
                    fields[key] = int(value.split()[0])
        return fields

    # ---- items -----------------------------------------------------------------------------

    def describe(self, images: list[bytes]):
        from dispatcher.dispatch import Dispatcher

        return Dispatcher(None, self.processor).describe(images)

    def reference(self, image: bytes) -> int:
        """xxh3-64 of the rows this process's own tower produces for ``image`` (alone)."""
        from data_plane.commit import checksum
        from multimodal.hashing import hash_feature

        key = hash_feature(image)
        if key not in self._references:
            from vision.images import image_from_bytes

            inputs = self.tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
            (rows,) = self.tower.encode_items(inputs["pixel_values"], inputs["image_grid_thw"])
            self._references[key] = checksum(rows.to(self.tower.dtype).contiguous())
        return self._references[key]

    def connect(self) -> Conn:
        return Conn(self)


class Conn:
    """Clients for one event loop: aiohttp, handshake clients and intake sockets per role."""

    def __init__(self, lab: FaultLab):
        self.lab = lab
        self._session = None
        self._rooms: dict[str, object] = {}
        self._intakes: dict[tuple, object] = {}

    async def __aenter__(self) -> Conn:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for client in self._rooms.values():
            await client.close()
        for intake in self._intakes.values():
            intake.close()
        self._rooms.clear()
        self._intakes.clear()
        if self._session is not None:
            await self._session.close()

    def rooms(self, url: str):
        from handshake.client import HandshakeClient

        client = self._rooms.get(url)
        if client is None:
            client = self._rooms[url] = HandshakeClient(url, timeout_s=5.0, retries=2)
        return client

    def intake(self, role: Role):
        from wire.intake import AsyncIntakeClient

        key = (role.name, role.process.pid)
        intake = self._intakes.get(key)
        if intake is None:
            intake = self._intakes[key] = AsyncIntakeClient(
                role.worker.intake_endpoint, timeout_s=10
            )
        return intake

    # ---- the steps of a request ------------------------------------------------------------

    async def mint(self, items, rooms_url: str) -> None:
        """One room per item at ``rooms_url`` (a worker's bootstrap URL or the standalone
        handshake)."""
        from wire.addresses import EncodeHandshake

        host, port = rooms_url.rsplit("/", 1)[-1].rsplit(":", 1)
        rooms = await self.rooms(rooms_url).mint(len(items), 120)
        for item, room in zip(items, rooms):
            item.encode_handshake = EncodeHandshake(
                bootstrap_room=room, bootstrap_host=host, bootstrap_port=int(port)
            )

    async def send(self, worker: Role, item, request_id: str) -> IntakeReply:
        from wire.intake import IntakeRequest

        request = IntakeRequest(
            request_id=f"{request_id}.{item.index}",
            content_hash=item.content_hash,
            encode_handshake=item.encode_handshake,
            source="bytes",
        )
        return await self.intake(worker).send(request, item.data)

    def post(
        self, prefill: Role, request_id: str, items, timeout_s: float = 60.0, body_edit=None
    ) -> asyncio.Task:
        """POST /v1/prefill for ``items`` (as a task: faults are injected while it runs)."""
        from dispatcher.cli import prefill_body

        body = prefill_body(request_id, items, verify=False)
        body["timeout_s"] = timeout_s
        if body_edit is not None:
            body_edit(body)

        async def run() -> Posted:
            sent = time.monotonic()
            async with self._session.post(prefill.url + "/v1/prefill", json=body) as response:
                status = response.status
                report = await response.json(content_type=None)
            return Posted(sent, time.monotonic(), status, report)

        return asyncio.ensure_future(run())

    async def wait_rooms(
        self, url: str, rooms: list[int], until, timeout_s: float = 30.0
    ) -> dict[int, object]:
        """Long-poll ``rooms`` at ``url`` until ``until(views)`` holds, or every room is terminal
        (views by room); the views. ``TimeoutError`` if neither happens within ``timeout_s``."""
        from wire.rooms import RoomState

        client = self.rooms(url)
        versions = dict.fromkeys(rooms, 0)
        views: dict[int, object] = {}
        end = time.monotonic() + timeout_s
        while True:
            results = await client.watch(
                versions, wait_s=max(0.01, min(2.0, end - time.monotonic()))
            )
            for result in results:
                if result.ok:
                    views[result.room] = result.view
                    versions[result.room] = result.view.version
            if until(views):
                return views
            if all(
                v.state is not RoomState.PENDING and v.state.terminal for v in views.values()
            ) and len(views) == len(rooms):
                return views
            if time.monotonic() >= end:
                raise TimeoutError(
                    f"rooms at {url} not as awaited within {timeout_s} s: "
                    f"{ {room: view.state.value for room, view in views.items()} }"
                )

    def tally(
        self,
        outcome: FaultOutcome,
        posted: Posted,
        items,
        affected: dict[int, float],
        expect_reason: str | None = None,
    ) -> FaultOutcome:
        """Fill ``outcome`` from a prefill report: ``affected`` maps item index -> the moment its
        fault became observable; every other item must arrive bit-exact."""
        for index, item in enumerate(items):
            row = posted.row(index)
            if row["state"] == "DONE":
                if row["checksum"] == self.lab.reference(item.data):
                    outcome.delivered += 1
                else:
                    outcome.corrupted += 1
            elif index not in affected:
                outcome.collateral += 1
                outcome.notes.setdefault("collateral_reasons", []).append(row["reason"])
            if index in affected:
                ttf = posted.failed_at(index) - affected[index] if row["state"] != "DONE" else None
                outcome.affected.append(
                    {"index": index, "state": row["state"], "reason": row["reason"], "ttf_s": ttf}
                )
                if (
                    expect_reason is not None
                    and row["state"] != "DONE"
                    and expect_reason not in (row["reason"] or "")
                ):
                    outcome.expected = False
        return outcome


# ---- images ---------------------------------------------------------------------------------


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


async def _writing(conn: Conn, url: str, rooms: list[int], timeout_s: float = 30.0) -> dict:
    """Wait until any of ``rooms`` is WRITING (or all are past it); the views."""
    from wire.rooms import RoomState

    return await conn.wait_rooms(
        url,
        rooms,
        lambda views: (
            any(v.state is RoomState.WRITING for v in views.values())
            or (len(views) == len(rooms) and all(v.state.terminal for v in views.values()))
        ),
        timeout_s,
    )


async def _registered(conn: Conn, url: str, rooms: list[int], timeout_s: float = 30.0) -> dict:
    from wire.rooms import RoomState

    return await conn.wait_rooms(
        url,
        rooms,
        lambda views: (
            len(views) == len(rooms)
            and all(v.state is not RoomState.PENDING for v in views.values())
        ),
        timeout_s,
    )


def _request_id(kind: str, rng: random.Random) -> str:
    return f"{kind}-{rng.randrange(1 << 40):x}"


# ---- scenarios ------------------------------------------------------------------------------


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


def _one_request(*groups) -> list:
    """The items of several ``describe`` calls (each numbered from 0) as one request, numbered in
    order."""
    items = [item for group in groups for item in group]
    for index, item in enumerate(items):
        item.index = index
    return items


async def _victim_writing(lab: FaultLab, conn: Conn, rng: random.Random, request_id: str):
    """One request: two small items on worker ``a`` (the siblings) and three big ones on the victim
    worker ``v``, posted to the steady prefill process; returns once ``v`` is writing them:
    (siblings, items, the prefill request in flight, the victim rooms' views)."""
    siblings, victims = lab.describe(small_images(rng, 2)), lab.describe(big_images(rng, 3))
    items = _one_request(siblings, victims)
    a, v, prefill = lab.roles["a"], lab.roles["v"], lab.roles["prefill"]
    await conn.mint(siblings, a.url)
    await conn.mint(victims, v.url)
    posted = conn.post(prefill, request_id, items)
    rooms = [item.encode_handshake.bootstrap_room for item in victims]
    await _registered(conn, v.url, rooms)
    for item in siblings:
        await conn.send(a, item, request_id)
    for item in victims:
        await conn.send(v, item, request_id)
    return siblings, items, posted, await _writing(conn, v.url, rooms)


async def _worker_killed_once(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """Encode worker ``v`` is SIGKILLed as soon as one of its rooms shows WRITING; the request's
    other items come from worker ``a``. Its rooms die with it: the prefill process sees the endpoint
    refuse connections and fails them, quarantining their slots (bytes may have landed)."""
    outcome = FaultOutcome("worker_killed_mid_transfer")
    siblings, items, posted, views = await _victim_writing(lab, conn, rng, _request_id("kill", rng))
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
    request_id = _request_id("stop", rng)
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
    request_id = _request_id("pkill", rng)
    on_a, on_v = lab.describe(small_images(rng, 2)), lab.describe(small_images(rng, 2))
    items = _one_request(on_a, on_v)
    a, v, pv = lab.roles["a"], lab.roles["v"], lab.roles["pv"]
    await conn.mint(on_a, a.url)
    await conn.mint(on_v, v.url)
    posted = conn.post(pv, request_id, items)
    await _registered(conn, a.url, [i.encode_handshake.bootstrap_room for i in on_a])
    await _registered(conn, v.url, [i.encode_handshake.bootstrap_room for i in on_v])
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
    request_id = _request_id("hs", rng)
    siblings, at_handshake, nowhere = (
        lab.describe(small_images(rng, 2)),
        lab.describe(small_images(rng, 2)),
        lab.describe(small_images(rng, 1)),
    )
    items = _one_request(siblings, at_handshake, nowhere)
    a, prefill, hs = lab.roles["a"], lab.roles["prefill"], lab.roles["handshake"]
    await conn.mint(siblings, a.url)
    await conn.mint(at_handshake, hs.url)
    from wire.addresses import EncodeHandshake

    dead_port = free_port()  # nothing listens there
    nowhere[0].encode_handshake = EncodeHandshake(
        bootstrap_room=rng.randrange(1, 1 << 62), bootstrap_host=HOST, bootstrap_port=dead_port
    )
    posted_at = time.monotonic()
    posted = conn.post(prefill, request_id, items)
    await _registered(conn, hs.url, [i.encode_handshake.bootstrap_room for i in at_handshake])
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
    from wire.rooms import RoomState

    outcome = FaultOutcome("cancel_during_write")
    request_id = _request_id("cancel", rng)
    items = lab.describe(small_images(rng, 2))
    v, pv = lab.roles["v"], lab.roles["pv"]
    await conn.mint(items, v.url)
    posted = conn.post(pv, request_id, items)
    sibling, victim = items
    rooms = [i.encode_handshake.bootstrap_room for i in items]
    await _registered(conn, v.url, rooms)
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
        (result,) = await conn.rooms(v.url).cancel([rooms[1]], "cancelled by the fault test")
        outcome.notes["state_after_cancel"] = result.view.state.value
        outcome.notes["cancel_requested"] = result.view.cancel_requested
        await asyncio.sleep(0.3)
        (held,) = await conn.rooms(v.url).watch({rooms[1]: 0})
        outcome.notes["state_while_held"] = held.view.state.value
    finally:
        resumed = time.monotonic()
        os.kill(pv.process.pid, signal.SIGCONT)
    result = await posted
    conn.tally(outcome, result, items, {1: resumed}, expect_reason="CANCELLED")
    outcome.expected = (
        outcome.expected
        and outcome.notes["state_while_held"] == "WRITING"
        and outcome.notes["cancel_requested"] is True
    )
    return outcome


async def duplicate_room_at_intake(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """The same room sent twice to worker ``a``'s intake, the second time with another image of
    the same size (a buggy or hostile dispatcher): the second message is refused while the first
    is in flight, and the receiver gets the first image's rows, bit-exact."""
    outcome = FaultOutcome("duplicate_room_at_intake")
    request_id = _request_id("dup", rng)
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
    request_id = _request_id("twins", rng)
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
    request_id = _request_id("shared", rng)
    a = lab.roles["a"]
    shared = lab.describe(small_images(rng, 1))
    shared[0].index = 0
    await conn.mint(shared, a.url)
    first_post = conn.post(lab.roles["prefill"], request_id + "-r1", shared)
    await _registered(conn, a.url, [shared[0].encode_handshake.bootstrap_room])
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
    request_id = _request_id("big", rng)
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
    from wire.rooms import RoomState

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
    request_id = _request_id("rows", rng)
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
    from multimodal.items import MultimodalDataItem, MultimodalInputs
    from prefill_side import PrefillReceiver, ReceiverConfig
    from wire.modality import Modality

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
        job = receiver.start(_request_id("layout", rng), MultimodalInputs([mm]))
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

    from wire.intake import IntakeReply

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
    from wire.intake import IntakeRequest

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
    request_id = _request_id(f"serves-{role.name}", rng)
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


# ---- start-up faults: processes of their own --------------------------------------------------


def start_with_small_dev_shm(
    lab: FaultLab, name: str, transports: str, shm_bytes: int = 8 << 20
) -> Role:
    """An epd-prefill in a private mount namespace whose /dev/shm is a ``shm_bytes`` tmpfs, smaller
    than its pool: creating the pool gets a real ENOSPC from posix_fallocate."""
    if shutil.which("unshare") is None:
        raise RuntimeError("unshare(1) is not installed")
    prefix = (
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount -t tmpfs -o size={shm_bytes} tmpfs /dev/shm && exec "$@"',
        "sh",
    )
    return lab.track(
        lab.cluster.start_prefill(
            name,
            transports=transports,
            pool_bytes=32 << 20,
            extra=("--slot-bytes", str(lab.config.slot_bytes)),
            prefix=prefix,
        )
    )


@contextlib.contextmanager
def mooncake_ports_taken():
    """Every port Mooncake may use is held by another socket: ``initialize`` fails (rc -1), as it
    does when a pod's pinned Mooncake range is already in use. Yields the environment to start a
    process with."""
    holder = socket.socket()
    for port in random.sample(
        range(15000, 17000), 2000
    ):  # Mooncake ignores a range outside its own
        try:
            holder.bind(("0.0.0.0", port))
            break
        except OSError:
            continue
    else:
        holder.close()
        raise RuntimeError("no free port in 15000..17000 to hold")
    holder.listen()
    try:
        yield {"MC_MIN_RPC_PORT": str(port), "MC_MAX_RPC_PORT": str(port)}
    finally:
        holder.close()


def can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    import subprocess

    probe = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs -o size=1m tmpfs /dev/shm",
        ],
        capture_output=True,
    )
    return probe.returncode == 0


def _log(role: Role) -> str:
    with open(role.log_path, errors="replace") as f:
        return f.read()


async def _wait_exit(lab: FaultLab, role: Role, timeout_s: float = 90) -> int | None:
    """Until a role that should fail at start-up exits; None (and the process killed) if it did
    not."""
    end = time.monotonic() + timeout_s
    while role.alive() and time.monotonic() < end:
        await asyncio.sleep(0.1)
    code = role.process.poll()
    if code is None:
        lab.cluster.kill(role)
    lab.cluster.roles.remove(role)
    return code


async def _retire(lab: FaultLab, role: Role) -> int:
    """SIGTERM a role started for one scenario; its exit code."""
    if role.alive():
        role.process.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(role.process.wait, 30)
    lab.cluster.roles.remove(role)
    return code


async def dev_shm_full(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """epd-prefill starts where /dev/shm has less room than its pool (a private mount namespace
    whose /dev/shm is an 8 MiB tmpfs: creating the 32 MiB pool gets a real ENOSPC from
    posix_fallocate). Offered SHM and Mooncake, it must come up on a Mooncake-only pool and serve,
    saying why; offered SHM alone, it must exit at once with a clear error."""
    outcome = FaultOutcome("dev_shm_full")
    started = time.monotonic()
    fallback = start_with_small_dev_shm(lab, "prefill-enospc", "shm,mooncake")
    only_shm = start_with_small_dev_shm(lab, "prefill-enospc-shm-only", "shm")
    code = await _wait_exit(lab, only_shm)
    log = _log(only_shm)
    outcome.notes["shm_only_exit_code"] = code
    outcome.notes["shm_only_last_line"] = log.strip().splitlines()[-1] if log.strip() else ""
    outcome.affected.append(
        {
            "state": "FAILED" if code not in (None, 0) else "DONE",
            "reason": outcome.notes["shm_only_last_line"],
            "ttf_s": time.monotonic() - started,
        }
    )
    await asyncio.to_thread(lab.cluster.wait_ready, 120)
    outcome.notes["fallback_serves_over_mooncake"] = await serves(
        lab, conn, rng, "a", fallback, "mooncake"
    )
    log = _log(fallback)
    outcome.notes["fallback_says"] = [line for line in log.splitlines() if "No space left" in line][
        :1
    ]
    outcome.notes["fallback_exit_code"] = await _retire(lab, fallback)
    outcome.expected = (
        code not in (None, 0)
        and "No space left on device" in outcome.notes["shm_only_last_line"]
        and "Traceback" not in _log(only_shm)
        and outcome.notes["fallback_serves_over_mooncake"]
        and bool(outcome.notes["fallback_says"])
        and outcome.notes["fallback_exit_code"] == 0
    )
    return outcome


async def mooncake_unavailable(lab: FaultLab, conn: Conn, rng: random.Random) -> FaultOutcome:
    """An encode worker and a prefill process start while Mooncake cannot initialize (its whole port
    range is taken): each must come up SHM-only, saying so, and serve over SHM; a prefill process
    offered Mooncake alone must exit at once with a clear error."""
    outcome = FaultOutcome("mooncake_unavailable")
    started = time.monotonic()
    with mooncake_ports_taken() as env:
        worker = lab.track(
            lab.cluster.start_encode_worker(
                "worker-nomc",
                transports="shm,mooncake",
                extra=("--ring-bytes", str(32 << 20)),
                env=env,
            )
        )
        prefill = lab.track(
            lab.cluster.start_prefill(
                "prefill-nomc",
                transports="shm,mooncake",
                pool_bytes=32 << 20,
                extra=("--slot-bytes", str(lab.config.slot_bytes)),
                env=env,
            )
        )
        only = lab.track(
            lab.cluster.start_prefill(
                "prefill-nomc-only", transports="mooncake", pool_bytes=32 << 20, env=env
            )
        )
        code = await _wait_exit(lab, only)
        log = _log(only)
        outcome.notes["mooncake_only_exit_code"] = code
        outcome.notes["mooncake_only_last_line"] = (
            log.strip().splitlines()[-1] if log.strip() else ""
        )
        outcome.affected.append(
            {
                "state": "FAILED" if code not in (None, 0) else "DONE",
                "reason": outcome.notes["mooncake_only_last_line"],
                "ttf_s": time.monotonic() - started,
            }
        )
        await asyncio.to_thread(lab.cluster.wait_ready, 120)
        outcome.notes["serves_over_shm"] = await serves(lab, conn, rng, worker, prefill, "shm")
        outcome.notes["worker_says"] = [
            l for l in _log(worker).splitlines() if "Mooncake unavailable" in l
        ][:1]
        outcome.notes["prefill_says"] = [
            l for l in _log(prefill).splitlines() if "Mooncake unavailable" in l
        ][:1]
        outcome.notes["exit_codes"] = [await _retire(lab, worker), await _retire(lab, prefill)]
    outcome.expected = (
        code not in (None, 0)
        and "Mooncake" in outcome.notes["mooncake_only_last_line"]
        and "Traceback" not in _log(only)
        and outcome.notes["serves_over_shm"]
        and bool(outcome.notes["worker_says"])
        and bool(outcome.notes["prefill_says"])
        and outcome.notes["exit_codes"] == [0, 0]
    )
    return outcome


SCENARIOS = {
    "worker_killed_mid_transfer": worker_killed_mid_transfer,
    "worker_paused_past_deadline": worker_paused_past_deadline,
    "prefill_killed_after_registering": prefill_killed_after_registering,
    "handshake_unreachable": handshake_unreachable,
    "cancel_during_write": cancel_during_write,
    "duplicate_room": duplicate_room,
    "item_too_large": item_too_large,
    "rows_mismatch": rows_mismatch,
    "layout_mismatch": layout_mismatch,
    "malformed_input": malformed_input,
    "dev_shm_full": dev_shm_full,
    "mooncake_unavailable": mooncake_unavailable,
}
