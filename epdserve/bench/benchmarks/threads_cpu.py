"""CPU time per thread of a process, by the names the OS knows its threads by
(``loop_threads.name_os_thread``): what the benchmarks divide by the items they delivered."""

from __future__ import annotations

import os


def cpu_s(stat_path: str) -> float:
    """User + system CPU seconds of a process or thread, from its ``stat`` file."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(task_path: str) -> float:
    """CPU seconds of one thread: its scheduler's run time in nanoseconds (``schedstat``), where
    the kernel keeps it, else its ``stat`` (in clock ticks, 10 ms each)."""
    try:
        with open(f"{task_path}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except FileNotFoundError:
        if not os.path.exists(task_path):
            raise
        return cpu_s(f"{task_path}/stat")


def threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (the OS's: ``loop_threads.name_os_thread``) of process
    ``pid``, threads of one name summed; the process's own total (its threads that ended
    included, in clock ticks) under ``"*"``."""
    by_name = {"*": cpu_s(f"/proc/{pid}/stat")}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                name = f.read().strip()
            seconds = thread_cpu_s(f"/proc/{pid}/task/{task}")
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        by_name[name] = by_name.get(name, 0.0) + seconds
    return by_name


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Seconds per name between two readings (a thread that started meanwhile: all of its)."""
    return {name: after[name] - before.get(name, 0.0) for name in after}
