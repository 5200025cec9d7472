"""The GPU check's steps, in order of importance (the standard library only: the supervisor reads
it before anything heavy is imported).

A step names what it needs (``NEEDS``): the preflight says which of these the machine has, and a
step that lacks one is skipped with the reason. Its timeout bounds it alone; a step that needs a
state an earlier step made (a checkpoint, a compiled tower) makes it again if a new runner took
over (from the disk and the compile cache: seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

BUDGET_S = 330.0  # the whole run, preflight and compile included (the machine's call: 10 min)
PREFLIGHT_TIMEOUT_S = 90.0

# what a step can need, and the preflight's key that says the machine has it
NEEDS = {
    "torch": "torch_runs",  # torch and transformers import
    "tower": "tower_runs",  # ... and the tower's device runs (CUDA, or the CPU in a dry run)
    "compile": "compile_runs",  # Inductor for that device (Triton and a C compiler on CUDA)
    "worker": "worker_runs",  # every package the encode worker imports
}


@dataclass(frozen=True)
class Step:
    name: str  # "family/what" or "what"
    timeout_s: float  # on the GPU; a dry run's are DRY_RUN_TIMEOUT_FACTOR times longer
    needs: tuple[str, ...] = ("tower",)

    @property
    def family(self) -> str | None:
        return self.name.split("/")[0] if "/" in self.name else None

    @property
    def kind(self) -> str:
        return self.name.rsplit("/", 1)[-1]


MAIN = "qwen2_5_vl"
OTHERS = ("qwen3_vl", "qwen2_vl")
DRY_RUN_TIMEOUT_FACTOR = 3.0  # a 2-core CPU compiling and running small towers


def steps(families: tuple[str, ...] = (MAIN, *OTHERS)) -> list[Step]:
    """The run's steps: the main family in full, the worker's CPU budget, then the other
    families' towers."""
    out: list[Step] = []
    for family in families:
        out += [Step(f"{family}/build", 90), Step(f"{family}/compile", 240, ("tower", "compile"))]
        if family == MAIN:
            out += [
                Step(f"{family}/exact", 60),
                Step(f"{family}/tower", 120),
                Step(f"{family}/pipeline", 150, ("tower", "worker")),
                Step("cpu_budget", 90, ("torch", "worker")),
            ]
        else:
            out.append(Step(f"{family}/tower", 90))
    return out


def file_name(index: int, step: str) -> str:
    """A step's JSON file in ``OUT_DIR/steps/``, by its place and name:
    ``03-qwen2_5_vl-exact.json``."""
    return f"{index:02d}-{step.replace('/', '-')}.json"
