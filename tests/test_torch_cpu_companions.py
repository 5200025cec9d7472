"""epdserve.torch_cpu_companions: when it acts (a CPU torch beside CUDA-built companions) and
that it acts in every interpreter of the environment (its .pth), so transformers' Qwen-VL
processors import."""

import subprocess
import sys

import pytest

from epdserve import torch_cpu_companions


def _package(root, name: str, version_py: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    (root / name / "version.py").write_text(version_py)


@pytest.mark.parametrize(
    ("torch_version", "companion_version", "acts"),
    [
        (
            "__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n",
            "0.28.0+cu130",
            True,
        ),
        (
            "__version__ = '2.13.0'\ncuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n",
            "0.28.0+cu130",
            False,
        ),
        (
            "__version__ = '2.13.0'\ncuda: Optional[str] = None\nhip: Optional[str] = '7.0'\n",
            "0.28.0+rocm7.0",
            False,
        ),
        (
            "__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n",
            "0.28.0+cpu",
            False,
        ),
        (None, "0.28.0+cu130", False),
    ],
)
def test_plan_reads_the_version_files(
    tmp_path, monkeypatch, torch_version, companion_version, acts
):
    """Only a CPU build of torch beside ``+cu`` builds of the companions is acted on; a CUDA or
    ROCm torch (a GPU host), CPU-built companions, or no torch at all: nothing."""
    if torch_version is not None:
        _package(tmp_path, "torch", torch_version)
    for name in torch_cpu_companions.COMPANIONS:
        _package(tmp_path, name, f"__version__ = '{companion_version}'\ngit_version = 'abc'\n")
    monkeypatch.setattr(
        sys, "path", [str(tmp_path)]
    )  # these packages alone, not this environment's
    assert torch_cpu_companions.plan() == (list(torch_cpu_companions.COMPANIONS) if acts else [])


def test_acts_in_every_interpreter():
    """A fresh interpreter of this environment has run ``apply()`` (the .pth make installs), did
    what ``plan()`` says, and imports transformers' Qwen2-VL processor stack (torchvision's Python
    code included wherever torchvision is installed)."""
    code = """
import importlib.util, json, sys
import epdserve.torch_cpu_companions as companions
print(json.dumps({"acted": companions._acted, "plan": companions.plan(),
                  "absent": [n for n in ("torchaudio", "torchcodec")
                             if importlib.util.find_spec(n) is None]}))
from transformers import AutoProcessor  # noqa: F401
from transformers.models.qwen2_vl import processing_qwen2_vl  # noqa: F401
if importlib.util.find_spec("torchvision") is not None:
    import torchvision.transforms.v2  # noqa: F401
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    import json

    report = json.loads(result.stdout.splitlines()[0])
    assert report["acted"] is not None, (
        "the .pth is not installed here: python -m epdserve.torch_cpu_companions install"
    )
    assert report["acted"] == report["plan"]
    for name in ("torchaudio", "torchcodec"):
        assert (name in report["absent"]) or name not in report["plan"]


def test_torchvision_schemas_defined_elsewhere_are_kept():
    """A process that defined torchvision's two schemas itself (another shim, a sitecustomize)
    still imports torchvision: the schemas are defined only where missing."""
    if "torchvision" not in torch_cpu_companions.plan():
        pytest.skip(
            "torchvision here is not a CUDA build beside CPU torch: nothing for the shim to define"
        )
    code = """
import torch
library = torch.library.Library("torchvision", "FRAGMENT")
library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
import torchvision.transforms.v2  # noqa: F401
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
