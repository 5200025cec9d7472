"""The lab the fault scenarios run in. A ``FaultLab`` runs every role as its own process
(``bench.cluster.LocalCluster``):

* steady roles, which must keep serving through every fault: a standalone handshake
  (``handshake``), encode worker ``a`` (SHM and Mooncake), optionally encode worker ``b``
  (Mooncake only: the soak's Mooncake traffic), and the prefill process ``prefill``
  (`epd-prefill`, SHM and Mooncake);
* victims, which faults are injected into and which are restarted afterwards: encode worker ``v``
  (Mooncake only, short write deadline) and the prefill process ``pv``.

A scenario's result is a ``FaultOutcome``. Leaks (slots, SHM segments) and "still serving" are
checked by the caller with ``lab.pool_stats`` / ``lab.ring_occupancy`` / ``lab.orphan_segments``
(over ``shm_segments``) / ``serves``.
"""

from __future__ import annotations

import glob
import os
import urllib.request
from dataclasses import dataclass, field

from bench.cluster import LocalCluster, Role
from bench.faults.conn import Conn

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
