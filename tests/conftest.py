import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import pytest  # noqa: E402

import tests.profiles  # noqa: E402,F401  (Hypothesis's profile: HYPOTHESIS_PROFILE)
from epdserve.testing.cluster import LocalCluster  # noqa: E402
from tests.segments import left_since, segments  # noqa: E402

SEGMENTS_BEFORE = pytest.StashKey[set[str]]()

# The clusters' roles are forked from a server that has their imports done: each role skips the
# 3-4 s of CPU a new interpreter spends importing torch and transformers. The CLI tests
# (test_cli.py, test_k8s.py) start the commands as new interpreters, as a deployment does.
LocalCluster.fork_roles = True
# The clusters' gateways place every image a worker takes on the workers (the tests assert the
# disaggregated path); --placement cost, the default, is tested where a test names it.
LocalCluster.placement = "workers"


def pytest_sessionstart(session):
    session.config.stash[SEGMENTS_BEFORE] = segments()


def pytest_sessionfinish(session, exitstatus):
    """The run fails if it left a segment behind; in xdist's controller, once every worker is
    done, this counts the gone processes' that the workers' own checks leave to it."""
    left = left_since(session.config.stash[SEGMENTS_BEFORE])
    if left and not hasattr(session.config, "workerinput"):
        writer = session.config.get_terminal_writer()
        writer.line()
        writer.line(f"leaked SHM segments: {sorted(left)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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


# The longest modules first (vLLM's engines, then compiles and process clusters; within a lane, the
# module of most tests first): two xdist workers then end together instead of one starting an
# engine while the other has finished. A module's tests stay together, in their order (its
# module fixtures are made once).
HEAVIEST_FIRST = ("vllm", "compile", "processes")


def pytest_collection_modifyitems(items):
    def lane(item) -> int:
        marks = {mark.name for mark in item.iter_markers()}
        return next((i for i, name in enumerate(HEAVIEST_FIRST) if name in marks), 3)

    module_lane: dict[str, int] = {}
    module_tests: dict[str, int] = {}
    for item in items:
        module_lane[item.path] = min(lane(item), module_lane.get(item.path, 3))
        module_tests[item.path] = module_tests.get(item.path, 0) + 1
    items.sort(key=lambda item: (module_lane[item.path], -module_tests[item.path]))
