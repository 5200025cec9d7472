"""The GPU check's entry (``python3 -m epdserve.bench.gpu OUT_DIR``): the standard library only,
so that it runs, and says what it found, on a machine that lacks every other package.

1. The wheels in ``--wheels`` (``.whl/``, from ``make gpu-wheels``) that suit this Python are
   installed into ``--site`` (``.site/``), which the children find first on their path.
2. The preflight runs in a child (``preflight``), under its own timeout
   (``steps/00-preflight.json``).
3. The steps (``plan.steps``) run in a child (``runner``) the supervisor watches line by line:
   each step must end within its timeout and the run within ``--budget-s`` (360 s at most). A
   step past its time is killed with the child and marked ``abandoned`` in its JSON (what it
   wrote so far kept); a new child goes on with the next step (a family whose compile was
   abandoned or failed goes on eagerly). A step whose needs the preflight did not find is
   ``skipped`` with the reason.

``OUT_DIR/summary.json`` is written after every event (the machine, each step's status, time and
file, the headline figures so far), ``OUT_DIR/log.txt`` gets every line printed: whatever stops
the run, what finished is there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from epdserve.bench.gpu import plan

# the checkout: epdserve/bench/gpu/supervisor.py, four levels down
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HARD_BUDGET_S = 360.0  # the most a run may take, whatever --budget-s says
RUNNER_START_S = 60.0  # the runner's imports, before its first step
KILL_WAIT_S = 10.0  # how long a killed child is waited for


class Run:
    """One GPU check run: its output directory, its clock and its summary."""

    def __init__(self, out_dir: str, budget_s: float, dry_run: bool):
        self.out_dir = os.path.abspath(out_dir)
        os.makedirs(os.path.join(self.out_dir, "steps"), exist_ok=True)
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.dry_run = dry_run
        self.log_file = open(os.path.join(self.out_dir, "log.txt"), "a", buffering=1)
        self.summary: dict = {
            "dry_run": dry_run,
            "budget_s": round(self.deadline - self.started, 1),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "finished": False,
            "steps": {},
            "headline": {},
        }
        self.save()

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, line: str) -> None:
        text = f"[{time.monotonic() - self.started:6.1f}s] {line}"
        print(text, flush=True)
        self.log_file.write(text + "\n")

    def echo(self, line: str) -> None:
        """A child's line, passed through."""
        print(line, flush=True)
        self.log_file.write(line + "\n")

    def step(self, name: str, status: str, **fields) -> None:
        entry = self.summary["steps"].setdefault(name, {})
        entry.update(status=status, **fields)
        self.save()

    def save(self) -> None:
        self.summary["seconds"] = round(time.monotonic() - self.started, 1)
        path = os.path.join(self.out_dir, "summary.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump(self.summary, f, indent=1, default=str)
        os.replace(f"{path}.tmp", path)


def child_env(site: str | None) -> dict:
    paths = [p for p in (site, ROOT, os.environ.get("PYTHONPATH")) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def install_wheels(run: Run, wheels: str, site: str) -> str | None:
    """The wheels of ``wheels`` that suit this Python, into ``site``; ``site`` (or None when
    there are none). Each distribution on its own: one that has no wheel for this Python is
    reported and the others still go in."""
    if not os.path.isdir(wheels):
        run.summary["wheels"] = f"no {wheels}: the machine's own packages only"
        return None
    names = sorted({f.split("-")[0] for f in os.listdir(wheels) if f.endswith(".whl")})

    def pip(*names: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--find-links", wheels, "--target", site, "--upgrade", *names],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    if pip(*names).returncode == 0:  # all at once; else each alone, to say which did not go in
        report = dict.fromkeys(names, "installed")
    else:
        report = {}
        for name in names:
            done = pip(name)
            report[name] = "installed" if done.returncode == 0 else done.stderr.strip()[-300:]
    run.summary["wheels"] = report
    run.say(f"wheels into {site}: " + ", ".join(f"{n} {r[:40]}" for n, r in report.items()))
    run.save()
    return site


def preflight(run: Run, env: dict) -> dict:
    """The machine's facts (``preflight``), or what stopped them."""
    started = time.monotonic()
    command = [sys.executable, "-m", "epdserve.bench.gpu.preflight"]
    try:
        done = subprocess.run(
            command + (["--dry-run"] if run.dry_run else []),
            capture_output=True,
            text=True,
            env=env,
            timeout=min(plan.PREFLIGHT_TIMEOUT_S, max(run.left_s(), 1)),
        )
        facts = json.loads(done.stdout.strip().splitlines()[-1])
        status = "ok"
    except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        facts = {"error": f"{type(exc).__name__}: {exc}", "can": {}}
        status = "failed"
    path = os.path.join(run.out_dir, "steps", plan.file_name(0, "preflight"))
    with open(path, "w") as f:
        json.dump({"step": "preflight", "status": status, "result": facts}, f, indent=1)
    run.summary["preflight"] = {
        key: facts.get(key) for key in ("machine", "torch", "tower_paths", "can", "error")
    }
    run.step("preflight", status, seconds=round(time.monotonic() - started, 1), file=path)
    for need, reason in facts.get("can", {}).items():
        run.say(f"preflight: {need}: {'yes' if reason is None else f'no: {reason}'}")
    return facts


class Runner:
    """The runner child, its output lines on a queue (read by a thread: a hung child cannot
    block the supervisor)."""

    def __init__(self, run: Run, names: list[str], args, eager: set[str], env: dict):
        command = [
            sys.executable, "-m", "epdserve.bench.gpu.runner", run.out_dir,
            "--steps", ",".join(names), "--scratch", args.scratch, "--t0", repr(run.started),
        ]  # fmt: skip
        command += ["--dry-run"] if args.dry_run else []
        command += [arg for family in sorted(eager) for arg in ("--eager", family)]
        command += ["--hang", args.hang] if args.hang else []
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: what it started goes with it
        )
        run.summary["runner_pids"] = [*run.summary.get("runner_pids", []), self.process.pid]
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def kill(self) -> None:
        """SIGKILL the runner, give what it started (its receiver process, the resource tracker,
        compile workers) ``KILL_WAIT_S`` to end on their own (they see it gone: a receiver
        unlinks its shared memory as it ends), then SIGKILL what is left of its process group."""
        group = self.process.pid
        with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
            os.kill(group, signal.SIGKILL)
        self.process.wait()  # SIGKILL ends it (a process in the driver: when the call returns)
        until = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < until:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return  # nothing of the group is left
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):  # its last process ended just now
            os.killpg(group, signal.SIGKILL)


def run_steps(run: Run, pending: list[plan.Step], args, env: dict) -> None:
    """Every pending step, in runners one after another until each has ended, been abandoned,
    or the budget is spent."""
    eager: set[str] = set()
    timeouts = dict(args.timeout)
    factor = plan.DRY_RUN_TIMEOUT_FACTOR if args.dry_run else 1.0
    while pending and run.left_s() > 0:
        runner = Runner(run, [step.name for step in pending], args, eager, env)
        by_name = {step.name: step for step in pending}
        current, limit = "runner start", time.monotonic() + RUNNER_START_S * factor
        while True:
            wait = min(limit, run.deadline) - time.monotonic()
            try:
                line = runner.lines.get(timeout=max(wait, 0))
            except queue.Empty:
                over = "the run's budget ran out" if run.left_s() <= 0 else "its time ran out"
                runner.kill()
                run.say(f"ABANDONED {current}: {over}; the runner killed")
                if current in by_name:
                    _abandon(run, current, over)
                    pending = pending[pending.index(by_name[current]) + 1 :]
                    if by_name[current].kind == "compile":
                        eager.add(by_name[current].family)
                break
            if line is None:  # the runner exited
                code = runner.process.wait()
                if current in by_name:
                    run.say(f"runner exited ({code}) during {current}")
                    _abandon(run, current, f"the runner exited with status {code}")
                    pending = pending[pending.index(by_name[current]) + 1 :]
                else:
                    left = [step for step in pending if step.name not in run.summary["steps"]]
                    if len(left) == len(pending):  # not one step started: another try would not
                        for step in left:
                            run.step(step.name, "skipped", reason=f"the runner exited ({code})")
                        left = []
                    pending = left
                break
            if not line.startswith("@@"):
                run.echo(line)
                continue
            words = line[2:].split()
            if words[0] == "ready":
                current, limit = None, run.deadline
            elif words[0] == "start":
                step = by_name[words[1]]
                timeout = timeouts.get(step.name, step.timeout_s * factor)
                current, limit = step.name, time.monotonic() + timeout
                run.step(step.name, "running", timeout_s=timeout)
            elif words[0] == "end":
                _ended(run, words[1], words[2])
                if words[2] != "ok" and by_name[words[1]].kind == "compile":
                    eager.add(by_name[words[1]].family)
                current, limit = None, run.deadline
    for step in pending:
        if step.name not in run.summary["steps"] or run.summary["steps"][step.name].get(
            "status"
        ) in (None, "running"):
            run.step(step.name, "skipped", reason="the run's budget ran out before it")


def _step_file(run: Run, name: str) -> str | None:
    suffix = f"-{name.replace('/', '-')}.json"
    directory = os.path.join(run.out_dir, "steps")
    found = [os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(suffix)]
    return found[0] if found else None


def _ended(run: Run, name: str, status: str) -> None:
    path = _step_file(run, name)
    data = {}
    if path:
        with open(path) as f:
            data = json.load(f)
    run.summary["headline"].update(data.get("result", {}).get("headline", {}))
    error = (data.get("error") or "").strip().splitlines()[-1:] or None
    run.step(name, status, seconds=data.get("seconds"), file=path, error=error and error[0])
    run.say(f"{name}: {status}" + (f" ({error[0]})" if error else ""))


def _abandon(run: Run, name: str, why: str) -> None:
    """Mark the step's JSON abandoned (what it wrote so far kept) and the summary."""
    path = _step_file(run, name)
    if path:
        with open(path) as f:
            data = json.load(f)
        data.update(status="abandoned", reason=why)
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)
    run.step(name, "abandoned", reason=why, file=path)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m epdserve.bench.gpu",
        description="The encode worker measured on a lent GPU; every step's JSON in OUT_DIR.",
    )
    parser.add_argument("out_dir", help="where the results go ($OUT on the GPU machine)")
    parser.add_argument("--dry-run", action="store_true", help="small towers on the CPU")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"the whole run's budget (default {plan.BUDGET_S:g} s; a dry run's "
        f"{plan.DRY_RUN_TIMEOUT_FACTOR:g} times longer; never above {HARD_BUDGET_S:g} s on a GPU)",
    )
    parser.add_argument(
        "--families", default=",".join((plan.MAIN, *plan.OTHERS)), help="comma-separated"
    )
    parser.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="wheels to install")
    parser.add_argument("--site", default=os.path.join(ROOT, ".site"), help="where they go")
    parser.add_argument("--scratch", default="/tmp/epd-gpu-check", help="checkpoints, cache")
    parser.add_argument(
        "--timeout",
        action="append",
        default=[],
        type=lambda text: (text.split("=")[0], float(text.split("=")[1])),
        help="STEP=SECONDS: one step's timeout instead of the plan's",
    )
    parser.add_argument("--hang", default=None, help="STEP hangs on purpose (tests the abandon)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.dry_run:  # a small CPU compiles and runs the small towers slower than a GPU
        budget = args.budget_s or plan.BUDGET_S * plan.DRY_RUN_TIMEOUT_FACTOR
    else:
        budget = min(args.budget_s or plan.BUDGET_S, HARD_BUDGET_S)
    run = Run(args.out_dir, budget, args.dry_run)
    run.say(f"GPU check into {run.out_dir}: budget {run.summary['budget_s']} s")
    site = install_wheels(run, args.wheels, args.site)
    env = child_env(site)
    facts = preflight(run, env)
    can = facts.get("can", {})
    pending = []
    for step in plan.steps(tuple(args.families.split(","))):
        missing = [can.get(plan.NEEDS[need], "the preflight did not run") for need in step.needs]
        missing = [reason for reason in missing if reason]
        if missing:
            run.step(step.name, "skipped", reason="; ".join(missing))
            run.say(f"skip {step.name}: {'; '.join(missing)}")
        else:
            pending.append(step)
    run_steps(run, pending, args, env)
    run.summary["finished"] = True
    run.save()
    width = max((len(k) for k in run.summary["headline"]), default=0)
    run.say("headline:")
    for name, value in run.summary["headline"].items():
        run.echo(f"  {name:{width}s}  {value}")
    statuses = {name: entry["status"] for name, entry in run.summary["steps"].items()}
    run.say("steps: " + ", ".join(f"{name} {status}" for name, status in statuses.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
