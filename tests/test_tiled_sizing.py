"""InternVL's sizing (``sizing.TILED``): an image's tiles and rows from its width and height alone
equal what its processor makes of the image (the tiles in ``pixel_values``, the context tokens in
the prompt: what vLLM's InternVL processor places), for sizes and aspect ratios of every kind and
the tiling's ``min_patches`` / ``max_patches`` / ``crop_to_patches`` settings."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from epdserve.vision.families import FAMILIES, INTERNVL_SMALL_TOKENS
from epdserve.vision.sizing import TILED
from epdserve.vision.small_tokenizers import build_tokenizer
from tests.profiles import examples

FAMILY = FAMILIES["internvl"]


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    """The small InternVL checkpoint's processor: its image processor, tokenizer and tokens."""
    tokenizer = build_tokenizer(str(tmp_path_factory.mktemp("tokenizer")), FAMILY.small_tokens)
    return FAMILY.small_processor(FAMILY.small_image_processor(), tokenizer)


def _made(processor, height: int, width: int, **tiling) -> tuple[int, int]:
    """The tiles and context tokens ``processor`` makes of a ``height x width`` image."""
    image = Image.fromarray(np.full((height, width, 3), 127, dtype=np.uint8))
    out = processor(
        text=FAMILY.small_tokens.image_prompt, images=[image], return_tensors="np", **tiling
    )
    return len(out["pixel_values"]), int((out["input_ids"] == processor.image_token_id).sum())


sides = st.integers(min_value=1, max_value=1200)


@settings(max_examples=examples(100))
@given(
    height=sides,
    width=sides,
    max_patches=st.integers(min_value=1, max_value=12),
    min_share=st.floats(min_value=0.0, max_value=1.0),
    crop=st.booleans(),
)
def test_tiles_and_rows_from_the_size_alone_equal_the_processors(
    processor, height, width, max_patches, min_share, crop
):
    min_patches = max(1, round(max_patches * min_share))
    tiling = dict(min_patches=min_patches, max_patches=max_patches, crop_to_patches=crop)
    image_processor = processor.image_processor
    saved = {name: getattr(image_processor, name) for name in tiling}
    try:
        for name, value in tiling.items():
            setattr(image_processor, name, value)
        grid = TILED.image_grid(image_processor, height, width)
        tiles, tokens = _made(processor, height, width, **tiling)
    finally:
        for name, value in saved.items():
            setattr(image_processor, name, value)
    assert grid[0] == tiles
    assert grid[1] * grid[2] == INTERNVL_SMALL_TOKENS
    assert TILED.rows(grid, image_processor) == tokens == tiles * INTERNVL_SMALL_TOKENS


@pytest.mark.parametrize(
    ("height", "width", "tiles"),
    [(112, 112, 1), (64, 64, 1), (112, 224, 3), (120, 500, 5), (84, 112, 7), (2000, 30, 7)],
)
def test_a_tiled_image_is_its_tiles_and_a_thumbnail(processor, height, width, tiles):
    """A square image small enough is one tile; a wider one is the best grid of up to
    ``max_patches`` (6) tiles and its thumbnail."""
    grid = TILED.image_grid(processor.image_processor, height, width)
    assert grid == (tiles, 4, 4)
    assert _made(processor, height, width) == (tiles, tiles * INTERNVL_SMALL_TOKENS)


def test_a_tile_size_that_is_no_square_token_count_is_refused(processor):
    import copy

    image_processor = copy.deepcopy(processor.image_processor)
    for tokens in (15, None):
        image_processor.image_seq_length = tokens
        with pytest.raises(ValueError, match="not a square"):
            TILED.image_grid(image_processor, 64, 64)
