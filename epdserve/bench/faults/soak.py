"""`epd-bench soak`: normal traffic through real processes with faults injected at random, every
delivered item checked bit-exact.

    epd-bench soak --items 10000 --fault-rate 0.05 --json soak.json

The processes are ``bench.faults.FaultLab``'s (a standalone handshake, steady encode workers ``a``
(SHM and Mooncake) and ``b`` (Mooncake only), the steady prefill process, and the victims ``v`` and
``pv``). Normal traffic: ``--concurrency`` clients send requests of 1-4 images (from a set of
distinct synthetic images, so the workers' embedding caches hit too) through the real dispatcher
over workers ``a`` and ``b`` into the prefill process (with ``rooms_at_handshake``, the dispatcher
opens the normal items' rooms at the standalone handshake over its room stream and the workers
reach them there, as ``epd-dispatch --rooms-url``, and no fault kills that handshake; else at
each item's worker). Faults: one scenario of ``bench.faults`` at a time, drawn at random (weighted
by cost: start-up faults start processes), injected so that fault events stay at ``--fault-rate``
per item over the run; every item a fault scenario sends counts toward ``--items`` too.

Checked: every delivered item's rows against this process's own tower (xxh3 of the rows); every
faulted room's outcome and time from the fault to its failure; normal items that failed
("collateral", must be 0); at the end, after the quarantine has run out, leased and quarantined
slots in every pool and send ring, /dev/shm segments of processes that are gone, and the growth of
each steady process's own memory (RssAnon, medians of windows: ``_rss_growth``) from the end of
the warm-up to the end. The exit status is 1
unless every goal in the report's ``goals`` is met.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

from epdserve.bench import faults
from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.faults import FAST_S, FaultLab, LabConfig, lab_model

# (scenario, weight): faults that start processes cost seconds each, the rest a fraction of one
WEIGHTS = {
    "worker_killed_mid_transfer": 1.0,
    "worker_paused_past_deadline": 1.0,
    "prefill_killed_after_registering": 1.0,
    "handshake_unreachable": 1.0,
    "cancel_during_write": 1.0,
    "duplicate_room": 1.0,
    "item_too_large": 1.0,
    "rows_mismatch": 1.0,
    "layout_mismatch": 1.0,
    "malformed_input": 1.0,
    "dev_shm_full": 0.25,
    "mooncake_unavailable": 0.25,
}
STARTUP = {
    "dev_shm_full",
    "mooncake_unavailable",
}  # no room to fail: a process that starts (or exits) right
REFUSALS = {"malformed_input"}  # refusals of bad frames and bodies, not rooms
DISTINCT_IMAGES = 256
RSS_GROWTH_PCT = 5.0  # the goal: no steady process's own memory grows more than this once warm
WARMUP_S = 120.0  # the room tables' tombstone TTL: their longest time to reach a steady size


@dataclass
class Goal:
    name: str
    value: object
    target: str
    met: bool


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Soak:
    def __init__(
        self,
        items: int,
        fault_rate: float,
        concurrency: int = 3,
        seed: int = 0,
        model: str | None = None,
        kinds: list[str] | None = None,
        progress: bool = True,
        rooms_at_handshake: bool = False,
    ):
        self.items = items
        self.rooms_at_handshake = rooms_at_handshake
        self.fault_rate = fault_rate
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.seed = seed
        self.model = model or lab_model(os.path.join(tempfile.gettempdir(), "epd-soak-tower"))
        self.kinds = kinds or [
            kind for kind in WEIGHTS if kind != "dev_shm_full" or faults.can_mount_tmpfs()
        ]
        if rooms_at_handshake and "handshake_unreachable" in self.kinds:  # (it kills the
            # handshake and starts another on other ports: the normal traffic's rooms would be
            # its casualties, and its dispatcher's URL stale)
            self.kinds = [kind for kind in self.kinds if kind != "handshake_unreachable"]
            print("handshake_unreachable left out: the rooms are at that handshake", flush=True)
        if not self.kinds:
            raise ValueError("no fault scenario left to run")
        self.progress = progress
        self.counted = 0  # items sent so far, normal and faulted
        self.normal = {"requests": 0, "items": 0, "delivered": 0, "corrupted": 0, "failed": 0}
        self.failures: list[str] = []
        self.events: list[dict] = []
        self.rss: dict[str, list[tuple[float, dict]]] = {}
        self._stop = asyncio.Event()

    # ---- traffic ---------------------------------------------------------------------------

    async def _client(
        self, lab: FaultLab, dispatcher, session, pool: list[bytes], client_rng: random.Random
    ) -> None:
        from epdserve.dispatcher.cli import prefill_body

        prefill = lab.roles["prefill"]
        while not self._stop.is_set():
            # keep fault events at the fault rate: wait while the fault driver is behind
            while (
                len(self.events) + 1
            ) < self.counted * self.fault_rate and not self._stop.is_set():
                await asyncio.sleep(0.05)
            if self.counted >= self.items:
                return
            count = client_rng.randint(1, 4)
            images = [pool[client_rng.randrange(len(pool))] for _ in range(count)]
            self.counted += count
            request_id = f"soak-{self.normal['requests']}-{client_rng.randrange(1 << 30):x}"
            self.normal["requests"] += 1
            items = await dispatcher.dispatch(request_id, images)
            async with session.post(
                prefill.url + "/v1/prefill", json=prefill_body(request_id, items, False)
            ) as resp:
                report = await resp.json()
            for item, row in zip(items, report["items"]):
                self.normal["items"] += 1
                if row["state"] != "DONE":
                    self.normal["failed"] += 1
                    self.failures.append(
                        f"{request_id}[{row['index']}]: {row['reason'] or item.error}"
                    )
                elif row["checksum"] == lab.reference(item.data):
                    self.normal["delivered"] += 1
                else:
                    self.normal["corrupted"] += 1

    async def _faults(self, lab: FaultLab, conn) -> None:
        kinds = self.kinds
        weights = [WEIGHTS[kind] for kind in kinds]
        while not self._stop.is_set():
            if len(self.events) >= max(1, round(self.items * self.fault_rate)):
                return
            if (
                len(self.events) >= self.counted * self.fault_rate
            ):  # ahead of the traffic: wait for it
                await asyncio.sleep(0.05)
                continue
            kind = self.rng.choices(kinds, weights)[0]
            started = time.monotonic()
            try:
                outcome = await faults.SCENARIOS[kind](lab, conn, self.rng)
                record = outcome.as_dict()
            except Exception as exc:  # a scenario that broke is a finding, never a silent skip
                record = {
                    "kind": kind,
                    "error": f"{type(exc).__name__}: {exc}",
                    "affected": [],
                    "delivered_anyway": [],
                    "delivered": 0,
                    "corrupted": 0,
                    "collateral": 0,
                    "expected": False,
                    "notes": {},
                }
                await asyncio.to_thread(self._heal, lab)
            record["seconds"] = time.monotonic() - started
            self.counted += len(record["affected"]) if kind not in REFUSALS | STARTUP else 0
            self.counted += record["delivered"]
            self.events.append(record)

    def _heal(self, lab: FaultLab) -> None:
        """After a scenario crashed: replace any role that is not alive, so the soak goes on."""
        for name, role in list(lab.roles.items()):
            if not role.alive():
                lab.restart(name)

    async def _sample_rss(self, lab: FaultLab) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for name in ("handshake", "a", "b", "prefill"):
                role = lab.roles.get(name)
                if role is not None and role.alive():
                    self.rss.setdefault(f"{name}:{role.process.pid}", []).append(
                        (now, lab.rss(name))
                    )
            await asyncio.sleep(1.0)

    async def _report_progress(self, started: float) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(10)
            elapsed = time.monotonic() - started
            print(
                f"  {elapsed:6.0f} s  items {self.counted}/{self.items}  faults "
                f"{len(self.events)}  "
                f"normal delivered {self.normal['delivered']} failed {self.normal['failed']} "
                f"corrupted {self.normal['corrupted']}",
                flush=True,
            )

    async def _run(self, lab: FaultLab) -> None:
        import aiohttp

        from epdserve.dispatcher import Dispatcher, WorkerSet
        from epdserve.testing.images import synthetic_image

        pool_rng = random.Random(self.seed + 1)
        sides = (224, 280, 336, 392, 448)
        pool = [
            synthetic_image(pool_rng.choice(sides), pool_rng.choice(sides), 10_000 + i)
            for i in range(DISTINCT_IMAGES)
        ]
        for image in pool:
            lab.reference(image)
        workers = WorkerSet([lab.roles[name].worker for name in ("a", "b")], check_timeout_s=2)
        await workers.refresh()
        rooms_url = lab.roles["handshake"].url if self.rooms_at_handshake else None
        dispatcher = Dispatcher(workers, lab.processor, rooms_url=rooms_url, intake_timeout_s=10)
        started = time.monotonic()
        async with (
            lab.connect() as conn,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session,
        ):
            tasks = [
                asyncio.ensure_future(
                    self._client(lab, dispatcher, session, pool, random.Random(self.seed * 100 + i))
                )
                for i in range(self.concurrency)
            ]
            fault_task = asyncio.ensure_future(self._faults(lab, conn))
            sampler = asyncio.ensure_future(self._sample_rss(lab))
            ticker = (
                asyncio.ensure_future(self._report_progress(started)) if self.progress else None
            )
            try:
                await asyncio.gather(*tasks)
                await fault_task
            finally:
                self._stop.set()
                for task in (sampler, ticker):
                    if task is not None:
                        task.cancel()
                await dispatcher.close()
                await workers.close()
        self.wall_s = time.monotonic() - started

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> dict:
        config = LabConfig(
            model=self.model,
            steady_mooncake_worker=True,
            log_dir=tempfile.mkdtemp(prefix="epd-soak-logs-"),
        )
        lab = FaultLab(config)
        print(f"process logs in {config.log_dir}", flush=True)
        started = time.monotonic()
        lab.start()
        start_s = time.monotonic() - started
        try:
            asyncio.run(self._run(lab))
            # quarantines run out, then nothing may be held anywhere
            time.sleep(config.quarantine_s + 1)
            leaks = {name: lab.pool_stats(name) for name in ("prefill", "pv")}
            rings = {name: lab.ring_occupancy(name) for name in ("a", "b", "v")}
            orphans_live = sorted(lab.orphan_segments())
            rss = _rss_growth(self.rss)
        finally:
            codes = lab.stop()
        time.sleep(0.5)
        orphans_after_stop = sorted(lab.orphan_segments())
        return self._summary(
            lab, start_s, leaks, rings, orphans_live, orphans_after_stop, rss, codes
        )

    def _summary(
        self, lab, start_s, leaks, rings, orphans_live, orphans_after_stop, rss, codes
    ) -> dict:
        # every room a fault was aimed at: those that failed, and those delivered all the same
        affected = [
            a
            for e in self.events
            if e["kind"] not in STARTUP | REFUSALS
            for a in e["affected"] + e["delivered_anyway"]
        ]
        failed = [a for a in affected if a["state"] != "DONE"]
        rooms_ttf = [a["ttf_s"] for a in failed if a.get("ttf_s") is not None]
        failed_fast = sum(1 for a in failed if a.get("ttf_s") is not None and a["ttf_s"] <= FAST_S)
        by_kind = _by_kind(self.events)
        delivered = self.normal["delivered"] + sum(e["delivered"] for e in self.events)
        corrupted = self.normal["corrupted"] + sum(e["corrupted"] for e in self.events)
        collateral = self.normal["failed"] + sum(e["collateral"] for e in self.events)
        crashed = [e for e in self.events if "error" in e]
        not_applicable = [e for e in self.events if e.get("not_applicable")]
        unexpected = [
            e
            for e in self.events
            if not e.get("expected") and "error" not in e and not e.get("not_applicable")
        ]
        report = {
            "items": self.counted,
            "items_goal": self.items,
            "fault_rate": self.fault_rate,
            "seed": self.seed,
            "fault_events": len(self.events),
            "concurrency": self.concurrency,
            "rooms_at_handshake": self.rooms_at_handshake,
            "kinds": self.kinds,
            "delivered": delivered,
            "corrupted": corrupted,
            "faulted_rooms": len(affected),
            "faulted_rooms_failed": len(failed),
            "failed_fast": failed_fast,
            "failed_slow": len(failed) - failed_fast,
            "faulted_rooms_delivered_anyway": len(affected) - len(failed),
            "collateral_failures": collateral,
            "collateral_reasons": self.failures[:20],
            "ttf_p50_s": _p(rooms_ttf, 0.5),
            "ttf_p99_s": _p(rooms_ttf, 0.99),
            "ttf_max_s": max(rooms_ttf, default=None),
            # events whose fault the system outran (not judged): by scenario, with why
            "not_applicable_count": len(not_applicable),
            "not_applicable": [(e["kind"], e["not_applicable"]) for e in not_applicable[:10]],
            "unexpected_outcome_count": len(unexpected),
            "unexpected_outcomes": unexpected[:10],
            "crashed_scenario_count": len(crashed),
            "crashed_scenarios": crashed[:10],
            "leaked_slots": {
                "pools": leaks,
                "send_rings": rings,
                "total": sum(v["leased"] + v["quarantined"] for v in leaks.values())
                + sum(rings.values()),
            },
            "leaked_shm_segments": {
                "while_running": orphans_live,
                "after_stop": orphans_after_stop,
                "total": len(set(orphans_live) | set(orphans_after_stop)),
            },
            "serve_check_failure_count": len(lab.serve_failures),
            "serve_check_failures": lab.serve_failures[:10],
            "rss": rss,
            "restarts": lab.restarts,
            "exit_codes": codes,
            "by_kind": by_kind,
            "normal": self.normal,
            "start_s": start_s,
            "wall_s": self.wall_s,
            "items_per_s": self.counted / self.wall_s if self.wall_s else None,
        }
        report["goals"] = [asdict(goal) for goal in _goals(report)]
        return report


def _rss_growth(rss: dict[str, list[tuple[float, dict]]]) -> dict:
    """Per steady process: its memory once warm (the median over the quarter of the run after
    ``WARMUP_S``, or after 10 % of a run too short for that) and at the end (the median over the
    last quarter), and the growth. Warm means every bounded table has reached its steady size:
    the room tables keep ended rooms for their tombstone TTL (120 s), and the allocator's arenas
    grow to their working size over the first minutes. The goal is on the process's own memory,
    RssAnon: VmRSS also counts RssShmem, which for an SHM writer is the receiver's pool pages it
    has written into so far (the receiver's memory, bounded by its pool); and on medians, because
    the allocator moves RssAnon by +-15 % between two samples without a trend."""
    growth = {}
    for key, samples in rss.items():
        if len(samples) < 10:
            continue
        first_t, span = samples[0][0], samples[-1][0] - samples[0][0]
        warm_s = WARMUP_S if span >= 2 * WARMUP_S else 0.1 * span

        def median(field: str, start_s: float, end_s: float) -> float:
            return statistics.median(
                s[field] for t, s in samples if start_s <= t - first_t <= end_s
            )

        after = warm_s + 0.25 * (span - warm_s)
        warm = {f: median(f, warm_s, after) for f in ("VmRSS", "RssAnon", "RssShmem")}
        end = {f: median(f, 0.75 * span, span) for f in ("VmRSS", "RssAnon", "RssShmem")}
        growth[key] = {
            "warm_after_s": round(warm_s),
            "vmrss_kb_after_warmup": warm["VmRSS"],
            "vmrss_kb_end": end["VmRSS"],
            "vmrss_growth_pct": 100.0 * (end["VmRSS"] - warm["VmRSS"]) / warm["VmRSS"],
            "rss_anon_kb_after_warmup": warm["RssAnon"],
            "rss_anon_kb_end": end["RssAnon"],
            "rss_anon_growth_pct": 100.0 * (end["RssAnon"] - warm["RssAnon"]) / warm["RssAnon"],
            "rss_shmem_kb_after_warmup": warm["RssShmem"],
            "rss_shmem_kb_end": end["RssShmem"],
            "vmrss_kb_max": max(s[1]["VmRSS"] for s in samples),
            "samples": len(samples),
            "trace": [
                (round(t - first_t), s["VmRSS"], s["RssAnon"], s["RssShmem"])
                for t, s in samples[:: max(1, len(samples) // 40)]
            ],
        }
    return growth


def _by_kind(events: list[dict]) -> dict:
    """Per scenario: its events, those with the expected outcome, those that crashed, the rooms
    it aimed at (and of those, delivered anyway) and the time to failure of those that failed
    (p50, p99, max)."""
    by_kind = {}
    for event in events:
        entry = by_kind.setdefault(
            event["kind"],
            {
                "events": 0,
                "expected": 0,
                "not_applicable": 0,
                "errors": 0,
                "affected": 0,
                "delivered_anyway": 0,
                "ttf_s": [],
            },
        )
        entry["events"] += 1
        entry["expected"] += bool(event.get("expected")) and not event.get("not_applicable")
        entry["not_applicable"] += bool(event.get("not_applicable"))
        entry["errors"] += "error" in event
        aimed = event["affected"] + event["delivered_anyway"]
        entry["affected"] += len(aimed)
        entry["delivered_anyway"] += sum(a["state"] == "DONE" for a in aimed)
        entry["ttf_s"] += [
            a["ttf_s"]
            for a in event["affected"]
            if a.get("ttf_s") is not None and a["state"] != "DONE"
        ]
    for entry in by_kind.values():
        times = entry.pop("ttf_s")
        entry["ttf_p50_s"], entry["ttf_p99_s"], entry["ttf_max_s"] = (
            _p(times, 0.5),
            _p(times, 0.99),
            max(times) if times else None,
        )
    return by_kind


def _goals(report: dict) -> list[Goal]:
    """Every goal the soak reports; the exit status fails unless all are met."""
    goals = [
        Goal("corrupted items", report["corrupted"], "0", report["corrupted"] == 0),
        Goal(
            f"faulted rooms that failed slower than {FAST_S:g} s",
            report["failed_slow"],
            "0",
            report["failed_slow"] == 0,
        ),
        Goal(
            "normal items that failed (collateral)",
            report["collateral_failures"],
            "0",
            report["collateral_failures"] == 0,
        ),
        Goal(
            "fault events with an unexpected outcome",
            report["unexpected_outcome_count"],
            "0",
            report["unexpected_outcome_count"] == 0,
        ),
        Goal(
            "fault scenarios that crashed",
            report["crashed_scenario_count"],
            "0",
            report["crashed_scenario_count"] == 0,
        ),
        Goal(
            "failed serves-afterwards checks",
            report["serve_check_failure_count"],
            "0",
            report["serve_check_failure_count"] == 0,
        ),
        Goal(
            "leaked slots",
            report["leaked_slots"]["total"],
            "0",
            report["leaked_slots"]["total"] == 0,
        ),
        Goal(
            "leaked SHM segments",
            report["leaked_shm_segments"]["total"],
            "0",
            report["leaked_shm_segments"]["total"] == 0,
        ),
        Goal(
            "non-zero exit codes at the end",
            {k: v for k, v in report["exit_codes"].items() if v != 0},
            "none",
            all(code == 0 for code in report["exit_codes"].values()),
        ),
    ]
    for key, row in report["rss"].items():
        growth = row["rss_anon_growth_pct"]
        goals.append(
            Goal(
                f"own memory (RssAnon) growth after warm-up, {key} (%)",
                round(growth, 1),
                f"< {RSS_GROWTH_PCT:g}",
                growth < RSS_GROWTH_PCT,
            )
        )
    return goals


def main(args) -> int:
    kinds = args.kinds.split(",") if args.kinds else None
    print(
        f"epd-bench soak: {args.items} items, fault rate {args.fault_rate}, {args.concurrency} "
        "clients, "
        f"seed {args.seed}",
        flush=True,
    )
    soak = Soak(
        args.items,
        args.fault_rate,
        args.concurrency,
        args.seed,
        args.model,
        kinds,
        rooms_at_handshake=args.rooms_at_handshake,
    )
    report = soak.run()
    print(
        f"\nitems {report['items']} (faults: {report['fault_events']} events, "
        f"{report['faulted_rooms']} rooms) "
        f"in {report['wall_s']:.0f} s"
    )
    print(
        f"delivered {report['delivered']}  corrupted {report['corrupted']}  failed fast "
        f"{report['failed_fast']}/{report['faulted_rooms_failed']} faulted rooms that failed "
        f"(slow {report['failed_slow']}); delivered anyway "
        f"{report['faulted_rooms_delivered_anyway']}/"
        f"{report['faulted_rooms']} (their fault came after their commit)  collateral "
        f"{report['collateral_failures']}"
    )
    ttf = report["ttf_p99_s"]
    print(
        f"time to failure p50 {report['ttf_p50_s'] or 0:.3f} s, p99 {ttf or 0:.3f} s, max "
        f"{report['ttf_max_s'] or 0:.3f} s"
    )
    print(
        f"leaked slots {report['leaked_slots']['total']}, leaked SHM segments "
        f"{report['leaked_shm_segments']['total']}"
    )
    for key, row in report["rss"].items():
        print(
            f"RSS {key:18s} {row['vmrss_kb_after_warmup'] / 1024:8.1f} -> "
            f"{row['vmrss_kb_end'] / 1024:8.1f} MiB "
            f"({row['vmrss_growth_pct']:+.1f} %), "
            f"own (RssAnon) {row['rss_anon_growth_pct']:+.1f} %, "
            f"shared {row['rss_shmem_kb_after_warmup'] / 1024:.0f} -> "
            f"{row['rss_shmem_kb_end'] / 1024:.0f} MiB"
        )
    for kind, row in sorted(report["by_kind"].items()):
        if kind in STARTUP:
            what = (
                f"processes that exited with a reason {row['affected']:4d}, start to exit max "
                f"{row['ttf_max_s']:.1f} s"
            )
        elif kind in REFUSALS:
            what = f"refusals {row['affected']:4d}, slowest {row['ttf_max_s']:.3f} s"
        else:
            what = (
                f"rooms {row['affected']:4d} (delivered anyway {row['delivered_anyway']})  ttf p99 "
                f"{row['ttf_p99_s'] if row['ttf_p99_s'] is not None else 0:.3f} s"
            )
        print(
            f"  {kind:34s} events {row['events']:4d}  as expected {row['expected']:4d}  "
            f"not applicable {row['not_applicable']:2d}  crashed "
            f"{row['errors']:3d}  "
            f"{what}"
        )
    print("goals:")
    for goal in report["goals"]:
        print(
            f"  {'met   ' if goal['met'] else 'MISSED'} {goal['name']}: {goal['value']} (goal "
            f"{goal['target']})"
        )
    write_json(args.json, report)
    return 0 if all(goal["met"] for goal in report["goals"]) else 1
