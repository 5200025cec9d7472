"""The GPU check's preflight, run in a child process the supervisor can abandon: what the machine
has, each probe on its own (one that fails says why and the others still run), and from that
what the steps can do (``plan.NEEDS``'s keys). Prints the facts as one JSON line, last.

  python3 -m epdserve.bench.gpu.preflight [--dry-run]
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
import traceback

# import name -> distribution name, for every package a step imports (the machine's own, or the
# wheels that travel in .whl/)
PACKAGES = {
    "torch": "torch",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "huggingface_hub": "huggingface-hub",
    "numpy": "numpy",
    "PIL": "pillow",
    "torchvision": "torchvision",
    "av": "av",
    "triton": "triton",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic-core",
    "pydantic_settings": "pydantic-settings",
    "fastapi": "fastapi",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "zmq": "pyzmq",
    "aiohttp": "aiohttp",
    "uvloop": "uvloop",
    "prometheus_client": "prometheus-client",
    "xxhash": "xxhash",
    "msgspec": "msgspec",
    "pynvml": "nvidia-ml-py",
    "mooncake": "mooncake-transfer-engine",
}


def _probe(facts: dict, key: str, fn) -> None:
    """``facts[key] = fn()``, or the error that stopped it."""
    try:
        facts[key] = fn()
    except Exception as exc:  # a probe that fails is a fact too
        facts[key] = {
            "error": f"{type(exc).__name__}: {exc}",
            "trace": traceback.format_exc()[-800:],
        }


def _packages() -> dict:
    out = {}
    for module, distribution in PACKAGES.items():
        if importlib.util.find_spec(module) is None:
            out[module] = None
            continue
        try:
            out[module] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            out[module] = "present (version unknown)"
    return out


def _machine() -> dict:
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "abi": f"cp{sys.version_info.major}{sys.version_info.minor}",
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "dev_shm_gib": round(shm.f_blocks * shm.f_frsize / 2**30, 2) if shm else None,
        "dev_shm_free_gib": round(shm.f_bavail * shm.f_frsize / 2**30, 2) if shm else None,
        "compilers": {name: shutil.which(name) for name in ("cc", "gcc", "clang", "c++", "g++")},
    }


def _torch() -> dict:
    import torch
    import transformers

    out = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "threads": torch.get_num_threads(),
    }
    if out["cuda_available"]:
        properties = torch.cuda.get_device_properties(0)
        out |= {
            "gpus": torch.cuda.device_count(),
            "gpu": properties.name,
            "capability": list(torch.cuda.get_device_capability(0)),
            "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
            "cudnn": torch.backends.cudnn.version(),
        }
    return out


def _nvml() -> dict:
    import pynvml

    pynvml.nvmlInit()
    try:
        return {
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "devices": pynvml.nvmlDeviceGetCount(),
        }
    finally:
        pynvml.nvmlShutdown()


def _tower_paths(dry_run: bool) -> dict:
    import torch

    from epdserve.vision import attention, compilation

    device = "cpu" if dry_run else "cuda"
    compiled, why = (
        compilation.resolve("on", device, "varlen")
        if dry_run
        else compilation.resolve("auto", device, "varlen")
    )
    return {
        "device": device,
        "varlen_kernel": attention.kernel(device, torch.bfloat16, "varlen"),
        "compile": compiled,
        "compile_reason": why,
    }


def _worker_imports() -> bool:
    import encode_worker.worker  # noqa: F401  (every package the worker imports)
    import epdserve.bench.benchmarks.encode  # noqa: F401  (the encode bench and its pipeline)
    import prefill_side  # noqa: F401  (its receiver process)

    return True


def facts(dry_run: bool) -> dict:
    """What this machine has for the check, and which of ``plan.NEEDS`` it meets (each with
    the reason when not)."""
    out: dict = {"dry_run": dry_run}
    _probe(out, "machine", _machine)
    _probe(out, "packages", _packages)
    _probe(out, "torch", _torch)
    _probe(out, "nvml", _nvml)
    _probe(out, "tower_paths", lambda: _tower_paths(dry_run))
    _probe(out, "worker_imports", _worker_imports)
    out["can"] = can(out)
    return out


def can(facts: dict) -> dict[str, str | None]:
    """For each need, None when the machine meets it, else why not."""
    torch_facts, paths = facts.get("torch", {}), facts.get("tower_paths", {})
    reasons: dict[str, str | None] = {}
    reasons["torch_runs"] = torch_facts.get("error") and f"torch: {torch_facts['error']}"
    if reasons["torch_runs"]:
        reasons["tower_runs"] = reasons["torch_runs"]
    elif not facts["dry_run"] and not torch_facts.get("cuda_available"):
        reasons["tower_runs"] = "no CUDA device (torch.cuda.is_available() is False)"
    else:
        reasons["tower_runs"] = None
    if "error" in paths:
        reasons["compile_runs"] = f"cannot resolve --compile: {paths['error']}"
    else:
        reasons["compile_runs"] = None if paths.get("compile") else paths.get("compile_reason")
    worker = facts.get("worker_imports")
    reasons["worker_runs"] = (
        None if worker is True else f"the worker does not import: {worker.get('error')}"
    )
    return reasons


def main() -> int:
    dry_run = "--dry-run" in sys.argv[1:]
    if dry_run:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    print(json.dumps(facts(dry_run), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
