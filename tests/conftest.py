import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import pytest  # noqa: E402

import tests.profiles  # noqa: E402,F401  (Hypothesis's profile: HYPOTHESIS_PROFILE)
from tests.segments import left_since, segments  # noqa: E402


@pytest.fixture
def no_new_segments():
    """Fail the test if it leaves a /dev/shm segment of ours behind (not another run's)."""
    before = segments()
    yield
    left = left_since(before)
    assert not left, f"leaked SHM segments: {sorted(left)}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A small full checkpoint (sharded, hub layout) of each tower family, by family name."""
    from epdserve.vision.families import FAMILIES
    from epdserve.vision.small_checkpoints import build_full

    return {family: build_full(family, str(tmp_path_factory.mktemp(family))) for family in FAMILIES}
