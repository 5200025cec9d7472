"""`epd-bench compare` without a benchmark: the figures it reads from runs' JSON (medians, B/A
ratios, rows named by their labels), the commands and order it runs them in, what it refuses, and
one whole compare in a throwaway git repository whose `epd-bench` is a stub that writes JSON."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from epdserve.bench import compare
from epdserve.bench.cli import build_parser
from tests.waiting import eventually

BENCHMARKS = ["transfer", "handshake", "cost"]


def write(path, report) -> str:
    path.write_text(json.dumps(report))
    return str(path)


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def handshake_run(rates: dict[tuple, float]) -> dict:
    """A run shaped as `epd-bench handshake` writes one: levels named by their path and load."""
    return {
        "seconds_per_level_per_round": 1.5,
        "levels": [
            {
                "opener": "stream",
                "receiver": "stream",
                "sender": "stream",
                "batch": batch,
                "concurrency": concurrency,
                "rooms_per_s": rate,
                "lifecycles_per_s_rounds": [rate - 1, rate, rate + 1],
                "meets_goal": False,
            }
            for (batch, concurrency), rate in rates.items()
        ],
        "goals": {"batch 8: >= 15000 rooms/s": []},
    }


def test_the_summary_is_the_median_of_each_side_and_b_over_a(tmp_path):
    a = [
        write(tmp_path / f"a-{i}.json", handshake_run({(1, 8): r1, (8, 16): r8}))
        for i, (r1, r8) in enumerate([(100.0, 1000.0), (300.0, 3000.0), (200.0, 2000.0)])
    ]
    b = [
        write(tmp_path / f"b-{i}.json", handshake_run({(1, 8): r1, (8, 16): r8}))
        for i, (r1, r8) in enumerate([(250.0, 1500.0), (350.0, 1700.0), (150.0, 1600.0)])
    ]
    figures = compare.summarise([load(p) for p in a], [load(p) for p in b])
    level = "levels[opener=stream,receiver=stream,sender=stream,batch=1,concurrency=8]"
    assert figures[f"{level}.rooms_per_s"] == {
        "a": [100.0, 300.0, 200.0],
        "b": [250.0, 350.0, 150.0],
        "a_median": 200.0,
        "b_median": 250.0,
        "b_over_a": 1.25,
    }
    batch8 = "levels[opener=stream,receiver=stream,sender=stream,batch=8,concurrency=16]"
    assert figures[f"{batch8}.rooms_per_s"]["b_over_a"] == pytest.approx(1600 / 2000)
    # settings are figures too; per-round lists, booleans and empty lists are not
    assert figures["seconds_per_level_per_round"]["b_over_a"] == 1.0
    assert not [key for key in figures if "rounds" in key.split(".")[-1] or "meets_goal" in key]
    assert not [key for key in figures if key.startswith("goals")]
    table = compare.table(figures)
    assert f"{level}.rooms_per_s" in table and "1.250" in table
    assert "seconds_per_level_per_round" not in table  # the same in every run
    assert "(1 figures the same in every run of both sides are not shown)" in table


def test_rows_are_named_by_their_labels_or_their_place_and_round_records_are_left_out():
    report = {
        "configs": [
            {"images_per_request": 1, "transport": "shm", "cpu": {"worker": 0.5}},
            {"images_per_request": 8, "transport": "shm", "cpu": {"worker": 0.25}},
        ],
        "per_worker": [{"tower_items": 3}, {"tower_items": 4}],
        "phases": [{"workers": 1, "lost": 0}, {"workers": 1, "lost": 2}],
        "raw": [{"round": 0, "path": "epd", "ttft_ms": 9.0}],
        "ok": True,
        "model": "tiny",
        "delivery_ms": None,
    }
    assert compare.flatten(report) == {
        "configs[transport=shm,images_per_request=1].cpu.worker": 0.5,
        "configs[transport=shm,images_per_request=8].cpu.worker": 0.25,
        "per_worker[0].tower_items": 3.0,
        "per_worker[1].tower_items": 4.0,
        # the labels do not tell these rows apart: their places do, and the labels are figures
        "phases[0].workers": 1.0,
        "phases[0].lost": 0.0,
        "phases[1].workers": 1.0,
        "phases[1].lost": 2.0,
    }


def test_a_figure_one_side_lacks_or_a_zero_baseline_has_no_ratio():
    figures = compare.summarise(
        [{"only_a": 2, "zero": 0, "both": 4}, {"only_a": 4, "zero": 0, "both": 6}],
        [{"zero": 3, "both": 10, "only_b": 1}],
    )
    assert figures["only_a"] == {
        "a": [2.0, 4.0],
        "b": [],
        "a_median": 3.0,
        "b_median": None,
        "b_over_a": None,
    }
    assert figures["only_b"]["b_over_a"] is None and figures["only_b"]["a_median"] is None
    assert figures["zero"]["b_over_a"] is None
    assert figures["both"]["b_over_a"] == 2.0
    table = compare.table(figures)
    assert "only_a" in table and "only_b" in table and "2/0" in table and "0/1" in table


def test_rounds_interleave_as_the_benchmarks_do_or_run_both_sides_at_once():
    assert compare.schedule(3, at_once=False) == [
        [(1, "a")],
        [(1, "b")],
        [(2, "b")],
        [(2, "a")],
        [(3, "a")],
        [(3, "b")],
    ]
    assert compare.schedule(2, at_once=True) == [[(1, "a"), (1, "b")], [(2, "b"), (2, "a")]]


def test_each_side_runs_its_own_epd_bench_with_pythonpath_at_its_worktree(tmp_path):
    new, old, none = tmp_path / "new", tmp_path / "old", tmp_path / "none"
    (new / "epdserve" / "bench").mkdir(parents=True)
    (new / "epdserve" / "bench" / "cli.py").write_text("")
    (old / "bench").mkdir(parents=True)
    (old / "bench" / "cli.py").write_text("")
    none.mkdir()
    args = ["transfer", "--sizes", "1M", "--rounds", "5"]
    assert compare.command("/venv/bin/python", str(new), args, "/out/a-1.json") == [
        "/venv/bin/python",
        "-m",
        "epdserve.bench.cli",
        "transfer",
        "--sizes",
        "1M",
        "--rounds",
        "5",
        "--json",
        "/out/a-1.json",
    ]
    assert compare.command("py", str(old), args, "/out/b-1.json")[:3] == ["py", "-m", "bench.cli"]
    with pytest.raises(compare.CompareError, match="has no epd-bench"):
        compare.command("py", str(none), args, "/out/b-1.json")
    env = compare.run_env(str(new), {"PYTHONPATH": "/elsewhere", "HOME": "/root"})
    assert env == {"PYTHONPATH": str(new), "HOME": "/root"}


@pytest.mark.parametrize(
    "args, refusal",
    [
        ([], "name a benchmark"),
        (["--"], "name a benchmark"),
        (["encode"], "unknown benchmark 'encode'"),
        (["--rounds", "2", "transfer"], "options go before the revisions"),
        (["transfer", "--json", "x.json"], "--json is set by compare"),
        (["transfer", "--json=x.json"], "--json is set by compare"),
    ],
)
def test_a_benchmark_command_it_cannot_run_is_refused(args, refusal):
    with pytest.raises(compare.CompareError, match=refusal):
        compare.check_args(args, BENCHMARKS)


def test_the_benchmark_comes_after_the_revisions_with_or_without_a_separator():
    assert compare.check_args(["--", "cost", "--ceiling"], BENCHMARKS) == ["cost", "--ceiling"]
    assert compare.check_args(["cost", "--ceiling"], BENCHMARKS) == ["cost", "--ceiling"]
    args = build_parser().parse_args(
        ["compare", "--rounds", "2", "--out", "x", "HEAD~1", "HEAD", "--", "cost", "--ceiling"]
    )
    assert (args.a, args.b, args.rounds, args.out) == ("HEAD~1", "HEAD", 2, "x")
    assert compare.check_args(args.benchmark_args, args.benchmarks) == ["cost", "--ceiling"]
    assert "compare" not in args.benchmarks and "transfer" in args.benchmarks


# A stand-in `epd-bench` for the throwaway repository: it writes, as a benchmark's JSON, the
# revision's figure, which benchmark code ran, where it ran and its arguments.
STUB_CLI = textwrap.dedent(
    """\
    import json, os, sys
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    args = sys.argv[1:]
    report = {
        "figure": float(open(os.path.join(root, "figure.txt")).read()),
        "harness": open(os.path.join(here, "harness.txt")).read().strip(),
        "tree": root,
        "cwd": os.getcwd(),
        "pythonpath": os.environ["PYTHONPATH"],
        "args": args[: args.index("--json")],
    }
    with open(args[args.index("--json") + 1], "w") as f:
        json.dump(report, f)
    sys.exit(1)  # as a benchmark whose goal is missed: the JSON still counts
    """
)


def git(repo, *args) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()


def commit(repo, figure: str, harness: str) -> str:
    bench = repo / "epdserve" / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    (bench / "__init__.py").write_text("")
    (bench / "cli.py").write_text(STUB_CLI)
    (bench / "harness.txt").write_text(harness)
    (repo / "epdserve" / "testing").mkdir(exist_ok=True)
    (repo / "epdserve" / "testing" / "__init__.py").write_text(f"# {harness}\n")
    (repo / "figure.txt").write_text(figure)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"figure {figure}")
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    a = commit(repo, "2", "harness of A")
    b = commit(repo, "3", "harness of B")
    return repo, a, b


def run_compare(repo, out, *options, bench=("transfer", "--sizes", "1M")):
    args = build_parser().parse_args(
        [
            "compare",
            "--repo",
            str(repo),
            "--out",
            str(out),
            "--python",
            sys.executable,
            "--timeout-s",
            "60",
            *options,
            "HEAD~1",
            "HEAD",
            "--",
            *bench,
        ]
    )
    return compare.main(args, args.benchmarks)


def test_a_compare_runs_each_revision_in_its_worktree_and_removes_them(repo, tmp_path, capsys):
    repo, a, b = repo
    out = tmp_path / "out"
    assert run_compare(repo, out, "--rounds", "2") == 0
    summary = load(out / "summary.json")
    assert (summary["a"], summary["b"]) == (
        {"rev": "HEAD~1", "commit": a},
        {"rev": "HEAD", "commit": b},
    )
    assert [(run["round"], run["side"]) for run in summary["runs"]] == [
        (1, "a"),
        (1, "b"),
        (2, "b"),
        (2, "a"),
    ]
    assert all(run["exit_code"] == 1 and not run["timed_out"] for run in summary["runs"])
    assert summary["figures"]["figure"] == {
        "a": [2.0, 2.0],
        "b": [3.0, 3.0],
        "a_median": 2.0,
        "b_median": 3.0,
        "b_over_a": 1.5,
    }
    for run in summary["runs"]:
        report = load(run["json"])
        assert report["harness"] == f"harness of {run['side'].upper()}"
        assert report["tree"] == report["cwd"] == report["pythonpath"] != str(repo)
        assert report["args"] == ["transfer", "--sizes", "1M"]
        assert os.path.isfile(run["log"])
    printed = capsys.readouterr().out
    assert "note: A's and B's benchmark code" in printed
    assert "figure" in printed and "1.500" in printed
    # the worktrees are gone, and git knows it
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1
    assert not os.path.exists(load(summary["runs"][0]["json"])["tree"])


def test_with_harness_b_both_sides_run_bs_benchmark_code_at_once(repo, tmp_path, capsys):
    repo, _, _ = repo
    out = tmp_path / "out"
    assert run_compare(repo, out, "--rounds", "1", "--at-once", "--harness", "b") == 0
    summary = load(out / "summary.json")
    assert summary["at_once"] and summary["harness"] == "b"
    reports = {run["side"]: load(run["json"]) for run in summary["runs"]}
    assert reports["a"]["harness"] == reports["b"]["harness"] == "harness of B"
    assert (reports["a"]["figure"], reports["b"]["figure"]) == (2.0, 3.0)  # the product differs
    assert "note:" not in capsys.readouterr().out


def test_a_run_that_writes_no_json_fails_the_compare_and_says_where_its_log_is(
    repo, tmp_path, capsys
):
    repo, _, _ = repo
    broken = "import sys; sys.exit('no benchmark here')"
    (repo / "epdserve" / "bench" / "cli.py").write_text(broken)
    git(repo, "commit", "-q", "-am", "broken B")
    out = tmp_path / "out"
    assert run_compare(repo, out, "--rounds", "1") == 1
    captured = capsys.readouterr()
    assert "1 of 2 runs wrote no JSON" in captured.err
    assert f"no JSON (log: {out / 'b-1.log'})" in captured.out
    assert "no benchmark here" in (out / "b-1.log").read_text()
    summary = load(out / "summary.json")
    assert summary["figures"]["figure"]["a"] == [3.0] and summary["figures"]["figure"]["b"] == []


def test_unknown_revisions_and_used_output_directories_are_refused(repo, tmp_path, capsys):
    repo, _, _ = repo
    args = build_parser().parse_args(
        ["compare", "--repo", str(repo), "--out", str(tmp_path / "o"), "nope", "HEAD", "transfer"]
    )
    assert compare.main(args, args.benchmarks) == 1
    assert "revision 'nope' is no commit" in capsys.readouterr().err
    used = tmp_path / "used"
    used.mkdir()
    (used / "a-1.json").write_text("{}")
    assert run_compare(repo, used) == 1
    assert "holds files already" in capsys.readouterr().err
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1


def test_a_run_past_its_timeout_is_ended_with_the_processes_it_started(repo, tmp_path, capsys):
    repo, _, _ = repo
    pids = tmp_path / "pids"
    hang = textwrap.dedent(
        f"""\
        import subprocess, time
        child = subprocess.Popen(["sleep", "600"])
        with open({str(pids)!r}, "a") as f:
            f.write(f"{{child.pid}}\\n")
        time.sleep(600)
        """
    )
    (repo / "epdserve" / "bench" / "cli.py").write_text(hang)
    git(repo, "commit", "-q", "-am", "B hangs")
    out = tmp_path / "out"
    args = build_parser().parse_args(
        ["compare", "--repo", str(repo), "--out", str(out), "--python", sys.executable]
        + ["--timeout-s", "2", "--rounds", "1", "HEAD~1", "HEAD", "--", "transfer"]
    )
    assert compare.main(args, args.benchmarks) == 1
    runs = {run["side"]: run for run in load(out / "summary.json")["runs"]}
    assert runs["b"]["timed_out"] and runs["b"]["json"] is None
    assert not runs["a"]["timed_out"] and runs["a"]["json"]
    assert "round 1 B (HEAD = " in capsys.readouterr().out
    (child,) = [int(pid) for pid in pids.read_text().split()]
    # the benchmark's own child went with it: its session was ended
    eventually(lambda: not os.path.exists(f"/proc/{child}") or zombie(child), "child ended", 10)
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1


def zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"
