"""`epd-bench compare`: one benchmark at two git revisions, side by side.

Each revision is checked out in a git worktree of its own (``git worktree add --detach``) and the
same ``epd-bench BENCHMARK ARGS...`` runs in each, from that worktree with ``PYTHONPATH`` at it
and one interpreter for both (the one running this command: the shared virtualenv's). Rounds are
interleaved as every benchmark here interleaves its configurations (A B, then B A, ...), or with
``--at-once`` both sides of a round run at the same time, each its own processes: both meet the
machine at the same pace, each with half of it (compare CPU per item, not items/s against runs
alone). ``--out`` receives each run's JSON and log (``a-1.json``, ``a-1.log``, ...) and
``summary.json``: every number in the runs' JSON as a figure (a list's rows named by their labels,
such as ``levels[batch=8,concurrency=16].rooms_per_s``), each side's values, medians and the B/A
ratio. The worktrees are removed at the end, whatever happened.

``--harness b`` runs revision B's benchmark code (``HARNESS_DIRS``) on both sides, copied over A's
worktree, so that only the product code differs, as long as A's product has what B's benchmark
imports; by default each revision runs its own, and the command says when the two differ.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from epdserve.bench.benchmarks.rounds import in_round

# The benchmark code a revision runs, besides the product: the benchmarks and the process harness.
HARNESS_DIRS = ("epdserve/bench", "epdserve/testing")
# `epd-bench`'s module, newest layout first (a revision before the `epdserve` package has `bench`).
ENTRY_MODULES = ("epdserve.bench.cli", "bench.cli")
# Fields that name a row of a list in a benchmark's JSON (its level, path or configuration).
LABEL_KEYS = (
    "name",
    "path",
    "mode",
    "opener",
    "receiver",
    "sender",
    "transport",
    "images_per_request",
    "batch",
    "concurrency",
    "size",
    "size_bytes",
    "workers",
)
# A row with this field is one round's record; the run's medians over the rounds are its figures.
ROUND_KEY = "round"
MAX_ROUNDS = 50
MAX_TIMEOUT_S = 24 * 3600.0
KILL_GRACE_S = 10.0
SIDES = ("a", "b")


class CompareError(Exception):
    """A request this command refuses, or a step it could not take; the message says which."""


@dataclass
class Side:
    """One revision: as given, its commit, and the worktree it runs in once made."""

    name: str  # "a" or "b"
    rev: str
    commit: str
    tree: str = ""


@dataclass
class Run:
    """One benchmark run of one side in one round."""

    side: Side
    round: int
    json_path: str
    log_path: str
    command: list[str] = field(default_factory=list)
    exit_code: int | None = None
    seconds: float | None = None
    timed_out: bool = False

    @property
    def wrote_json(self) -> bool:
        return os.path.isfile(self.json_path)


def flatten(report, prefix: str = "") -> dict[str, float]:
    """Every number in a benchmark's JSON by its path: dict keys joined with dots; a list's rows
    of dicts named by their ``LABEL_KEYS`` (which are then no figures of theirs), or by position
    when the labels do not tell the rows apart; rows of one round (``ROUND_KEY``) and lists of
    plain numbers (per-round values) left out, the run's own medians being its figures.
    Booleans, strings and nulls are not figures."""
    figures: dict[str, float] = {}
    if isinstance(report, dict):
        for key, value in report.items():
            figures.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(report, list):
        rows = [row for row in report if isinstance(row, dict) and ROUND_KEY not in row]
        names = [row_name(row) for row in rows]
        labelled = len(set(names)) == len(names) and "" not in names
        for i, (name, row) in enumerate(zip(names, rows)):
            if labelled:
                row = {key: value for key, value in row.items() if key not in LABEL_KEYS}
            figures.update(flatten(row, f"{prefix}[{name if labelled else i}]"))
    elif isinstance(report, (int, float)) and not isinstance(report, bool):
        figures[prefix] = float(report)
    return figures


def row_name(row: dict) -> str:
    """``key=value,...`` of a row's labels, in ``LABEL_KEYS`` order."""
    return ",".join(
        f"{key}={row[key]}"
        for key in LABEL_KEYS
        if key in row and isinstance(row[key], (str, int)) and not isinstance(row[key], bool)
    )


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(a_reports: list[dict], b_reports: list[dict]) -> dict[str, dict]:
    """Per figure of the runs' JSON (in the order the runs name them): each side's values in run
    order, their medians and B's median over A's (None where A's is 0 or a side lacks it)."""
    flat = {"a": [flatten(r) for r in a_reports], "b": [flatten(r) for r in b_reports]}
    keys = dict.fromkeys(key for side in SIDES for run in flat[side] for key in run)
    summary = {}
    for key in keys:
        values = {side: [run[key] for run in flat[side] if key in run] for side in SIDES}
        a, b = median(values["a"]), median(values["b"])
        summary[key] = {
            "a": values["a"],
            "b": values["b"],
            "a_median": a,
            "b_median": b,
            "b_over_a": b / a if a and b is not None else None,
        }
    return summary


def table(figures: dict[str, dict]) -> str:
    """The figures whose values differ between runs, one line each: A's and B's median and B/A;
    then how many are left out for being the same in every run (settings, counts)."""
    lines = [f"{'figure':64s} {'A median':>12s} {'B median':>12s} {'B/A':>7s}  runs A/B"]
    constant = 0
    for key, figure in figures.items():
        values = figure["a"] + figure["b"]
        if len(set(values)) <= 1 and len(figure["a"]) and len(figure["b"]):
            constant += 1
            continue
        ratio = figure["b_over_a"]
        lines.append(
            f"{key:64s} {number(figure['a_median']):>12s} {number(figure['b_median']):>12s} "
            f"{'-' if ratio is None else f'{ratio:.3f}':>7s}  {len(figure['a'])}/{len(figure['b'])}"
        )
    lines.append(f"({constant} figures the same in every run of both sides are not shown)")
    return "\n".join(lines)


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def entry_module(tree: str) -> str:
    """The module that is `epd-bench` in ``tree``."""
    for module in ENTRY_MODULES:
        if os.path.isfile(os.path.join(tree, *module.split(".")) + ".py"):
            return module
    raise CompareError(f"{tree} has no epd-bench ({' or '.join(ENTRY_MODULES)})")


def command(python: str, tree: str, bench_args: list[str], json_path: str) -> list[str]:
    """The command line of one run: ``bench_args`` as epd-bench takes them, its JSON to
    ``json_path``."""
    return [python, "-m", entry_module(tree), *bench_args, "--json", json_path]


def run_env(tree: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """A run's environment: ``base`` (this process's) with ``PYTHONPATH`` at its worktree alone."""
    return {**(os.environ if base is None else base), "PYTHONPATH": tree}


def schedule(rounds: int, at_once: bool) -> list[list[tuple[int, str]]]:
    """Steps of (round, side): the sides in a step run at the same time. Interleaved as the
    benchmarks interleave their configurations: A B, then B A, ..."""
    steps = []
    for i in range(rounds):
        order = [(i + 1, side) for side in in_round(SIDES, i)]
        steps.extend([order] if at_once else [[one] for one in order])
    return steps


def check_args(bench_args: list[str], benchmarks: list[str]) -> list[str]:
    """The benchmark and its arguments, after an optional ``--``; refused when it names no
    benchmark ``epd-bench`` has, or sets ``--json`` (each run's JSON goes to ``--out``)."""
    args = bench_args[1:] if bench_args[:1] == ["--"] else list(bench_args)
    if not args:
        raise CompareError(f"name a benchmark after --: one of {', '.join(benchmarks)}")
    if args[0].startswith("-"):
        raise CompareError(
            f"{args[0]} where a benchmark belongs: compare's options go before the revisions"
        )
    if args[0] not in benchmarks:
        raise CompareError(f"unknown benchmark {args[0]!r}: one of {', '.join(benchmarks)}")
    if any(arg == "--json" or arg.startswith("--json=") for arg in args):
        raise CompareError("--json is set by compare: each run's JSON goes to --out")
    return args


def git(repo: str, *args: str) -> str:
    result = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=120)
    if result.returncode:
        raise CompareError(f"git {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result.stdout.strip()


def resolve(repo: str, name: str, rev: str) -> Side:
    try:
        commit = git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except CompareError:
        raise CompareError(f"revision {rev!r} is no commit of {repo}") from None
    return Side(name=name, rev=rev, commit=commit)


def add_worktrees(repo: str, sides: list[Side], root: str) -> None:
    for side in sides:
        side.tree = os.path.join(root, side.name)
        git(repo, "worktree", "add", "--detach", side.tree, side.commit)


def remove_worktrees(repo: str, sides: list[Side]) -> None:
    """Remove the sides' worktrees; one that cannot be is named on stderr (the caller's error,
    if any, is the one raised)."""
    for side in sides:
        if side.tree and os.path.isdir(side.tree):
            result = subprocess.run(
                ["git", "-C", repo, "worktree", "remove", "--force", side.tree],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if result.returncode:
                print(f"could not remove worktree {side.tree}: {result.stderr}", file=sys.stderr)
    subprocess.run(["git", "-C", repo, "worktree", "prune"], capture_output=True, timeout=120)


def harness_differs(repo: str, a: Side, b: Side) -> bool:
    """Whether A's and B's benchmark code (``HARNESS_DIRS``) differ."""
    result = subprocess.run(
        ["git", "-C", repo, "diff", "--quiet", a.commit, b.commit, "--", *HARNESS_DIRS],
        capture_output=True,
        timeout=120,
    )
    return result.returncode != 0


def copy_harness(source: str, target: str) -> None:
    """B's benchmark code over A's worktree (``--harness b``)."""
    for path in HARNESS_DIRS:
        if not os.path.isdir(os.path.join(source, path)):
            raise CompareError(f"--harness b: B has no {path}/")
        if not os.path.isdir(os.path.dirname(os.path.join(target, path))):
            raise CompareError(
                f"--harness b: A has no {os.path.dirname(path)}/ for B's {path}/ "
                "(another layout): use --harness own"
            )
        shutil.rmtree(os.path.join(target, path), ignore_errors=True)
        shutil.copytree(os.path.join(source, path), os.path.join(target, path))


def start(run: Run, python: str, bench_args: list[str]) -> subprocess.Popen:
    run.command = command(python, run.side.tree, bench_args, run.json_path)
    log = open(run.log_path, "w")
    try:
        return subprocess.Popen(
            run.command,
            cwd=run.side.tree,
            env=run_env(run.side.tree),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a timeout ends the benchmark's own processes too
        )
    finally:
        log.close()


def stop(process: subprocess.Popen) -> None:
    """End a run and every process it started (its session), TERM first."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(runs: list[Run], python: str, bench_args: list[str], timeout_s: float) -> None:
    """Start every run of a step, wait for all of them (each at most ``timeout_s``)."""
    started = time.monotonic()
    processes = []
    try:
        for run in runs:
            processes.append((run, start(run, python, bench_args)))
        for run, process in processes:
            left = max(0.0, started + timeout_s - time.monotonic())
            try:
                run.exit_code = process.wait(timeout=left)
            except subprocess.TimeoutExpired:
                run.timed_out = True
                stop(process)
                run.exit_code = process.returncode
            run.seconds = time.monotonic() - started
    finally:
        for _, process in processes:
            if process.poll() is None:
                stop(process)


def report(run: Run) -> str:
    outcome = "timed out" if run.timed_out else f"exit {run.exit_code}"
    wrote = run.json_path if run.wrote_json else f"no JSON (log: {run.log_path})"
    return (
        f"round {run.round} {run.side.name.upper()} ({run.side.rev} = {run.side.commit[:10]}): "
        f"{outcome} in {run.seconds:.1f} s -> {wrote}"
    )


def write_summary(path: str, head: dict, runs: list[Run]) -> dict[str, dict]:
    """``summary.json`` from the runs that wrote their JSON; the figures."""
    reports: dict[str, list[dict]] = {side: [] for side in SIDES}
    for run in runs:
        if run.wrote_json:
            with open(run.json_path) as f:
                reports[run.side.name].append(json.load(f))
    figures = summarise(reports["a"], reports["b"])
    document = {
        **head,
        "runs": [
            {
                "side": run.side.name,
                "round": run.round,
                "command": run.command,
                "exit_code": run.exit_code,
                "timed_out": run.timed_out,
                "seconds": run.seconds,
                "json": run.json_path if run.wrote_json else None,
                "log": run.log_path,
            }
            for run in runs
        ],
        "figures": figures,
    }
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
    return figures


def prepare_out(out: str) -> str:
    out = os.path.abspath(out)
    if os.path.isdir(out) and os.listdir(out):
        raise CompareError(f"--out {out} holds files already: name a new or empty directory")
    os.makedirs(out, exist_ok=True)
    return out


def compare(args, benchmarks: list[str]) -> int:
    bench_args = check_args(args.benchmark_args, benchmarks)
    if not 1 <= args.rounds <= MAX_ROUNDS:
        raise CompareError(f"--rounds must be 1 to {MAX_ROUNDS}, not {args.rounds}")
    if not 0 < args.timeout_s <= MAX_TIMEOUT_S:
        raise CompareError(f"--timeout-s must be above 0 and at most {MAX_TIMEOUT_S:.0f}")
    repo = git(args.repo, "rev-parse", "--show-toplevel")
    a, b = resolve(repo, "a", args.a), resolve(repo, "b", args.b)
    out = prepare_out(args.out)
    if args.harness == "own" and harness_differs(repo, a, b):
        print(
            f"note: A's and B's benchmark code ({', '.join(HARNESS_DIRS)}) differ; each runs its "
            "own (--harness b runs B's on both sides)"
        )
    head = {
        "benchmark": bench_args[0],
        "args": bench_args,
        "a": {"rev": a.rev, "commit": a.commit},
        "b": {"rev": b.rev, "commit": b.commit},
        "rounds": args.rounds,
        "at_once": args.at_once,
        "harness": args.harness,
        "python": args.python,
    }
    sides = {"a": a, "b": b}
    summary_path = os.path.join(out, "summary.json")
    runs: list[Run] = []
    root = tempfile.mkdtemp(prefix="epd-compare-")
    try:
        add_worktrees(repo, [a, b], root)
        if args.harness == "b":
            copy_harness(b.tree, a.tree)
        for step in schedule(args.rounds, args.at_once):
            step_runs = [
                Run(
                    side=sides[side],
                    round=i,
                    json_path=os.path.join(out, f"{side}-{i}.json"),
                    log_path=os.path.join(out, f"{side}-{i}.log"),
                )
                for i, side in step
            ]
            run_step(step_runs, args.python, bench_args, args.timeout_s)
            runs.extend(step_runs)
            for run in step_runs:
                print(report(run), flush=True)
            figures = write_summary(summary_path, head, runs)
    finally:
        remove_worktrees(repo, [a, b])
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{bench_args[0]}: A = {a.rev} ({a.commit[:10]}), B = {b.rev} ({b.commit[:10]})")
    print(table(figures))
    print(f"wrote {summary_path}")
    missing = [run for run in runs if not run.wrote_json]
    if missing:
        print(f"{len(missing)} of {len(runs)} runs wrote no JSON: see their logs", file=sys.stderr)
        return 1
    return 0


def main(args, benchmarks: list[str]) -> int:
    try:
        return compare(args, benchmarks)
    except CompareError as error:
        print(f"epd-bench compare: {error}", file=sys.stderr)
        return 1
