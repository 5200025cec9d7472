"""InternVL's sizing (``sizing.TILED``): an image's tiles and rows from its width and height alone
equal what its processor makes of the image (the tiles in ``pixel_values``, the context tokens in
the prompt: what vLLM's InternVL processor places), for sizes and aspect ratios of every kind and
the tiling's ``min_patches`` / ``max_patches`` / ``crop_to_patches`` settings; and an image
processor loaded alone from a checkpoint in the hub's layout tiles and counts as its processor
does (``vision.image_processor``)."""

import os

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


@pytest.fixture(scope="module")
def untiled_config(tmp_path_factory):
    """The small InternVL checkpoint's configs (no weights) with ``crop_to_patches`` false in its
    image processor's config (InternVL's processor tiles all the same: its own default) and the
    rows per tile (``image_seq_length``) in its processor's config only, which names no image
    processor of its own (the hub's layout: transformers 5 nests one there, read first)."""
    import json
    import shutil

    from epdserve.vision.vlm_checkpoints import cached_vlm

    source, directory = cached_vlm("internvl"), tmp_path_factory.mktemp("untiled")
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(source, name), directory)
    path = directory / "preprocessor_config.json"
    config = json.loads(path.read_text())
    del config["image_seq_length"]  # the rows per tile: the processor's config's alone
    path.write_text(json.dumps({**config, "crop_to_patches": False}))
    processor = {"image_seq_length": INTERNVL_SMALL_TOKENS, "processor_class": "InternVLProcessor"}
    (directory / "processor_config.json").write_text(json.dumps(processor))
    return str(directory)


@pytest.mark.parametrize(
    ("kwargs", "tiles"), [({}, 5), ({"max_patches": 2}, 3), ({"crop_to_patches": False}, 1)]
)
def test_the_image_processor_tiles_as_its_model_processor_does(untiled_config, kwargs, tiles):
    """Loaded alone, the image processor takes InternVL's processor's ``crop_to_patches`` over
    its config, ``--mm-processor-kwargs`` over both, and the processor's rows per tile: its sizing
    and its tiles are the processor's (as vLLM calls it), and its settings are the ones the
    engine's fingerprint reads off the image processor vLLM builds."""
    from transformers import AutoImageProcessor, InternVLProcessor

    from epdserve.fingerprints import as_its_processor_applies, processor_settings
    from epdserve.vision.image_processor import load_image_processor

    image_processor = load_image_processor(untiled_config, kwargs)
    processor = InternVLProcessor.from_pretrained(untiled_config)
    assert TILED.image_grid(image_processor, 120, 500) == (tiles, 4, 4)
    assert _made(processor, 120, 500, **kwargs) == (tiles, tiles * INTERNVL_SMALL_TOKENS)
    image = Image.fromarray(np.zeros((120, 500, 3), dtype=np.uint8))
    assert len(image_processor(images=[image])["pixel_values"]) == tiles
    engines = AutoImageProcessor.from_pretrained(untiled_config, **kwargs)
    assert engines.image_seq_length is None
    applied = as_its_processor_applies(engines, processor, kwargs)
    assert processor_settings(applied) == processor_settings(image_processor)
