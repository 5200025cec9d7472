"""The distribution: every package of the project is in it (a wheel or image built with
``pip install .`` imports what the checkout imports), the plain install is the receiver alone,
and the extras and the build backend match the metadata."""

import fnmatch
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# What the wheel installs at the top level: the product card's three packages and the project's
# one package, which holds every other module (no generic top-level name in site-packages).
TOP_LEVEL = {"encode_worker", "prefill_side", "handshake", "epdserve"}


def test_the_top_level_is_the_cards_three_packages_and_the_project_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"}
    assert packages == TOP_LEVEL
    missing = [name for name in packages if not any(fnmatch.fnmatch(name, i) for i in include)]
    assert not missing, f"packages left out of pyproject.toml's include: {missing}"


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# what the receiver must not need: the encoder's model, image and HTTP-server stacks, the bench's
ENCODER_ONLY = {
    "transformers",
    "pillow",
    "av",
    "safetensors",
    "pyzmq",
    "fastapi",
    "uvicorn",
    "tqdm",
    "matplotlib",
}
BLOCKED_MODULES = (
    "transformers",
    "PIL",
    "av",
    "safetensors",
    "zmq",
    "fastapi",
    "starlette",
    "uvicorn",
    "tqdm",
    "matplotlib",
    "torchvision",
)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!\[ ;]", requirement, maxsplit=1)[0].lower()


def test_the_plain_install_is_the_receiver_an_engine_embeds():
    """``pip install epd-encode-worker`` is what an engine needs to receive (and the vLLM connector,
    inside vLLM, which brings transformers itself): none of the encoder's stacks or the bench's.
    Checked two ways: the dependency list, and a receiver that starts and stops in an interpreter
    where every encoder-only module refuses to import."""
    core = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert not core & ENCODER_ONLY, core & ENCODER_ONLY
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert ENCODER_ONLY - {"tqdm", "matplotlib"} <= {_name(r) for r in extras["encoder"]}
    assert {"tqdm", "matplotlib"} <= {_name(r) for r in extras["bench"]}
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys
        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {BLOCKED_MODULES!r}:
                    raise ImportError("encoder-only module " + name)
        sys.meta_path.insert(0, Refuse())
        from epdserve.data_plane.shm_transport import ShmTransport
        from prefill_side import PrefillReceiver, ReceiverConfig
        from epdserve.wire.ec_params import TransferParams
        receiver = PrefillReceiver(
            ReceiverConfig(width=64, dtype="float32", pool_bytes=1 << 20, slot_bytes=1 << 16),
            transports={{"shm": ShmTransport()}},
        )
        print(receiver.offered())
        receiver.close()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "shm" in result.stdout


def test_mooncake_extras_are_one_version_for_each_cuda_and_the_build_backend_reads_the_metadata():
    extras = PYPROJECT["project"]["optional-dependencies"]
    flavours = {name: extras[name] for name in extras if name.startswith("mooncake-")}
    assert set(flavours) == {"mooncake-cpu", "mooncake-cuda12", "mooncake-cuda13"}
    versions = {requirement.split("==")[1] for (requirement,) in flavours.values()}
    assert len(versions) == 1, versions
    # license = "MIT" is a PEP 639 license expression: setuptools reads it from 77 on
    assert isinstance(PYPROJECT["project"]["license"], str)
    (backend,) = PYPROJECT["build-system"]["requires"]
    assert _name(backend) == "setuptools" and int(backend.split(">=")[1].split(".")[0]) >= 77


def test_the_prefill_library_imports_only_downward():
    """What an engine imports (the receiver and its settings) loads no encode worker, dispatcher,
    gateway or HTTP server, and no vision stack; the vLLM connector, none of the project's
    packages above the prefill wing (vLLM brings its own stack)."""
    script = textwrap.dedent(
        """
        import sys
        import prefill_side
        from prefill_side import PrefillReceiver, ReceiverConfig, ReceiverSettings
        from prefill_side.job import ReceiveJob
        from epdserve.wire.ec_params import TransferParams
        def package(name):
            parts = name.split(".")
            return parts[1] if parts[0] == "epdserve" and len(parts) > 1 else parts[0]
        loaded = sorted(
            name for name in sys.modules
            if package(name) in {
                "encode_worker", "dispatcher", "gateway", "vision", "bench",
                "fastapi", "starlette", "uvicorn", "transformers", "PIL", "zmq",
            }
        )
        print("LOADED", loaded)
        import prefill_side.vllm_connector  # inside vLLM: vLLM's own stack, none of ours above
        ours = sorted(
            name for name in sys.modules
            if package(name) in {"encode_worker", "dispatcher", "gateway", "vision", "bench"}
        )
        print("CONNECTOR", ours)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "LOADED []" in result.stdout, result.stdout
    assert "CONNECTOR []" in result.stdout, result.stdout
