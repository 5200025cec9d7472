"""``header``'s answer to a file, with the PIL-free readers (``png_size``, ``jpeg_size``,
``webp_size``) and through PIL alone, for the tests that hold the two equal: the header, or the
error's type and text."""

import io
import warnings

from PIL import Image

from epdserve.vision import image_files
from epdserve.vision.image_files import header
from epdserve.vision.limits import MAX_PIXELS

FAST_PATHS = ("png_size", "jpeg_size", "webp_size")


def answer(data: bytes, max_pixels: int = MAX_PIXELS):
    with warnings.catch_warnings():  # PIL warns of corrupt EXIF blocks and MPO indexes
        warnings.simplefilter("ignore")
        try:
            return header(data, max_pixels)
        except ValueError as exc:
            return type(exc), str(exc)


def through_pil(data: bytes, max_pixels: int = MAX_PIXELS):
    """``answer`` with every PIL-free reader turned off."""
    saved = {name: getattr(image_files, name) for name in FAST_PATHS}
    for name in FAST_PATHS:
        setattr(image_files, name, lambda data: None)
    try:
        return answer(data, max_pixels)
    finally:
        for name, reader in saved.items():
            setattr(image_files, name, reader)


def orientation_through_pil(data: bytes) -> int | None:
    """The EXIF orientation PIL finds in a file it opens, as ``header`` reads it through PIL."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as image:
            return image_files._orientation(image)
