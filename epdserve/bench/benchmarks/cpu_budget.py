"""The encode worker's CPU per image by thread, and the rate one worker process could feed an
infinitely fast GPU (``epd-bench encode --instant-tower``, and the GPU check on its host).

The worker's threads are known by the names the OS gives them (``loop_threads``): ``GROUPS`` says
which do what and how many run at once. A group of ``n`` threads spending ``ms`` of CPU per image
cannot pass ``n * 1000 / ms`` images/s, and the process cannot pass ``cores * 1000 / total``; the
lowest of these is the rate the worker could feed a GPU that took no time, and its group the one
that stops it first. With ``instant_tower`` (rows returned at once, no GPU work), the figures
are the worker's own: intake, decode and preprocessing, the tower thread's Python around the call,
staging (ring copy, checksum), the handshake loop's writes and commits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadGroup:
    name: str
    prefixes: tuple[str, ...]  # OS thread names (``/proc/<pid>/task/<tid>/comm``) it covers
    threads: str  # how many run at once: "1", or the WorkerConfig field that sets it

    def count(self, settings) -> int:
        return 1 if self.threads == "1" else max(1, int(getattr(settings, self.threads)))


GROUPS = (
    ThreadGroup("intake", ("intake",), "1"),
    ThreadGroup("decode + preprocessing", ("prepare", "preprocess"), "preprocess_workers"),
    ThreadGroup("tower thread", ("encode",), "1"),
    ThreadGroup("staging", ("stage",), "1"),
    ThreadGroup("handshake loop", ("handshake",), "1"),
    ThreadGroup("senders", ("sender",), "send_workers"),
    ThreadGroup("housekeeping", ("housekeeping",), "1"),
    # ZMQ's I/O thread serves every socket of the process: the worker's intake and, in a bench
    # that runs the worker in-process, its client's
    ThreadGroup("ZMQ I/O", ("ZMQbg",), "1"),
)
OTHER = "not the worker's (bench client, samplers)"


def by_group(seconds_by_thread: dict[str, float], items: int) -> dict[str, float]:
    """ms of CPU per item of each group (``OTHER`` for the process's other threads), from the
    seconds per OS thread name of one process (``threads_cpu.threads_cpu_s`` differences)."""
    out = {group.name: 0.0 for group in GROUPS} | {OTHER: 0.0}
    for name, seconds in seconds_by_thread.items():
        if name == "*":
            continue
        group = next((g.name for g in GROUPS if name.startswith(g.prefixes)), OTHER)
        out[group] += 1000 * seconds / max(items, 1)
    return {name: round(ms, 4) for name, ms in out.items()}


def feed_rate(ms_by_group: dict[str, float], settings, cores: int | None = None) -> dict:
    """What the CPU per item of each group allows: each group's ceiling (its threads at full
    speed), the process's (its cores), and the lowest, with the group that sets it."""
    cores = cores or os.cpu_count() or 1
    ceilings = {
        group.name: round(group.count(settings) * 1000 / ms_by_group[group.name], 1)
        for group in GROUPS
        if ms_by_group.get(group.name, 0) > 0
    }
    worker_ms = sum(ms_by_group.get(group.name, 0.0) for group in GROUPS)
    ceilings["the process's cores"] = round(cores * 1000 / worker_ms, 1) if worker_ms else None
    limits = {name: rate for name, rate in ceilings.items() if rate is not None}
    first = min(limits, key=limits.get) if limits else None
    return {
        "worker_ms_per_item": round(worker_ms, 4),
        "ceilings_items_per_s": ceilings,
        "cores": cores,
        "items_per_s": limits.get(first),
        "stopped_first_by": first,
    }
