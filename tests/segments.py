"""Our /dev/shm segments, and which a test run left behind: only this process's, its children's,
or a gone process's count (another test run on the machine makes segments of its own meanwhile).

Under pytest-xdist a gone process's segment may be the sibling worker's (one its test killed and
sweeps later), so a worker counts only its own tree's; the session's end, in the controller once
every worker is done, counts the gone processes' (``conftest.pytest_sessionfinish``)."""

import glob
import os


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
    while pid > 1:
        if pid == os.getpid():
            return True
        pid = _parent(pid)
    return False
