"""The GPU check (``python3 -m epdserve.bench.gpu``) on this CPU: its dry run writes every step's
JSON into the directory it is given; a hung step is abandoned and the next ones still run; a run
killed half-way leaves the finished steps' JSON; a machine without CUDA runs what it can and says
why it skipped the rest; the forward's FLOP count is torch's own."""

import json
import os
import signal
import subprocess
import sys
import zipfile

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from epdserve.bench.gpu import plan, preflight
from epdserve.bench.gpu.flops import forward_flops, peak_tflops
from epdserve.bench.gpu.supervisor import Run, install_wheels
from epdserve.vision.families import FAMILIES, PATCH_GRID_FAMILIES
from epdserve.vision.patch_embedding import as_matmul
from epdserve.vision.small_checkpoints import vision_config
from tests.waiting import eventually

pytestmark = pytest.mark.processes

MAIN_STEPS = [step.name for step in plan.steps((plan.MAIN,))]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """Checkpoints and the compile cache, shared by this module's runs (as on the GPU machine,
    where a runner that takes over finds them)."""
    return str(tmp_path_factory.mktemp("gpu-check-scratch"))


def check(out_dir, *args, scratch: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "epdserve.bench.gpu", str(out_dir), "--dry-run",
         "--families", plan.MAIN, "--scratch", scratch, "--wheels", "/nonexistent", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip


def step_files(out_dir) -> dict[str, dict]:
    directory = os.path.join(out_dir, "steps")
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name)) as f:
            data = json.load(f)
        out[data["step"]] = data
    return out


def test_a_dry_run_writes_every_step_and_abandons_a_hung_one(tmp_path, scratch, no_new_segments):
    process = check(
        tmp_path, "--hang", "qwen2_5_vl/exact", "--timeout", "qwen2_5_vl/exact=5", scratch=scratch
    )
    output, _ = process.communicate(timeout=900)
    assert process.returncode == 0, output[-4000:]
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    files = step_files(tmp_path)
    assert summary["finished"] and list(files) == ["preflight", *MAIN_STEPS]
    hung = files["qwen2_5_vl/exact"]
    assert hung["status"] == "abandoned" and "time ran out" in hung["reason"]
    assert "on purpose" in hung["result"]["hanging"]  # what it wrote before it hung, kept
    assert summary["steps"]["qwen2_5_vl/exact"]["status"] == "abandoned"
    assert len(summary["runner_pids"]) == 2  # a new runner took over after the hung step
    for name in ("preflight", *MAIN_STEPS):
        if name != "qwen2_5_vl/exact":
            assert files[name]["status"] == "ok", (name, files[name].get("error"))
            assert summary["steps"][name]["status"] == "ok"
    compiled = files["qwen2_5_vl/compile"]["result"]
    assert compiled["compiled"] and compiled["warm_up"]["graphs_compiled"] >= 1
    tower = files["qwen2_5_vl/tower"]["result"]
    assert tower["paths"] == ["compiled", "varlen", "reference"]
    assert tower["224 batch 4"]["compiled"]["images_per_s"] > 0
    assert tower["224 batch 4"]["flops_per_batch"] > 0
    pipeline = files["qwen2_5_vl/pipeline"]["result"]
    assert pipeline["path"] == "compiled"
    for size in ("224", "448"):
        assert pipeline[size]["failed_items"] == 0
        assert pipeline[size]["delivered_over_tower_alone"] > 0
        by_thread = pipeline[size]["configs"]["delivered_batched"]["cpu_ms_per_item_by_thread"]
        assert by_thread["decode + preprocessing"] > 0 and by_thread["tower thread"] > 0
    budget = files["cpu_budget"]["result"]["224"]["cpu_budget"]["delivered_batched"]
    assert budget["items_per_s"] > 0 and budget["stopped_first_by"]
    assert "qwen2_5_vl delivered / tower alone 224" in summary["headline"]
    with open(tmp_path / "log.txt") as f:
        assert "ABANDONED qwen2_5_vl/exact" in f.read()


def test_a_run_killed_half_way_leaves_the_finished_steps_json(tmp_path, scratch, no_new_segments):
    process = check(tmp_path, scratch=scratch)

    def built() -> bool:
        try:
            with open(tmp_path / "summary.json") as f:
                steps = json.load(f)["steps"]
        except (FileNotFoundError, ValueError):  # not written yet, or being replaced
            return False
        return steps.get("qwen2_5_vl/build", {}).get("status") == "ok"

    try:
        eventually(built, "the build step done", seconds=300, interval=0.2)
        with open(tmp_path / "summary.json") as f:
            runner = json.load(f)["runner_pids"][-1]
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=60)
    eventually(lambda: not os.path.exists(f"/proc/{runner}"), "the runner gone", seconds=30)
    files = step_files(tmp_path)
    assert files["preflight"]["status"] == "ok"
    assert files["qwen2_5_vl/build"]["status"] == "ok"
    assert files["qwen2_5_vl/build"]["result"]["directory"].startswith(scratch)
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert not summary["finished"] and summary["steps"]["qwen2_5_vl/build"]["status"] == "ok"


def test_without_cuda_the_check_runs_what_it_can_and_says_why_not_the_rest(
    tmp_path, scratch, no_new_segments
):
    """Not a dry run, on this CPU: the preflight finds no CUDA device, so every step on the
    tower is skipped with that reason; the worker's CPU budget (no GPU needed) runs, at the
    GPU's sizes, until its timeout (5 s here, for the test's time) abandons it."""
    process = subprocess.run(
        [sys.executable, "-m", "epdserve.bench.gpu", str(tmp_path), "--families", plan.MAIN,
         "--scratch", scratch, "--wheels", "/nonexistent", "--timeout", "cpu_budget=5"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert process.returncode == 0, process.stdout[-4000:] + process.stderr[-2000:]
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["finished"]
    assert summary["preflight"]["can"]["tower_runs"].startswith("no CUDA device")
    for name in MAIN_STEPS:
        status = summary["steps"][name]
        if name == "cpu_budget":
            assert status["status"] == "abandoned" and "time ran out" in status["reason"], status
        else:
            assert status["status"] == "skipped" and "no CUDA device" in status["reason"]
    files = step_files(tmp_path)
    assert set(files) == {"preflight", "cpu_budget"}
    assert files["cpu_budget"]["status"] == "abandoned"


def test_the_preflight_says_what_a_machine_lacks():
    facts = {
        "dry_run": False,
        "torch": {"torch": "2.11", "cuda_available": True},
        "tower_paths": {"compile": False, "compile_reason": "Triton is not installed"},
        "worker_imports": {"error": "ModuleNotFoundError: No module named 'zmq'"},
    }
    assert preflight.can(facts) == {
        "torch_runs": None,
        "tower_runs": None,
        "compile_runs": "Triton is not installed",
        "worker_runs": "the worker does not import: ModuleNotFoundError: No module named 'zmq'",
    }
    assert preflight.can(facts | {"torch": {"error": "ImportError: libcuda"}})["tower_runs"] == (
        "torch: ImportError: libcuda"
    )


def _wheel(directory, name: str, tag: str) -> None:
    """A minimal wheel of a one-module distribution ``name`` for ``tag``."""
    dist = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(os.path.join(directory, f"{name}-1.0-{tag}.whl"), "w") as wheel:
        wheel.writestr(f"{name}.py", "VALUE = 1\n")
        wheel.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        wheel.writestr(
            f"{dist}/WHEEL",
            f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
        )
        wheel.writestr(f"{dist}/RECORD", "")


def test_the_wheels_that_suit_this_python_are_installed_and_the_others_named(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "epd_fits", "py3-none-any")
    _wheel(wheels, "epd_elsewhere", "cp27-cp27m-win32")
    run = Run(str(tmp_path / "out"), 60, dry_run=True)
    site = install_wheels(run, str(wheels), str(tmp_path / "site"))
    report = run.summary["wheels"]
    assert report["epd_fits"] == "installed" and (tmp_path / "site" / "epd_fits.py").exists()
    assert report["epd_elsewhere"] != "installed"  # pip's reason, for the summary
    assert site == str(tmp_path / "site")


@pytest.mark.parametrize("family", PATCH_GRID_FAMILIES)
def test_the_forward_flops_are_what_torch_counts(family):
    """torch's counter sees matrix products only where they are explicit: transformers' eager
    attention and the patch embedding as a product."""
    spec = FAMILIES[family]
    model = spec.tower(spec.vision_config(**vision_config(family, depth=3, width=64))).eval()
    model.config._attn_implementation = "eager"
    as_matmul(model.patch_embed)
    grid_thw = torch.tensor([[1, 16, 16], [1, 22, 14], [2, 8, 8]])
    pixels = torch.randn(int(grid_thw.prod(dim=1).sum()), model.patch_embed.proj.weight[0].numel())
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(pixels, grid_thw=grid_thw)
    assert forward_flops(model, grid_thw, spec.windows) == counter.get_total_flops()


def test_the_peak_is_the_cards_own():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.4
    assert peak_tflops("Some Other Card") is None and peak_tflops(None) is None
