"""``header``'s answer to a file, and Pillow's own reading of it spelled apart from ``header``, for
the tests that hold the two equal: the displayed size and format, or the kind of refusal."""

import io
import warnings

from PIL import Image

from epdserve.vision.image_files import FormatNotTaken, TooLarge, header
from epdserve.vision.limits import IMAGE_FORMATS, MAX_PIXELS, MAX_SIDE

ORIENTATION = 0x0112  # EXIF Orientation
QUARTER_TURNS = {5, 6, 7, 8}


def answer(data: bytes, max_pixels: int = MAX_PIXELS):
    """``header``'s (width, height, format), or the type of the error it raised."""
    with warnings.catch_warnings():  # PIL warns of corrupt EXIF blocks and MPO indexes
        warnings.simplefilter("ignore")
        try:
            return tuple(header(data, max_pixels))
        except ValueError as exc:
            return type(exc)


def through_pil(data: bytes, max_pixels: int = MAX_PIXELS):
    """What Pillow reads of the file, as ``answer`` puts it: ``Image.open``'s size, turned by the
    orientation ``getexif`` finds (none in a PNG without an eXIf chunk before its image data, and
    none in an EXIF block Pillow cannot read), and its format; ``ValueError`` for a file Pillow
    does not open, ``FormatNotTaken`` for a format encode workers do not decode, ``TooLarge``
    above ``max_pixels`` or ``MAX_SIDE`` a side."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            image = Image.open(io.BytesIO(data))
        except Exception:
            return ValueError
        with image:
            if image.format not in IMAGE_FORMATS:
                return FormatNotTaken
            width, height = image.size
            if width > MAX_SIDE or height > MAX_SIDE or width * height > max_pixels:
                return TooLarge
            if _orientation(image) in QUARTER_TURNS:
                width, height = height, width
            return width, height, image.format


def orientation_through_pil(data: bytes) -> int | None:
    """The EXIF orientation Pillow finds in a file it opens."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as image:
            return _orientation(image)


def _orientation(image: Image.Image) -> int | None:
    if image.format == "PNG" and "exif" not in image.info:
        return None
    try:
        return image.getexif().get(ORIENTATION)
    except Exception:  # an EXIF block Pillow cannot read holds no orientation
        return None
