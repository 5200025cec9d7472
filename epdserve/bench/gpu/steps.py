"""The GPU check's measurements, one function per kind of step (``plan.Step.kind``), run by the
runner in order. Each takes the run's ``State`` (towers built once per runner, from the disk and
the compile cache) and its step's ``Report`` (``partial`` writes what it has so far, after every
size or round), and returns its result; ``headline`` in a result is what the summary shows.

* ``build``: the family's full-size vision-only checkpoint (random weights; small on a dry run);
* ``compile``: the varlen tower compiled and warmed up over the worker's GPU batch budget;
* ``exact``: the varlen path against transformers' reference loop, compiled against eager, an
  item in a batch against the item alone, and images preprocessed on the device against the
  CPU's processor;
* ``tower``: the tower alone, as throughput (``calls`` encodes queued back to back between CUDA
  events), compiled / eager varlen / reference interleaved, medians, at the batch sizes the
  worker forms (64 of 224x224, 32 of 448x448) and below; achieved TFLOP/s and % of the card's
  peak from the forward's FLOPs (``flops``);
* ``pipeline``: the real worker delivering into a receiver process over SHM and into a null sink
  at the same batch sizes (``bench.benchmarks.encode_pipeline.pipeline``), and delivered / tower
  alone; the GPU's busy share from the batches' CUDA events, NVML's beside it, CPU per image by
  thread;
* ``cpu_budget``: the worker around a tower that returns at once, on this machine's CPU: what
  it could feed an infinitely fast GPU, and which thread stops it first.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from epdserve.bench.gpu.flops import forward_flops, peak_tflops

SMALL_TOWER = dict(out_width=256, depth=2, width=64)
WORKER_BUDGET = dict(batch_items=64, batch_patches=32768)  # DEVICE_DEFAULTS["cuda"]


@dataclass(frozen=True)
class Scale:
    """What a run measures: the GPU's sizes, or a dry run's smaller ones on the CPU."""

    device: str
    dtype: str
    small: bool
    tower_batches: dict[str, tuple[int, ...]]  # image size -> batch sizes, the worker's last
    other_families_batches: dict[str, tuple[int, ...]]
    pipeline: dict[str, tuple[int, int]]  # image size -> (batch items, images per round)
    rounds: int
    images_per_measurement: int  # a throughput measurement queues this many images' calls
    cpu_budget_items: dict[str, int]


GPU = Scale(
    "cuda",
    "bfloat16",
    False,
    tower_batches={"224": (1, 8, 64), "448": (1, 8, 32)},
    other_families_batches={"224": (64,), "448": (32,)},
    pipeline={"224": (64, 512), "448": (32, 256)},
    rounds=3,
    images_per_measurement=128,
    cpu_budget_items={"224": 512, "448": 256},
)
DRY_RUN = Scale(
    "cpu",
    "float32",
    True,
    tower_batches={"224": (1, 4), "448": (1, 2)},
    other_families_batches={"224": (4,)},
    pipeline={"224": (4, 8), "448": (2, 4)},
    rounds=2,
    images_per_measurement=4,
    cpu_budget_items={"224": 16},  # one size: each starts a receiver process
)


class Report:
    """A step's JSON file, written again (atomically) whenever it has more to say."""

    def __init__(self, path: str, step: str):
        self.path = path
        self.data: dict = {"step": step, "status": "running", "started": time.time()}
        self.write()

    def partial(self, **result) -> None:
        self.data.setdefault("result", {}).update(result)
        self.write()

    def end(self, status: str, started: float, **fields) -> None:
        self.data.update(status=status, seconds=round(time.monotonic() - started, 2), **fields)
        self.write()

    def write(self) -> None:
        temporary = f"{self.path}.tmp"
        with open(temporary, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(temporary, self.path)


@dataclass
class State:
    """What the steps of one runner share: checkpoints on the disk, towers loaded once."""

    scale: Scale
    scratch: str
    steps_dir: str  # earlier steps' results, read by later ones (delivered / tower alone)
    eager_only: set[str] = field(default_factory=set)  # families whose compile must not run
    log: object = print
    _towers: dict = field(default_factory=dict)

    def checkpoint(self, family: str) -> tuple[str, dict]:
        """The family's checkpoint directory, built unless it is there; what was built."""
        from epdserve.bench.benchmarks.towers import full_size_tower
        from epdserve.vision.small_checkpoints import build_vision_only

        directory = os.path.join(self.scratch, "small" if self.scale.small else "full", family)
        marker = os.path.join(directory, "built.json")
        if os.path.exists(marker):
            with open(marker) as f:
                return directory, json.load(f) | {"reused": True}
        if self.scale.small:
            build_vision_only(family, directory, **SMALL_TOWER)
            built = {"family": family, "small": SMALL_TOWER}
        else:
            built = full_size_tower(family, directory, self.scale.device, self.scale.dtype)
            torch.cuda.empty_cache()
        with open(marker, "w") as f:
            json.dump(built, f)
        return directory, built | {"reused": False}

    def tower(self, family: str, path: str):
        """The family's tower on ``path``: ``varlen``, ``reference`` (eager) or ``compiled``
        (varlen, compiled and warmed up at the worker's budget; None where compiling is off)."""
        from epdserve.vision.tower import VisionTower

        key = (family, path)
        if key not in self._towers:
            if path == "compiled" and family in self.eager_only:
                return None
            directory, _ = self.checkpoint(family)
            attention = "reference" if path == "reference" else "varlen"
            tower = VisionTower.load(
                directory,
                self.scale.dtype,
                self.scale.device,
                vision_attention=attention,
                compile="on" if path == "compiled" else "off",
                compile_cache_dir=os.path.join(self.scratch, "compile-cache"),
            )
            if path == "compiled":
                tower.warmed_up = tower.warm_up(**WORKER_BUDGET)
            self._towers[key] = tower
        return self._towers[key]

    def paths(self, family: str) -> list[str]:
        """The paths a family's steps compare: compiled where it compiled, the eager ones."""
        compiled = [] if family in self.eager_only else ["compiled"]
        return [*compiled, "varlen", "reference"]

    def release(self, family: str) -> None:
        """Drop the family's towers (another family's go on the same card)."""
        for key in [key for key in self._towers if key[0] == family]:
            del self._towers[key]
        if self.scale.device == "cuda":
            torch.cuda.empty_cache()

    def earlier(self, step: str) -> dict:
        """An earlier step's result (this run's file), or {}."""
        suffix = f"-{step.replace('/', '-')}.json"
        for name in sorted(os.listdir(self.steps_dir)):
            if name.endswith(suffix):
                with open(os.path.join(self.steps_dir, name)) as f:
                    return json.load(f).get("result", {})
        return {}


def build(state: State, family: str, report: Report) -> dict:
    started = time.monotonic()
    directory, built = state.checkpoint(family)
    return built | {"directory": directory, "seconds": round(time.monotonic() - started, 1)}


def compile_step(state: State, family: str, report: Report) -> dict:
    from torch._dynamo.utils import counters

    started = time.monotonic()
    tower = state.tower(family, "compiled")
    cache = os.path.join(state.scratch, "compile-cache")
    size = sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(cache)
        for name in names
    )
    warmed_up = tower.warmed_up or {}
    return {
        "compiled": tower.compiled,
        "reason": tower.compile_reason,
        "seconds": round(time.monotonic() - started, 1),
        "warm_up": warmed_up,
        "inductor_cache": {k: v for k, v in counters["inductor"].items() if "cache" in k},
        "cache_dir_mib": round(size / 2**20, 1),
        "headline": {
            f"{family} compile + warm-up s": round(time.monotonic() - started, 1),
            f"{family} graphs compiled": warmed_up.get("graphs_compiled"),
        },
    }


def _compare(got: torch.Tensor, expected: torch.Tensor) -> dict:
    got, expected = got.float().cpu(), expected.float().cpu()
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=1)
    return {
        "cosine_min": cosine.min().item(),
        "max_abs_diff": (got - expected).abs().max().item(),
        "mean_abs_value": expected.abs().mean().item(),
    }


def exact(state: State, family: str, report: Report) -> dict:
    import numpy as np

    from epdserve.bench.benchmarks.towers import parse_size
    from epdserve.testing.images import synthetic_image
    from epdserve.vision.images import image_from_bytes

    varlen, reference = state.tower(family, "varlen"), state.tower(family, "reference")
    compiled = state.tower(family, "compiled")
    sizes = ("224", "448", "1280x720", "300x500")
    images = [
        image_from_bytes(synthetic_image(*parse_size(s), seed)) for seed, s in enumerate(sizes)
    ]
    inputs = varlen.processor(images=images, return_tensors="pt")
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    batched = varlen.encode(pixels, grid)
    out = {"varlen_vs_reference": _compare(batched, reference.encode(pixels, grid))}
    if compiled is not None:
        out["compiled_vs_varlen"] = _compare(compiled.encode(pixels, grid), batched)
    report.partial(**out)
    worker = compiled or varlen
    batched = worker.encode(pixels, grid)
    alone, on_device = [], []
    for image in images:
        one = worker.processor(images=[image], return_tensors="pt")
        alone.append(worker.encode(one["pixel_values"], one["image_grid_thw"]).float().cpu())
        device = torch.device(state.scale.device)
        uint8 = torch.from_numpy(np.array(image)).permute(2, 0, 1).to(device)
        there = worker.processor(images=[uint8], device=device, return_tensors="pt")
        rows = worker.encode(there["pixel_values"], there["image_grid_thw"].cpu())
        pixel_diff = (there["pixel_values"].cpu() - one["pixel_values"]).abs().max().item()
        on_device.append({"pixel_max_abs": pixel_diff} | _compare(rows, alone[-1]))
    out["batched_vs_alone"] = _compare(batched, torch.cat(alone)) | {
        "path": "compiled" if compiled is not None else "varlen",
        "bit_equal_items": sum(
            torch.equal(a, b)
            for a, b in zip(torch.split(batched.float().cpu(), [a.shape[0] for a in alone]), alone)
        ),
        "items": len(alone),
    }
    out["preprocess_on_device_vs_cpu"] = on_device
    headline = {f"{family} varlen vs reference cosine": out["varlen_vs_reference"]["cosine_min"]}
    if compiled is not None:
        headline[f"{family} compiled vs eager cosine"] = out["compiled_vs_varlen"]["cosine_min"]
    return out | {"headline": headline}


def throughput(tower, pixel_values: torch.Tensor, grid_thw: torch.Tensor, calls: int) -> dict:
    """``calls`` encodes of one batch queued back to back (the CPU's work for each overlapping
    the GPU's for the ones before it), timed between CUDA events around each call: the span
    from the first one's start to the last one's end, the GPU's busy time within it (the calls'
    own spans summed), and the wall time. On the CPU, wall times."""
    if pixel_values.is_cuda:
        torch.cuda.synchronize()
        marks = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(calls)
        ]
        began = time.perf_counter()
        for start, end in marks:
            start.record()
            tower.encode(pixel_values, grid_thw)
            end.record()
        marks[-1][1].synchronize()
        wall = time.perf_counter() - began
        span = marks[0][0].elapsed_time(marks[-1][1]) / 1000
        busy = sum(start.elapsed_time(end) for start, end in marks) / 1000
    else:
        began = time.perf_counter()
        for _ in range(calls):
            tower.encode(pixel_values, grid_thw)
        span = busy = wall = time.perf_counter() - began
    return {"span_s": span, "busy_s": busy, "wall_s": wall}


def tower(state: State, family: str, report: Report) -> dict:
    from epdserve.bench.benchmarks.rounds import in_round
    from epdserve.bench.benchmarks.towers import noise_images, parse_size
    from epdserve.vision.families import FAMILIES
    from epdserve.vision.images import image_from_bytes

    scale = state.scale
    batches = scale.tower_batches if family == "qwen2_5_vl" else scale.other_families_batches
    towers = {path: state.tower(family, path) for path in state.paths(family)}
    towers = {path: t for path, t in towers.items() if t is not None}
    gpu = torch.cuda.get_device_name(0) if scale.device == "cuda" else None
    peak = peak_tflops(gpu)
    out: dict = {"gpu": gpu, "peak_bf16_tflops": peak, "paths": list(towers)}
    headline = {}
    for size, sizes in batches.items():
        images = [image_from_bytes(data) for data in noise_images(max(sizes), *parse_size(size))]
        for batch in sizes:
            first = next(iter(towers.values()))
            inputs = first.processor(images=images[:batch], return_tensors="pt")
            pixels = inputs["pixel_values"].to(first.device, first.dtype)
            grid = inputs["image_grid_thw"]
            calls = max(2, min(16, scale.images_per_measurement // batch))
            flops = forward_flops(first.model, grid, FAMILIES[family].windows)
            for t in towers.values():  # warm-up: kernels chosen, memory grown
                throughput(t, pixels, grid, 1)
            runs: dict[str, list[dict]] = {path: [] for path in towers}
            for index in range(scale.rounds):
                for path, t in in_round(list(towers.items()), index):
                    runs[path].append(throughput(t, pixels, grid, calls))
            row = {}
            for path, measured in runs.items():
                span = statistics.median(m["span_s"] for m in measured)
                tflops = flops * calls / span / 1e12
                row[path] = {
                    "images_per_s": round(batch * calls / span, 1),
                    "ms_per_batch": round(1000 * span / calls, 3),
                    "gpu_busy_in_span": round(
                        statistics.median(m["busy_s"] / m["span_s"] for m in measured), 3
                    ),
                    "wall_images_per_s": round(
                        batch * calls / statistics.median(m["wall_s"] for m in measured), 1
                    ),
                    "tflops": round(tflops, 2),
                    "percent_of_peak": round(100 * tflops / peak, 1) if peak else None,
                }
            row["flops_per_batch"] = flops
            row["calls_per_measurement"] = calls
            out[f"{size} batch {batch}"] = row
            state.log(
                f"{family} tower {size} batch {batch}: "
                + ", ".join(f"{p} {row[p]['images_per_s']}/s" for p in towers)
            )
            report.partial(**{f"{size} batch {batch}": row})
        worker_batch = sizes[-1]
        for path in towers:
            headline[f"{family} tower alone {size} (batch {worker_batch}) {path} images/s"] = out[
                f"{size} batch {worker_batch}"
            ][path]["images_per_s"]
    return out | {"headline": headline}


def pipeline(state: State, family: str, report: Report) -> dict:
    from epdserve.bench.benchmarks.encode_pipeline import pipeline as run_pipeline
    from epdserve.bench.benchmarks.towers import noise_images, parse_size

    scale = state.scale
    path = "compiled" if state.tower(family, "compiled") is not None else "varlen"
    worker_tower = state.tower(family, path)
    alone = state.earlier(f"{family}/tower")
    out: dict = {"path": path}
    headline = {}
    for size, (batch, items) in scale.pipeline.items():
        result = run_pipeline(
            worker_tower,
            noise_images(items, *parse_size(size)),
            "shm",
            rounds=scale.rounds,
            batches=(batch,),
            worker_settings={"batch_patches": WORKER_BUDGET["batch_patches"]},
            progress=state.log,
        )
        delivered = result["configs"]["delivered_batched"]
        tower_rate = alone.get(f"{size} batch {batch}", {}).get(path, {}).get("images_per_s")
        result["delivered_over_tower_alone"] = (
            round(delivered["items_per_s"] / tower_rate, 3) if tower_rate else None
        )
        result["tower_alone_images_per_s"] = tower_rate
        out[size] = result
        report.partial(**{size: result})
        headline |= {
            f"{family} delivered {size} (batch {batch}) images/s": round(
                delivered["items_per_s"], 1
            ),
            f"{family} delivered / tower alone {size}": result["delivered_over_tower_alone"],
            f"{family} GPU busy while delivering {size} % (CUDA events)": delivered[
                "gpu_busy_percent"
            ],
            f"{family} NVML busy while delivering {size} %": delivered["nvml_busy_percent"],
        }
    return out | {"headline": headline}


def cpu_budget(state: State, family: str | None, report: Report) -> dict:
    from epdserve.bench.benchmarks.encode import cpu_budget_run
    from epdserve.bench.benchmarks.towers import bench_tower, instant_tower
    from epdserve.vision.tower import VisionTower

    # The tower never runs: a small one with Qwen2.5-VL-7B's row width (3584) in the GPU's dtype,
    # so the bytes staged per image are the real ones; no GPU needed.
    directory = bench_tower(depth=1, hidden=64, width=3584)
    tower = instant_tower(VisionTower.load(directory, "bfloat16", "cpu", vision_attention="varlen"))
    out: dict = {"cores": os.cpu_count()}
    headline = {}
    for size, items in state.scale.cpu_budget_items.items():
        result = cpu_budget_run(tower, size, items, "shm", state.scale.rounds, state.log)
        out[size] = result
        report.partial(**{size: result})
        budget = result["cpu_budget"]["delivered_batched"]
        headline[f"worker CPU budget {size}: images/s one worker could feed"] = budget[
            "items_per_s"
        ]
        headline[f"worker CPU budget {size}: stopped first by"] = budget["stopped_first_by"]
    return out | {"headline": headline}


KINDS = {
    "build": build,
    "compile": compile_step,
    "exact": exact,
    "tower": tower,
    "pipeline": pipeline,
    "cpu_budget": cpu_budget,
}
