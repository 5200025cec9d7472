"""``--compile``: regional ``torch.compile`` of a tower on the varlen path, as vLLM compiles its
vision encoders' blocks.

What is compiled: each vision block and each patch merger (Qwen3-VL's DeepStack mergers too),
``dynamic=True``: the blocks are one class, so the tower's blocks share their compiled graphs (a
block's weights are the graph's inputs), and the sequence length, the number of sequences and
the longest one are symbolic, so a new image size or batch does not recompile. The patch
embedding, the rotary table and the window permutation around them stay eager (once per
forward). Dynamo still specialises a few cases, each its own graph: one sequence (a full
attention layer over one image), several sequences all as long (a batch of one size; the padded
attention's mask is left out), several of different lengths, and a merger over one row.
``warm_up_grids`` makes one batch of each, plus the worker's full batches, so that every graph
the worker needs is compiled before it says it is ready (``VisionTower.warm_up``).

Only the varlen path is compiled: transformers' reference loop splits the batch by Python lists
of lengths, which Dynamo traces as constants, so every new size would recompile it; it stays
eager. ``auto`` compiles where Inductor's GPU backend runs (CUDA, Triton, a C compiler) and says
once why not elsewhere; ``on`` compiles on the CPU too (Inductor's C++ backend, a C++ compiler:
what the tests run here).

The compiled code is kept across restarts in Inductor's cache (and Triton's, inside it):
``--compile-cache-dir`` names its directory (``TORCHINDUCTOR_CACHE_DIR``); a worker that starts
again over the same directory loads its graphs instead of compiling them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil

import torch

from epdserve.process_settings import TowerCompile

log = logging.getLogger(__name__)
CACHE_DIR_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
RECOMPILE_LIMIT = 32
_said: set[str] = set()  # the reasons already logged in this process


class CompileUnavailable(ValueError):
    """``--compile on`` where the tower cannot be compiled."""


def resolve(choice: TowerCompile, device: str, attention_path: str) -> tuple[bool, str]:
    """Whether a tower on ``device`` whose attention takes ``attention_path`` is compiled, and
    why or why not, in words; ``CompileUnavailable`` for ``on`` where it cannot be."""
    if choice == "off":
        return False, "--compile off"
    if attention_path != "varlen":
        if choice == "on":
            raise CompileUnavailable(
                "only the varlen attention path is compiled (--vision-attention varlen); "
                "transformers' reference loop recompiles at every new size"
            )
        return False, "the reference attention path stays eager"
    kind = torch.device(device).type
    if choice == "auto" and kind != "cuda":
        return (
            False,
            f"the tower is on {kind} (auto compiles on CUDA, with Triton and a C compiler)",
        )
    missing = missing_toolchain(kind)
    if missing is not None:
        if choice == "on":
            raise CompileUnavailable(missing)
        return False, missing
    backend = "Triton" if kind == "cuda" else "C++"
    return True, f"blocks and mergers compiled by Inductor ({backend}), dynamic shapes"


def missing_toolchain(kind: str) -> str | None:
    """What Inductor lacks to compile for a ``kind`` device here, or None: Triton and a C
    compiler (its launchers) on CUDA, a C++ compiler on the CPU."""
    if kind == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed (torch.compile's GPU backend)"
        if _compiler(os.environ.get("CC"), "cc", "gcc", "clang") is None:
            return "no C compiler (cc, gcc, clang or $CC) for Triton's launchers"
        return None
    if kind == "cpu":
        if _compiler(os.environ.get("CXX"), "c++", "g++", "clang++") is None:
            return "no C++ compiler (c++, g++, clang++ or $CXX) for Inductor's CPU backend"
        return None
    return f"Inductor does not compile for {kind}"


def _compiler(*names: str | None) -> str | None:
    return next((path for name in names if name and (path := shutil.which(name))), None)


def say_once(reason: str) -> None:
    """Log why the tower is not compiled, once per process and reason."""
    if reason not in _said:
        _said.add(reason)
        log.info("vision tower not compiled: %s", reason)


def compile_regions(model: torch.nn.Module, cache_dir: str | None = None) -> int:
    """Compile ``model``'s blocks and mergers (lazily: at their first call), keeping the
    compiled code in ``cache_dir`` when given; the number of modules compiled."""
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ[CACHE_DIR_VARIABLE] = os.path.abspath(cache_dir)
    # Dynamo keeps at most recompile_limit graphs per code object, and every tower of one
    # family in a process shares its block's code: room for a few towers (dtypes) of ~5 each
    torch._dynamo.config.recompile_limit = max(
        torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT
    )
    regions = _regions(model)
    for region in regions:
        region.compile(dynamic=True)
    return len(regions)


def uncompile_regions(model: torch.nn.Module) -> None:
    """Run ``model``'s blocks and mergers eagerly again (``auto``, after a compile failed)."""
    for region in _regions(model):
        region._compiled_call_impl = None  # what nn.Module.compile set


def _regions(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [*model.blocks, model.merger, *getattr(model, "deepstack_merger_list", ())]


def warm_up_grids(
    one_image: tuple[int, int, int],
    other_image: tuple[int, int, int],
    large_image: tuple[int, int, int],
    merge: int,
    batch_items: int,
    batch_patches: int,
) -> list[list[tuple[int, int, int]]]:
    """The batches (lists of ``(t, h, w)`` grids) a warm-up runs: each case Dynamo specialises
    (see the module's docstring) and the worker's full batches of ``one_image`` (a 224x224
    image's grid) and ``large_image`` (a 448x448 one's) within its budget. ``other_image`` is a
    grid of another size and shape (windows of other lengths)."""
    batches = [[(1, merge, merge)], [one_image], [one_image, other_image]]
    for grid in (one_image, large_image):
        fits = min(batch_items, batch_patches // (grid[0] * grid[1] * grid[2]))
        if fits > 1:
            batches.append([grid] * fits)
    return batches


def describe(batch: list[tuple[int, int, int]]) -> str:
    """A warm-up batch in words: its grids (t x h x w patches), each with its count."""
    counts: dict[tuple[int, int, int], int] = {}
    for grid in batch:
        counts[grid] = counts.get(grid, 0) + 1
    return " + ".join(f"{n} x {'x'.join(map(str, grid))}" for grid, n in counts.items())


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process so far (its own count)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
