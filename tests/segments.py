"""Our /dev/shm segments, and which a test run left behind: only this process's, its children's,
or a gone process's count (another test run on the machine makes segments of its own meanwhile)."""

import glob
import os
import time

# A gone process's segment may be another process tree's, in the moment between that process's
# death and its parent's sweep (a sibling pytest-xdist worker killing its own peer): such a
# segment counts as left only if it is still there this long after.
SWEEP_S = 10.0


def segments() -> set[str]:
    return set(glob.glob("/dev/shm/epd-*"))


def left_since(before: set[str]) -> set[str]:
    """The segments made since ``before`` by this run (``before``: ``segments()`` then): this
    process's and its live children's at once, a gone process's if still there after SWEEP_S."""
    end = time.monotonic() + SWEEP_S
    while True:
        left = {path for path in segments() - before if _of_this_run(_creator(path))}
        if all(_alive_in_this_tree(_creator(path)) for path in left) or time.monotonic() >= end:
            return left
        time.sleep(0.05)


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
    """Whether a segment's creator is this process, one it started, or gone (a segment a test's
    dead process left): not another process tree's (a second test run on the machine)."""
    return pid is None or not os.path.exists(f"/proc/{pid}") or _alive_in_this_tree(pid)


def _alive_in_this_tree(pid: int | None) -> bool:
    """Whether ``pid`` is this process or one it started, still running."""
    while pid is not None and pid > 1:
        if pid == os.getpid():
            return True
        pid = _parent(pid)
    return False
