"""`make gpu-check`: the encode worker on a lent GPU, in one run of at most five minutes, with no
network (the wheels the machine lacks travel in ``.whl/``: ``make gpu-wheels``).

  python3 -m epdserve.bench.gpu_check OUT_DIR          # on the GPU machine: cuda, bfloat16
  python3 -m epdserve.bench.gpu_check OUT_DIR --small  # small towers on the CPU: a dry run

For Qwen2.5-VL-7B's, Qwen2-VL-7B's and Qwen3-VL-8B's full-size vision towers (random weights,
built on the GPU), in that order of importance, each step saved to ``OUT_DIR/gpu-check.json`` as it
ends (a failing step is recorded and the next one runs; steps past the time budget are skipped):

* ``exact``: the varlen path against transformers' reference loop on one batch (cosine, max abs
  difference), an item in a batch against the item alone, and images resized and normalised on
  the GPU (``--preprocess-device tower``) against the CPU processor;
* ``tower``: the tower alone, varlen and reference, images/s at 224x224, 448x448, 896x896 and
  1280x720, batches of 1, 8 and 32 (``bench.encode.tower_alone``);
* ``pipeline``: the real worker delivering into a receiver process over SHM against a null sink,
  at the device's default batch budget: images/s, GPU busy %, CPU per item, batches formed
  (``bench.encode.pipeline``); for Qwen2.5-VL also with preprocessing on the GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

SMALL = "--small" in sys.argv
DEVICE = "cpu" if SMALL else "cuda"
DTYPE = "float32" if SMALL else "bfloat16"
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", "270"))
FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")
SIZES = ("224", "448", "896", "1280x720") if not SMALL else ("112", "160x112")
TOWER_BATCHES = (1, 8, 32) if not SMALL else (1, 4)
# Images per pipeline round, by size: about a second of the GPU each at the goals' rates.
PIPELINE_ITEMS = {"224": 512, "448": 256, "896": 48, "1280x720": 48}
T0 = time.monotonic()


def log(*args) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s]", *args, flush=True)


class Report:
    """The run's JSON, written again after every step."""

    def __init__(self, path: str):
        self.path = path
        self.data: dict = {"small": SMALL, "device": DEVICE, "dtype": DTYPE, "errors": {}}

    def step(self, name: str, fn, *args):
        if time.monotonic() - T0 > BUDGET_S:
            self.data["errors"][name] = "skipped: time budget"
            log(f"skip {name}: time budget")
            return None
        log(f"== {name}")
        try:
            result = fn(*args)
        except Exception:
            self.data["errors"][name] = traceback.format_exc()[-3000:]
            log(f"FAILED {name}:\n{self.data['errors'][name]}")
            result = None
        else:
            self.set(name, result)
        self.save()
        return result

    def set(self, name: str, value) -> None:
        node = self.data
        *parents, leaf = name.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)


def environment() -> dict:
    import transformers

    from epdserve.vision import attention

    out = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cores": os.cpu_count(),
        "varlen_kernel": attention.kernel(DEVICE, getattr(torch, DTYPE), "varlen"),
    }
    if DEVICE == "cuda":
        out |= {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    log(out)
    return out


def build(family: str, directory: str) -> dict:
    from epdserve.bench.benchmarks.towers import full_size_tower
    from epdserve.vision.small_checkpoints import build_vision_only

    started = time.monotonic()
    if SMALL:
        build_vision_only(family, directory, out_width=256, depth=2, width=64)
        built = {"family": family, "small": True}
    else:
        built = full_size_tower(family, directory, DEVICE, DTYPE)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return built | {"seconds": round(time.monotonic() - started, 1)}


def load(directory: str) -> dict:
    from epdserve.vision.tower import VisionTower

    return {
        path: VisionTower.load(directory, DTYPE, DEVICE, vision_attention=path)
        for path in ("varlen", "reference")
    }


def exact(towers: dict) -> dict:
    """Rows of the varlen path against the reference's, batched against alone, and of images
    preprocessed on the device against the CPU's processor."""
    import numpy as np

    from epdserve.bench.benchmarks.towers import parse_size
    from epdserve.testing.images import synthetic_image
    from epdserve.vision.images import image_from_bytes

    varlen, reference = towers["varlen"], towers["reference"]
    datas = [synthetic_image(*parse_size(size), seed) for seed, size in enumerate(SIZES)]
    datas.append(synthetic_image(640, 480, 9, "JPEG"))
    images = [image_from_bytes(data) for data in datas]
    inputs = varlen.processor(images=images, return_tensors="pt")
    grid = inputs["image_grid_thw"]
    batched = varlen.encode(inputs["pixel_values"], grid).float().cpu()
    against = reference.encode(inputs["pixel_values"], grid).float().cpu()
    out = {"varlen_vs_reference": _compare(batched, against)}
    alone, on_device = [], []
    for image in images:
        one = varlen.processor(images=[image], return_tensors="pt")
        alone.append(varlen.encode(one["pixel_values"], one["image_grid_thw"]).float().cpu())
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).to(DEVICE)
        gpu = varlen.processor(images=[pixels], device=torch.device(DEVICE), return_tensors="pt")
        pixel_diff = (gpu["pixel_values"].cpu() - one["pixel_values"]).abs().max().item()
        rows = varlen.encode(gpu["pixel_values"], gpu["image_grid_thw"].cpu()).float().cpu()
        on_device.append({"pixel_max_abs": pixel_diff} | _compare(rows, alone[-1]))
    out["batched_vs_alone"] = _compare(batched, torch.cat(alone))
    out["batched_vs_alone"]["bit_equal_items"] = sum(
        torch.equal(a, b) for a, b in zip(torch.split(batched, [a.shape[0] for a in alone]), alone)
    )
    out["preprocess_on_device_vs_cpu"] = on_device
    log(json.dumps(out, default=str)[:600])
    return out


def _compare(got: torch.Tensor, expected: torch.Tensor) -> dict:
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=1)
    return {
        "cosine_min": cosine.min().item(),
        "max_abs_diff": (got - expected).abs().max().item(),
        "mean_abs_value": expected.abs().mean().item(),
    }


def tower(towers: dict, size: str) -> dict:
    from epdserve.bench.benchmarks.encode import tower_alone
    from epdserve.bench.benchmarks.towers import noise_images, parse_size

    images = noise_images(max(TOWER_BATCHES), *parse_size(size))
    result = tower_alone(towers, images, TOWER_BATCHES, reps=3)
    log(size, result)
    return result


def pipeline(worker_tower, size: str, settings: dict | None = None) -> dict:
    from epdserve.bench.benchmarks.encode import pipeline as run_pipeline
    from epdserve.bench.benchmarks.towers import noise_images, parse_size

    items = PIPELINE_ITEMS.get(size, 24) if not SMALL else 24
    images = noise_images(items, *parse_size(size))
    result = run_pipeline(
        worker_tower,
        images,
        "shm",
        rounds=2 if SMALL else 3,
        batches=(None,),
        pool_bytes=(1 << 30) if not SMALL else (256 << 20),
        worker_settings=settings,
        progress=log,
    )
    log(size, {k: v["items_per_s"] for k, v in result["configs"].items()}, result["ratios"])
    return result


def main() -> int:
    out_dir = next((arg for arg in sys.argv[1:] if not arg.startswith("--")), ".")
    os.makedirs(out_dir, exist_ok=True)
    report = Report(os.path.join(out_dir, "gpu-check.json"))
    report.step("env", environment)
    scratch = "/tmp/epd-gpu-check" if not SMALL else os.path.join(out_dir, "towers")
    for family in FAMILIES:
        directory = os.path.join(scratch, family)
        if report.step(f"{family}/build", build, family, directory) is None:
            continue
        towers = report.step(f"{family}/load", load, directory)
        if towers is None:
            continue
        report.set(f"{family}/load", {name: t.attention_kernel for name, t in towers.items()})
        report.step(f"{family}/exact", exact, towers)
        sizes = SIZES if family == "qwen2_5_vl" else SIZES[:2]
        for size in sizes:
            report.step(f"{family}/tower/{size}", tower, towers, size)
        for size in sizes:
            report.step(f"{family}/pipeline/{size}", pipeline, towers["varlen"], size)
        if family == "qwen2_5_vl":
            report.step(
                f"{family}/pipeline_preprocess_on_device/{SIZES[1]}",
                pipeline,
                towers["varlen"],
                SIZES[1],
                {"preprocess_device": "tower"},
            )
        del towers
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    report.data["seconds"] = round(time.monotonic() - T0, 1)
    report.save()
    log("done; errors:", list(report.data["errors"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
