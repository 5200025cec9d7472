"""`epd-bench encode`: the encode worker on its device, side by side with its tower alone, and
what delivery costs it.

**Tower alone** (``--tower-batches``): the tower on pixels already on its device, images/s per
batch size, on the varlen attention path and on transformers' reference loop, the same inputs and
calls otherwise.

**The pipeline** (``encode_pipeline``): the real ``EncodeWorker`` delivering into a
``PrefillReceiver`` in another process (``delivered``) and into a null sink (``null``), its
default batches and batches of 1 item, rounds interleaved, medians and ratios.

**The CPU budget** (``--instant-tower``): the same pipeline around a tower that returns its rows
at once (``towers.instant_tower``), at the GPU's batch budget: the worker's CPU per image by
thread, and the rate one worker process could feed an infinitely fast GPU, with the thread that
stops it first (``cpu_budget.feed_rate``).

The tower: by default a small Qwen2.5-VL-architecture one whose output width is a real one (3584,
as Qwen2.5-VL-7B), so the bytes moved per item are real (448x448 -> 256 rows x 3584: 3.7 MB in
float32, the default on the CPU, where small bf16 towers run several times slower); with
``--full-size``, ``--family``'s released vision config (``bench.towers.FULL_SIZE``), built on
the fly with random weights, for a GPU.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from epdserve.bench.benchmarks import cpu_budget
from epdserve.bench.benchmarks.encode_pipeline import pipeline, print_pipeline
from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.rounds import in_round
from epdserve.bench.benchmarks.towers import (
    DEFAULT_CACHE,
    bench_tower,
    full_size_tower,
    instant_tower,
    noise_images,
    parse_size,
)

TOWER_BATCHES = (1, 8, 32)


def tower_alone(
    towers: dict, images: list[bytes], batches=TOWER_BATCHES, reps: int = 5
) -> dict[str, dict]:
    """Each tower of ``towers`` (name -> VisionTower: the same weights, another attention path)
    on the same prepared pixels, already on its device: images/s per batch size (median of
    ``reps`` calls, each waited for), the paths interleaved per batch size."""
    from epdserve.vision.images import image_from_bytes

    out = {}
    for batch in batches:
        if batch > len(images):
            continue
        first = next(iter(towers.values()))
        inputs = first.processor(
            images=[image_from_bytes(data) for data in images[:batch]], return_tensors="pt"
        )
        pixel_values = inputs["pixel_values"].to(first.device, first.dtype)
        grid_thw = inputs["image_grid_thw"]
        seconds = {name: [] for name in towers}
        for name, tower in towers.items():  # warm-up: kernels chosen, memory grown
            _timed_encode(tower, pixel_values, grid_thw)
        for rep in range(reps):
            for name, tower in in_round(list(towers.items()), rep):
                seconds[name].append(_timed_encode(tower, pixel_values, grid_thw))
        out[f"batch {batch}"] = {
            name: {
                "ms_per_batch": round(1000 * statistics.median(times), 3),
                "images_per_s": round(batch / statistics.median(times), 1),
            }
            for name, times in seconds.items()
        }
    return out


def _timed_encode(tower, pixel_values, grid_thw) -> float:
    started = time.perf_counter()
    out = tower.encode(pixel_values, grid_thw)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return time.perf_counter() - started


def load_towers(args) -> dict:
    """The benchmark's tower, once per attention path asked for (one set of weights on disk),
    and the varlen path compiled (``compiled``) where ``--compile`` resolves on."""
    from epdserve.vision.tower import VisionTower

    if args.full_size:
        directory = os.path.join(DEFAULT_CACHE, f"full-{args.family}-{args.dtype}")
        if not os.path.exists(os.path.join(directory, "model.safetensors")):
            full_size_tower(args.family, directory, args.device, args.dtype)
    else:
        directory = bench_tower(args.depth, args.hidden, args.width)
    towers = {
        path: VisionTower.load(directory, args.dtype, args.device, vision_attention=path)
        for path in args.paths
    }
    if "varlen" in args.paths and args.compile != "off":
        compiled = VisionTower.load(
            directory, args.dtype, args.device, vision_attention="varlen", compile=args.compile
        )
        if compiled.compiled:
            towers["compiled"] = compiled
    return towers


def main(args) -> int:
    from epdserve.data_plane.dtypes import dtype_from_wire
    from epdserve.vision import attention

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    worker_path = attention.resolve(args.vision_attention, args.device, dtype_from_wire(args.dtype))
    if args.instant_tower:
        args.paths, args.compile = [worker_path], "off"
        return budget_main(args, instant_tower(load_towers(args)[worker_path]))
    args.paths = ["varlen", "reference"] if args.tower_batches else [worker_path]
    towers = load_towers(args)
    worker_tower = towers.get("compiled", towers[worker_path])
    print(
        f"epd-bench encode: tower {worker_tower.info.family} "
        f"({'full size' if args.full_size else f'depth {args.depth} hidden {args.hidden}'}, out "
        f"width {worker_tower.info.wire_width}, {args.dtype} on {args.device}, attention "
        f"{worker_tower.attention_kernel}, compiled: {worker_tower.compile_reason}), transport "
        f"{args.transport}, {args.rounds} rounds"
    )
    report = {"device": args.device, "dtype": args.dtype, "family": worker_tower.info.family}
    report["tower"] = (
        {"full_size": args.family}
        if args.full_size
        else {"depth": args.depth, "hidden": args.hidden, "out_width": args.width}
    )
    report["attention"] = {name: tower.attention_kernel for name, tower in towers.items()}
    report["compile"] = worker_tower.compile_reason
    report["sizes"] = {}
    failed = 0
    for size in args.sizes.split(","):
        width, height = parse_size(size)
        images = noise_images(args.items, width, height)
        entry = report["sizes"][size] = {}
        if args.tower_batches:
            batches = tuple(int(b) for b in args.tower_batches.split(","))
            entry["tower_alone"] = tower_alone(towers, images, batches)
            _print_tower(size, entry["tower_alone"])
        single = () if args.no_single else (1,)
        entry["pipeline"] = pipeline(
            worker_tower, images, args.transport, args.rounds, (None, *single)
        )
        print_pipeline(size, entry["pipeline"])
        failed += entry["pipeline"]["failed_items"]
    write_json(args.json, report)
    return 0 if not failed else 1


def gpu_budget_settings() -> dict:
    """The worker's batch budget and preprocessing threads on CUDA (``DEVICE_DEFAULTS``), for a
    worker whose tower runs elsewhere: what it would form and run feeding a GPU."""
    from encode_worker.config import DEVICE_DEFAULTS

    cuda = DEVICE_DEFAULTS["cuda"]
    return {"batch_patches": cuda.batch_patches, "preprocess_workers": cuda.preprocess_workers}


def cpu_budget_run(tower, size: str, items: int, transport: str, rounds: int, progress=print):
    """The pipeline around ``tower`` (an ``instant_tower``) at the GPU's batch budget, with what
    each configuration's CPU per item by thread allows (``cpu_budget.feed_rate``)."""
    from encode_worker.config import DEVICE_DEFAULTS, WorkerConfig

    settings = gpu_budget_settings()
    batch = DEVICE_DEFAULTS["cuda"].batch_items
    images = noise_images(items, *parse_size(size))
    result = pipeline(tower, images, transport, rounds, (batch,), worker_settings=settings,
                      progress=progress)  # fmt: skip
    config = WorkerConfig(model=tower.model_id, bind="127.0.0.1", batch_items=batch, **settings)
    result["settings"] = settings | {"batch_items": batch, "send_workers": config.send_workers}
    result["cpu_budget"] = {
        name: cpu_budget.feed_rate(row["cpu_ms_per_item_by_thread"], config)
        for name, row in result["configs"].items()
    }
    return result


def budget_main(args, tower) -> int:
    print(
        f"epd-bench encode --instant-tower: the worker around a tower that returns at once "
        f"(rows {tower.info.wire_width} wide, {args.dtype}), GPU batch budget, transport "
        f"{args.transport}, {args.items} images per round, {args.rounds} rounds"
    )
    report = {"dtype": args.dtype, "instant_tower": True, "cores": os.cpu_count(), "sizes": {}}
    failed = 0
    for size in args.sizes.split(","):
        result = report["sizes"][size] = cpu_budget_run(
            tower, size, args.items, args.transport, args.rounds
        )
        print_pipeline(size, result)
        for name, budget in result["cpu_budget"].items():
            print(
                f"  {name}: the worker could feed {budget['items_per_s']:.0f} images/s, stopped "
                f"first by {budget['stopped_first_by']} ({budget['worker_ms_per_item']:.2f} ms "
                f"of the worker's CPU per image on {budget['cores']} cores)"
            )
        failed += result["failed_items"]
    write_json(args.json, report)
    return 0 if not failed else 1


def _print_tower(size: str, rows: dict) -> None:
    print(f"\n{size}: tower alone, images/s")
    for batch, paths in rows.items():
        cells = ", ".join(f"{name} {value['images_per_s']:.1f}" for name, value in paths.items())
        ratio = ""
        if "varlen" in paths and "reference" in paths:
            speedup = paths["varlen"]["images_per_s"] / paths["reference"]["images_per_s"]
            ratio = f" (varlen/reference {speedup:.2f})"
        if "compiled" in paths and "varlen" in paths:
            speedup = paths["compiled"]["images_per_s"] / paths["varlen"]["images_per_s"]
            ratio += f" (compiled/varlen {speedup:.2f})"
        print(f"  {batch:9s} {cells}{ratio}")
