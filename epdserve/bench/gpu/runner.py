"""The GPU check's child: runs the steps it is given, in order, each one's JSON written into
``OUT_DIR/steps/`` as it goes and when it ends, and tells the supervisor on its stdout when each
starts and ends (``@@start NAME``, ``@@end NAME STATUS``; every other line is log). It dies with
its supervisor (``PR_SET_PDEATHSIG``), so a killed run leaves no runner behind.

  python3 -m epdserve.bench.gpu.runner OUT_DIR --steps a,b [--dry-run] [--scratch DIR]
      [--eager FAMILY]... [--hang STEP] [--t0 MONOTONIC]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time
import traceback

from epdserve.bench.gpu import plan

PR_SET_PDEATHSIG = 1
T0 = [time.monotonic()]  # the run's start (the supervisor's clock: CLOCK_MONOTONIC, one per host)


def log(*parts) -> None:
    print(f"[{time.monotonic() - T0[0]:6.1f}s]", *parts, flush=True)


def tell(*words: str) -> None:
    """A line the supervisor reads (its protocol)."""
    print("@@" + " ".join(words), flush=True)


def die_with_parent() -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the supervisor died before the line above
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epdserve.bench.gpu.runner")
    parser.add_argument("out_dir")
    parser.add_argument("--steps", required=True, help="comma-separated step names, in order")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--scratch", default="/tmp/epd-gpu-check")
    parser.add_argument("--eager", action="append", default=[], help="a family not to compile")
    parser.add_argument("--hang", default=None, help="a step that hangs (the supervisor's test)")
    parser.add_argument("--t0", type=float, default=None, help="the run's start, monotonic")
    args = parser.parse_args(argv)
    die_with_parent()
    if args.t0 is not None:
        T0[0] = args.t0
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from epdserve.bench.gpu import steps  # torch: after the supervisor can see this process

    scale = steps.DRY_RUN if args.dry_run else steps.GPU
    steps_dir = os.path.join(args.out_dir, "steps")
    os.makedirs(steps_dir, exist_ok=True)
    state = steps.State(scale, args.scratch, steps_dir, set(args.eager), log)
    index = {step.name: i for i, step in enumerate(plan.steps(), start=1)}
    tell("ready")
    family = None
    for name in args.steps.split(","):
        step = plan.Step(name, 0)
        if family is not None and step.family not in (None, family):
            state.release(family)  # its towers off the card before the next family's
        family = step.family or family
        report = steps.Report(os.path.join(steps_dir, plan.file_name(index[name], name)), name)
        tell("start", name)
        log(f"== {name}")
        started = time.monotonic()
        try:
            if name == args.hang:
                report.partial(hanging="on purpose (--hang): the supervisor abandons this step")
                while True:
                    time.sleep(60)
            result = steps.KINDS[step.kind](state, step.family, report)
        except Exception:
            error = traceback.format_exc()[-4000:]
            log(f"FAILED {name}:\n{error}")
            report.end("failed", started, error=error)
            if step.kind == "compile":
                state.eager_only.add(step.family)
            tell("end", name, "failed")
            continue
        report.data["result"] = result
        report.end("ok", started)
        tell("end", name, "ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
