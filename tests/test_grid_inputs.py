"""A batch's grid-derived forward inputs, assembled from per-grid parts, equal what transformers'
own helpers compute over the whole batch, for every family and any mix of images and videos."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epdserve.bench.benchmarks.grid_inputs import whole_batch
from epdserve.vision.families import FAMILIES, PATCH_GRID_FAMILIES
from epdserve.vision.grid_inputs import GridInputs
from epdserve.vision.small_checkpoints import vision_config
from tests.profiles import examples


@pytest.fixture(scope="module")
def towers():
    """Each family's small tower (random weights: only its geometry is read)."""
    out = {}
    for name in PATCH_GRID_FAMILIES:
        family = FAMILIES[name]
        config = family.vision_config(**vision_config(name, depth=1, width=32))
        out[name] = family.tower(config).eval()
    return out


def assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if torch.is_tensor(value):
            assert got[name].dtype == value.dtype, name
            assert torch.equal(got[name], value), name
        else:
            assert got[name] == value and isinstance(got[name], int), name


# (t, h, w) in patches: h and w multiples of the merge size (2), videos up to 3 temporal patches
grids = st.lists(
    st.tuples(
        st.integers(1, 3),
        st.integers(1, 24).map(lambda n: 2 * n),
        st.integers(1, 24).map(lambda n: 2 * n),
    ),
    min_size=1,
    max_size=12,
)


@pytest.mark.parametrize("family", PATCH_GRID_FAMILIES)
@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(batch=grids)
def test_assembled_inputs_equal_the_helpers_over_the_whole_batch(towers, family, batch):
    tower = towers[family]
    inputs = GridInputs(tower, FAMILIES[family].windows, FAMILIES[family].position_table)
    grid_thw = torch.tensor(batch)
    expected = whole_batch(tower, FAMILIES[family], grid_thw)
    assert_same(inputs(grid_thw), expected)
    assert_same(inputs(grid_thw), expected)  # the second time from kept parts, unchanged


def test_a_batch_of_one_repeated_grid_is_one_part(towers):
    tower = towers["qwen2_5_vl"]
    inputs = GridInputs(tower, windows=True)
    grid_thw = torch.tensor([[1, 16, 16]] * 64)
    assert_same(inputs(grid_thw), whole_batch(tower, FAMILIES["qwen2_5_vl"], grid_thw))
    assert list(inputs._parts) == [(1, 16, 16)]


def test_parts_are_kept_within_their_byte_bound(towers):
    tower = towers["qwen3_vl"]
    one = GridInputs(tower, position_table=True).part((1, 32, 32)).nbytes
    inputs = GridInputs(tower, position_table=True, max_bytes=3 * one)
    for side in (32, 30, 28, 26, 24):
        inputs(torch.tensor([[1, side, side]]))
    assert inputs._bytes <= 3 * one
    assert list(inputs._parts)[-1] == (1, 24, 24)  # the latest is kept, the oldest went first
    assert (1, 32, 32) not in inputs._parts


@pytest.mark.parametrize("grid", [(1, 3, 4), (0, 4, 4), (1, 4, 0), (1, 1, 2)])
def test_a_grid_that_is_no_patch_grid_is_refused(towers, grid):
    with pytest.raises(ValueError, match="not a patch grid"):
        GridInputs(towers["qwen2_vl"])(torch.tensor([grid]))
