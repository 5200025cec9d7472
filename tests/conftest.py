import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import glob  # noqa: E402

import pytest  # noqa: E402


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
    if pid is None or not os.path.exists(f"/proc/{pid}"):
        return True
    while pid > 1:
        if pid == os.getpid():
            return True
        pid = _parent(pid)
    return False


@pytest.fixture
def no_new_segments():
    """Fail the test if it leaves a /dev/shm segment of ours behind (not another run's)."""
    before = set(glob.glob("/dev/shm/epd-*"))
    yield
    left = {p for p in set(glob.glob("/dev/shm/epd-*")) - before if _of_this_run(_creator(p))}
    assert not left, f"leaked SHM segments: {sorted(left)}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A small full checkpoint (sharded, hub layout) of each tower family, by family name."""
    from epdserve.vision.families import FAMILIES
    from epdserve.vision.small_checkpoints import build_full

    return {family: build_full(family, str(tmp_path_factory.mktemp(family))) for family in FAMILIES}
