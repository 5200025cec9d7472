"""The lab the fault scenarios run in. A ``FaultLab`` runs every role as its own process
(``bench.cluster.LocalCluster``):

* steady roles, which must keep serving through every fault: a standalone handshake
  (``handshake``), encode worker ``a`` (SHM and Mooncake), optionally encode worker ``b``
  (Mooncake only: the soak's Mooncake traffic), and the prefill process ``prefill``
  (`epd-prefill`, SHM and Mooncake);
* victims, which faults are injected into and which are restarted afterwards: encode worker ``v``
  (Mooncake only, short write deadline) and the prefill process ``pv``.

A scenario's requests go through the lab's clients for one event loop (``Conn``, from
``lab.connect()``: aiohttp, handshake clients and intake sockets per role), which mint rooms, send
items to a worker's intake, post to a prefill process (its report a ``Posted``), watch rooms and
tally a report against the reference rows. A scenario's result is a ``FaultOutcome``. Leaks
(slots, SHM segments) and "still serving" are checked by the caller with ``lab.pool_stats`` /
``lab.ring_occupancy`` / ``lab.orphan_segments`` (over ``shm_segments``) / ``serves``.
"""

from __future__ import annotations

import asyncio
import glob
import os
import time
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from epdserve.testing.cluster import LocalCluster, Role

if TYPE_CHECKING:
    from epdserve.wire.intake import IntakeReply

FAST_S = 2.0  # the bound: an affected room fails within this of the fault being observable
WIDTH = 2048  # the lab tower's output width: a 1M-pixel image is ~10 MB of fp32 rows


def lab_model(directory: str) -> str:
    """The lab's checkpoint: a small real Qwen2.5-VL tower with 2048-wide rows."""
    from epdserve.vision.small_checkpoints import build_vision_only

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
    # why the fault could not be made this time (the system outran the harness: a write ended
    # before its cancel could land); such an event is reported apart, not judged
    not_applicable: str | None = None
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
            "not_applicable": self.not_applicable,
            "ttf_s": self.ttf_s,
            "failed_fast": self.failed_fast,
            "notes": self.notes,
        }


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
        if name == "handshake":
            role = self.cluster.start_handshake("handshake")
        elif name in ("a", "b", "v"):
            role = self.cluster.start_encode_worker(
                f"worker-{name}",
                transports="shm,mooncake" if name == "a" else "mooncake",
                extra=(
                    "--receiver-wait-s",
                    "10",
                    "--cache-bytes",
                    str(64 << 20),
                    "--ring-bytes",
                    str(64 << 20),
                    "--write-timeout-s",
                    str(c.victim_write_timeout_s if name == "v" else c.steady_write_timeout_s),
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

        from epdserve.vision.tower import VisionTower

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
        from epdserve.dispatcher.dispatch import Dispatcher

        return Dispatcher(None, self.processor).describe(images)

    def reference(self, image: bytes) -> int:
        """xxh3-64 of the rows this process's own tower produces for ``image`` (alone)."""
        from epdserve.data_plane.commit import checksum
        from epdserve.multimodal.hashing import hash_feature

        key = hash_feature(image)
        if key not in self._references:
            from epdserve.vision.images import image_from_bytes

            inputs = self.tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
            (rows,) = self.tower.encode_items(inputs["pixel_values"], inputs["image_grid_thw"])
            self._references[key] = checksum(rows.to(self.tower.dtype).contiguous())
        return self._references[key]

    def connect(self) -> Conn:
        return Conn(self)


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
        from epdserve.wire.room_client import HandshakeClient

        client = self._rooms.get(url)
        if client is None:
            client = self._rooms[url] = HandshakeClient(url, timeout_s=5.0, retries=2)
        return client

    def intake(self, role: Role):
        from epdserve.wire.intake import AsyncIntakeClient

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
        from epdserve.wire.addresses import EncodeHandshake

        host, port = rooms_url.rsplit("/", 1)[-1].rsplit(":", 1)
        rooms = await self.rooms(rooms_url).mint(len(items), 120)
        for item, room in zip(items, rooms):
            item.encode_handshake = EncodeHandshake(
                bootstrap_room=room, bootstrap_host=host, bootstrap_port=int(port)
            )

    async def send(self, worker: Role, item, request_id: str) -> IntakeReply:
        from epdserve.wire.intake import IntakeRequest

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
        from epdserve.dispatcher.cli import prefill_body

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
        from epdserve.wire.rooms import RoomState

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
