"""Our /dev/shm segments, and which a test run left behind: only this process's, its children's,
or a gone process's count (another test run on the machine makes segments of its own meanwhile).

Under pytest-xdist a gone process's segment may be the sibling worker's (one its test killed and
sweeps later), so a worker counts only its own tree's; the session's end, in the controller once
every worker is done, counts the gone processes' (``conftest.pytest_sessionfinish``).

vLLM's own segments are not ours to count, but a test that starts tensor-parallel ranks sweeps
those the ranks leave (``sweep_vllms_leftovers``)."""

import glob
import os

from tests.waiting import eventually


def segments() -> set[str]:
    return set(glob.glob("/dev/shm/epd-*"))


def left_since(before: set[str]) -> set[str]:
    """The segments made since ``before`` by this run (``before``: ``segments()`` then)."""
    return {path for path in segments() - before if _of_this_run(_creator(path))}


def _creator(path: str) -> int | None:
    """The pid in a segment's name (``epd-<kind>-<pid>-<random>``), None when it has none."""
    parts = os.path.basename(path).split("-")
    return int(parts[2]) if len(parts) >= 4 and parts[2].isdigit() else None


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _of_this_run(pid: int | None) -> bool:
    """Whether a segment's creator is this process or one it started, or, outside an xdist
    worker, gone (a segment a test's dead process left); never another process tree's."""
    if pid is None or not os.path.exists(f"/proc/{pid}"):
        return "PYTEST_XDIST_WORKER" not in os.environ
    return _of_this_tree(pid)


def vllm_segments_of_this_process_tree() -> set[str]:
    """vLLM's CPU communicators' segments (``vllm_dist_<id>-tp:...-cpushm_<rank>``) that this
    process or one it started maps: its engine's tensor-parallel ranks'."""
    return {path for path, pids in _vllm_mappers().items() if any(map(_of_this_tree, pids))}


def sweep_vllms_leftovers(ours: set[str]) -> None:
    """Once no process maps any of ``ours`` (the shut-down ranks have exited), unlinks those left:
    vLLM 0.32's CPU ranks leave them, and /dev/shm is memory."""
    eventually(
        lambda: not set(_vllm_mappers()) & ours,
        "the tensor-parallel ranks gone from their segments",
        seconds=60,
    )
    for path in ours:
        if os.path.exists(path):
            os.unlink(path)


def _vllm_mappers() -> dict[str, set[int]]:
    """Each vLLM segment some live process maps, and the pids that map it."""
    mappers: dict[str, set[int]] = {}
    for maps in glob.glob("/proc/[0-9]*/maps"):
        pid = int(maps.split("/")[2])
        try:
            with open(maps) as f:
                paths = {line.split(maxsplit=5)[-1].strip() for line in f if "/vllm_dist_" in line}
        except OSError:  # the process ended while we read
            continue
        for path in paths:
            mappers.setdefault(path.removesuffix(" (deleted)"), set()).add(pid)
    return mappers


def _of_this_tree(pid: int) -> bool:
    """Whether ``pid`` is this process or one it started."""
    while pid > 1:
        if pid == os.getpid():
            return True
        pid = _parent(pid)
    return False
