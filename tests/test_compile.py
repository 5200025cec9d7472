"""``--compile``: the tower's blocks and mergers compiled by Inductor (its C++ backend here, gcc),
against the same tower eager; no recompile for new sizes after the warm-up; the compiled code
kept across a restart; where ``auto`` compiles and why not elsewhere."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from encode_worker.cli import start
from encode_worker.config import WorkerConfig
from epdserve.process_settings import SettingError
from epdserve.vision import compilation
from epdserve.vision.compilation import CompileUnavailable, resolve
from epdserve.vision.small_checkpoints import build_vision_only
from epdserve.vision.tower import VisionTower
from tests.test_encode_worker import make_worker
from tests.waiting import eventually

pytestmark = pytest.mark.compile

# float32: compiled rows against eager ones, max abs difference over the rows' largest value
# (measured: 1.5e-7 to 2.2e-7 on values up to ~3; Inductor fuses the element-wise work, so its
# float operations come in another order)
FLOAT32_BOUND = 1e-5
BF16_COSINE_FLOOR = 0.9999
BUDGET = dict(batch_items=8, batch_patches=16384)


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """A small Qwen2.5-VL tower (4 blocks, one of full attention: windows and whole images),
    compiled and warmed up once for the session, its eager twin, and their cache directory."""
    directory = build_vision_only(
        "qwen2_5_vl", str(tmp_path_factory.mktemp("tower")), out_width=96, depth=4, width=64
    )
    cache_dir = str(tmp_path_factory.mktemp("compile-cache"))
    eager = VisionTower.load(directory, vision_attention="varlen")
    tower = VisionTower.load(
        directory, vision_attention="varlen", compile="on", compile_cache_dir=cache_dir
    )
    warmed_up = tower.warm_up(**BUDGET)
    return {
        "directory": directory,
        "cache_dir": cache_dir,
        "eager": eager,
        "tower": tower,
        "warmed_up": warmed_up,
    }


def _inputs(grids: list[tuple[int, int, int]], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    grid_thw = torch.tensor(grids)
    pixels = torch.randn(int(grid_thw.prod(dim=1).sum()), 3 * 2 * 14 * 14, generator=generator)
    return pixels, grid_thw


def _max_abs_ratio(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got - expected).abs().max().item() / max(1.0, expected.abs().max().item())


def test_the_warm_up_compiles_few_graphs_that_every_block_shares(compiled):
    from torch._dynamo.utils import counters

    warmed_up, tower = compiled["warmed_up"], compiled["tower"]
    assert tower.compiled and "Inductor" in tower.compile_reason
    assert not counters["graph_break"]  # each block and merger is one graph
    # one sequence, equal sequences, unequal ones, a one-row merger, the merger: whatever the
    # depth (4 blocks here, 32 at full size), the blocks share their graphs
    assert 1 <= warmed_up["graphs_compiled"] <= 6, warmed_up
    assert warmed_up["batches"][0] == "1 x 1x2x2"
    assert warmed_up["batches"][-1] == "8 x 1x32x32"  # the worker's full batch of 448x448


def test_compiled_rows_equal_eager_rows_within_the_bound(compiled, record_property):
    worst = 0.0
    for seed, grids in enumerate(
        [[(1, 16, 16)], [(1, 32, 32), (1, 22, 14), (1, 4, 4)], [(2, 16, 12)], [(1, 16, 16)] * 5]
    ):
        pixels, grid_thw = _inputs(grids, seed)
        got = compiled["tower"].encode(pixels, grid_thw)
        expected = compiled["eager"].encode(pixels, grid_thw)
        assert got.shape == expected.shape
        worst = max(worst, _max_abs_ratio(got, expected))
    record_property("float32_max_abs_over_max_value", worst)
    assert worst <= FLOAT32_BOUND, worst


def test_twenty_new_image_sizes_after_the_warm_up_compile_nothing(compiled, record_property):
    """20 batches of sizes the warm-up never ran (single images, mixed batches, a video): Dynamo's
    own count of graphs and of frames it compiled does not move."""
    from torch._dynamo.utils import counters

    rng = random.Random(50)
    seen = {(1, 2, 2), (1, 16, 16), (1, 22, 16), (1, 32, 32)}
    batches = []
    while len(batches) < 20:
        items = rng.choice([1, 1, 2, 3, 6])
        grids = [
            (rng.choice([1, 1, 1, 2]), 2 * rng.randint(2, 30), 2 * rng.randint(2, 30))
            for _ in range(items)
        ]
        if not seen.intersection(grids):
            seen.update(grids)
            batches.append(grids)
    graphs, frames = compilation.graphs_compiled(), counters["frames"]["total"]
    worst = 0.0
    for seed, grids in enumerate(batches):
        pixels, grid_thw = _inputs(grids, seed)
        got = compiled["tower"].encode(pixels, grid_thw)
        worst = max(worst, _max_abs_ratio(got, compiled["eager"].encode(pixels, grid_thw)))
    record_property("recompiles", compilation.graphs_compiled() - graphs)
    assert compilation.graphs_compiled() - graphs == 0
    assert counters["frames"]["total"] - frames == 0
    assert worst <= FLOAT32_BOUND, worst


def test_compiled_bfloat16_rows_keep_the_eager_ones_direction(compiled, record_property):
    directory = compiled["directory"]
    eager = VisionTower.load(directory, "bfloat16", vision_attention="varlen")
    tower = VisionTower.load(directory, "bfloat16", vision_attention="varlen", compile="on")
    pixels, grid_thw = _inputs([(1, 32, 32), (1, 22, 14), (1, 16, 16)])
    got = tower.encode(pixels, grid_thw).float()
    expected = eager.encode(pixels, grid_thw).float()
    cosine = F.cosine_similarity(got, expected, dim=1).min().item()
    record_property("bf16_min_cosine", cosine)
    assert cosine >= BF16_COSINE_FLOOR, cosine


RESTART = """
import json, sys
import torch
from torch._dynamo.utils import counters
from epdserve.vision.tower import VisionTower
torch.backends.cuda.matmul.fp32_precision = sys.argv[3]
tower = VisionTower.load(sys.argv[1], vision_attention="varlen", compile="on",
                         compile_cache_dir=sys.argv[2])
warmed_up = tower.warm_up(batch_items=8, batch_patches=16384)
print(json.dumps({"graphs": warmed_up["graphs_compiled"], **counters["inductor"]}))
"""


def test_a_restarted_process_loads_its_graphs_from_the_cache(compiled, record_property):
    """A new process over a cache directory a process filled compiles the same graphs without one
    miss of Inductor's cache: the code is loaded, not generated and built again. The session's
    warm-up filled the directory; the new process runs with this process's settings that are part
    of the cache key, as a restarted worker runs with its own. An engine run here before (vLLM's)
    changes two: the C++ backend's dynamic threads (in the environment, after this process's
    Inductor read it) and the CUDA matmul precision. Should another differ, the new process
    misses and fills the directory, and a second one is the restart."""
    import torch._inductor.config

    dynamic_threads = "1" if torch._inductor.config.cpp.dynamic_threads else "0"

    def new_process() -> dict:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                RESTART,
                compiled["directory"],
                compiled["cache_dir"],
                torch.backends.cuda.matmul.fp32_precision,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(sys.path),
                "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": dynamic_threads,
            },
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    report = new_process()
    record_property("first_process_misses", report.get("fxgraph_cache_miss", 0))
    if report.get("fxgraph_cache_miss", 0):
        report = new_process()
    assert report["graphs"] == compiled["warmed_up"]["graphs_compiled"]
    assert report.get("fxgraph_cache_miss", 0) == 0, report
    assert report["fxgraph_cache_hit"] >= report["graphs"], report


def test_a_worker_serves_only_once_its_compiled_tower_is_warmed_up(compiled):
    worker, receiver = make_worker(
        compiled["directory"], tower=compiled["tower"], compile="on", **BUDGET
    )
    try:
        assert worker.warmed_up is not None
        assert worker.warmed_up["graphs_compiled"] == 0  # the session's warm-up compiled them
        eventually(lambda: worker.not_ready() is None, "the worker ready")
    finally:
        worker.stop()
        receiver.close()


def test_a_failed_compile_under_auto_leaves_the_tower_eager(compiled, monkeypatch):
    eager = compiled["eager"]
    tower = VisionTower.load(compiled["directory"], vision_attention="varlen", compile="on")
    tower.compile_choice = "auto"  # as auto resolves on a GPU

    def fails(*args):
        raise RuntimeError("Triton could not build its kernel")

    monkeypatch.setattr(tower, "_warm_up", fails)
    assert tower.warm_up(**BUDGET) is None
    assert not tower.compiled and "Triton could not build" in tower.compile_reason
    assert all(block._compiled_call_impl is None for block in tower.model.blocks)
    pixels, grid_thw = _inputs([(1, 16, 16), (1, 22, 14)])
    assert torch.equal(tower.encode(pixels, grid_thw), eager.encode(pixels, grid_thw))


def test_under_on_a_failed_compile_stops_the_start(compiled, monkeypatch):
    tower = VisionTower.load(compiled["directory"], vision_attention="varlen", compile="on")
    monkeypatch.setattr(tower, "_warm_up", lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        tower.warm_up(**BUDGET)


def test_auto_compiles_where_the_gpu_backend_runs_and_says_why_not_elsewhere(monkeypatch):
    assert resolve("off", "cuda", "varlen") == (False, "--compile off")
    compiled, why = resolve("auto", "cpu", "varlen")
    assert not compiled and "cpu" in why and "CUDA" in why
    assert resolve("auto", "cuda", "reference") == (
        False,
        "the reference attention path stays eager",
    )
    assert resolve("on", "cpu", "varlen")[0]  # Inductor's C++ backend: gcc is here
    monkeypatch.setattr(compilation.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(compilation.shutil, "which", lambda name: f"/usr/bin/{name}")
    compiled, why = resolve("auto", "cuda:0", "varlen")
    assert compiled and "Triton" in why
    monkeypatch.setattr(compilation.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    compiled, why = resolve("auto", "cuda", "varlen")
    assert not compiled and "C compiler" in why
    with pytest.raises(CompileUnavailable, match="C compiler"):
        resolve("on", "cuda", "varlen")
    with pytest.raises(CompileUnavailable, match="C\\+\\+ compiler"):
        resolve("on", "cpu", "varlen")
    monkeypatch.setattr(compilation.importlib.util, "find_spec", lambda name: None)
    compiled, why = resolve("auto", "cuda", "varlen")
    assert not compiled and "Triton is not installed" in why


def test_compile_on_the_reference_path_is_refused_in_one_line(compiled):
    config = WorkerConfig(
        model=compiled["directory"],
        dtype="float32",
        vision_attention="reference",
        compile="on",
        bind="127.0.0.1",
        bootstrap_port=0,
        intake_port=0,
        transports="loopback",
    )
    with pytest.raises(SettingError, match="--compile on: only the varlen attention path"):
        start(config)


def test_compile_flags_come_from_the_settings():
    loopback = ["--model", "/m", "--bind", "127.0.0.1"]
    config = WorkerConfig.from_command_line(
        [*loopback, "--compile", "off", "--compile-cache-dir", "/var/cache/epd"]
    )
    assert (config.compile, config.compile_cache_dir) == ("off", "/var/cache/epd")
    assert WorkerConfig(model="/m", bind="127.0.0.1").compile == "auto"
    with pytest.raises(SettingError, match="--compile"):
        WorkerConfig.from_command_line([*loopback, "--compile", "sometimes"])


def test_the_flash_branch_compiles_into_one_graph_per_block(compiled, monkeypatch):
    """The branch a GPU takes (PyTorch's Flash varlen kernel), taken here on the CPU with a
    stand-in kernel of varlen_attn's signature: Dynamo traces the whole block, the branch's
    choice included, without a graph break, and the rows equal the padded path's."""
    from torch._dynamo.utils import counters

    from epdserve.vision import attention

    calls = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):  # [N, H, D] each
        calls.append(1)
        packed = (t.transpose(0, 1)[None] for t in (q, k, v))
        return attention._padded_sdpa(*packed, cu_q, max_q, scale)

    monkeypatch.setattr(attention, "_VARLEN_ATTN", [(stand_in, True)])
    monkeypatch.setattr(attention, "_FLASH_RUNS", {("cpu", None, torch.float32)})
    directory = compiled["directory"]
    tower = VisionTower.load(directory, vision_attention="varlen", compile="on")
    breaks = sum(counters["graph_break"].values())
    for seed, grids in enumerate([[(1, 16, 16), (1, 22, 14)], [(1, 32, 32)]]):
        pixels, grid_thw = _inputs(grids, seed)
        got = tower.encode(pixels, grid_thw)
        assert _max_abs_ratio(got, compiled["eager"].encode(pixels, grid_thw)) <= FLOAT32_BOUND
    assert calls  # traced through the stand-in (Dynamo calls it while tracing)
    assert sum(counters["graph_break"].values()) == breaks
