"""`epd-bench patch-embed`: the towers' patch embedding as transformers runs it (a ``Conv3d``
whose stride is its kernel) against one matrix product (``vision.patch_embedding``), on the
tower's device, for each family's full-size geometry (random weights), float32 and bfloat16.

Per configuration: ms per call of each (interleaved, median of ``rounds``, after a warm-up), and
each one's error against the same convolution computed in float64 from the same inputs and
weights (max abs error over max abs value), so the two are compared with the exact result rather
than with each other.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from epdserve.bench.benchmarks.grid_inputs import meta_tower
from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.rounds import in_round
from epdserve.vision.families import PATCH_GRID_FAMILIES
from epdserve.vision.patch_embedding import matmul_forward

# (name, patches): batches of images at 14-pixel patches (Qwen3-VL's 16 give fewer)
BATCHES = (("8 x 224x224", 8 * 256), ("8 x 448x448", 8 * 1024))
DTYPES = ("float32", "bfloat16")


def patch_embedding(name: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """``name``'s full-size patch embedding (its tower's own module) with random weights."""
    embed = meta_tower(name).patch_embed.to_empty(device=device)
    torch.manual_seed(0)
    torch.nn.init.normal_(embed.proj.weight, std=0.02)
    if embed.proj.bias is not None:
        torch.nn.init.normal_(embed.proj.bias, std=0.02)
    return embed.to(dtype).eval()


def _error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).abs().max() / exact.abs().max()).item()


def measure(name: str, dtype: str, patches: int, device: str, rounds: int) -> dict:
    torch_dtype = getattr(torch, dtype)
    embed = patch_embedding(name, torch_dtype, device)
    width = embed.proj.weight[0].numel()
    pixels = torch.randn(patches, width, device=device).to(torch_dtype)
    ways = {"conv3d": embed, "matmul": lambda x: matmul_forward(embed, x)}
    with torch.inference_mode():
        outs = {way: fn(pixels) for way, fn in ways.items()}  # warm-up, and the outputs compared
        exact = F.conv3d(
            pixels.double().view(-1, *embed.proj.weight.shape[1:]),
            embed.proj.weight.double(),
            None if embed.proj.bias is None else embed.proj.bias.double(),
            stride=embed.proj.stride,
        ).view(patches, -1)
        times: dict[str, list[float]] = {way: [] for way in ways}
        for index in range(rounds):
            for way, fn in in_round(list(ways.items()), index):
                _sync(device)
                started = time.perf_counter()
                fn(pixels)
                _sync(device)
                times[way].append(1000 * (time.perf_counter() - started))
    conv_ms, matmul_ms = (statistics.median(times[way]) for way in ways)
    return {
        "conv3d_ms": round(conv_ms, 3),
        "matmul_ms": round(matmul_ms, 3),
        "speedup": round(conv_ms / matmul_ms, 2),
        "conv3d_error": _error(outs["conv3d"], exact),
        "matmul_error": _error(outs["matmul"], exact),
        "bit_equal": torch.equal(outs["conv3d"], outs["matmul"]),
    }


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run(device: str = "cpu", rounds: int = 5, families=PATCH_GRID_FAMILIES, progress=print) -> dict:
    report: dict = {"device": device, "rounds": rounds, "threads": torch.get_num_threads()}
    for name in families:
        report[name] = {}
        for dtype in DTYPES:
            for label, patches in BATCHES:
                row = measure(name, dtype, patches, device, rounds)
                report[name][f"{dtype}, {label}"] = row
                progress(
                    f"  {name:11s} {dtype:9s} {label:12s} conv3d {row['conv3d_ms']:8.2f} ms, "
                    f"matmul {row['matmul_ms']:8.2f} ms ({row['speedup']:.2f}x); error vs "
                    f"float64: conv3d {row['conv3d_error']:.1e}, matmul {row['matmul_error']:.1e}"
                )
    return report


def main(args) -> int:
    print(f"epd-bench patch-embed on {args.device}: median of {args.rounds} interleaved rounds")
    write_json(args.json, run(args.device, args.rounds))
    return 0
