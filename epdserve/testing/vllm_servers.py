"""The paths `epd-bench vllm` compares and the vLLM servers behind them: which servers each path
needs, the ``--ec-transfer-config`` each gets, and `Server`, one vLLM OpenAI server process (with
its engine processes) started on this machine, checked for health, measured for CPU time from
/proc, stopped, and read for the events its timed connector traced. `bench.demo`,
`bench.gateway` and the tests reach `Server` and its helpers through `bench.vllm`.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

TRACE_ENV = "EPD_BENCH_VLLM_TRACE"  # a server's connector appends its events here (JSON lines)
PATHS = (
    "epd-shm",
    "epd-shm-staged",
    "epd-mooncake",
    "example",
    "mooncake-ec",
    "cpu-ec",
    "colocated",
    "epd-shm-tp2",
    "colocated-tp2",
)
OURS = ("epd-shm", "epd-shm-staged", "epd-mooncake", "epd-shm-tp2")
# epd-shm-staged: as epd-shm, but the request goes to vLLM once the worker holds the image's rows
# (as the gateway sends it: dispatcher.staged), not as soon as the worker took the image
STAGED = "epd-shm-staged"
SERVERS_OF = {
    "epd-shm": ["epd"],
    "epd-shm-staged": ["epd"],
    "epd-mooncake": ["epd"],
    "colocated": ["epd"],
    "example": ["example-producer", "example-consumer"],
    "mooncake-ec": ["mooncake-producer", "mooncake-consumer"],
    "cpu-ec": ["cpu-producer", "cpu-consumer"],
    # the EPD connector on a tensor-parallel size 2 engine (one process per rank), and that
    # engine's own tower
    "epd-shm-tp2": ["epd-tp2"],
    "colocated-tp2": ["epd-tp2"],
}
TENSOR_PARALLEL = {"epd-tp2": 2}  # server -> its tensor-parallel size (others: 1)


def consumer_of(path: str) -> str:
    """The server whose engine takes the path's rows (and whose CPU per image is measured)."""
    return SERVERS_OF[path][-1]


def producer_of(path: str) -> str | None:
    """The server that encodes for the path, where it is a vLLM server (an encode-only one)."""
    servers = SERVERS_OF[path]
    return servers[0] if len(servers) > 1 else None


class Server:
    """One vLLM OpenAI server process (and its engine processes), logging to a file."""

    def __init__(
        self,
        name: str,
        model: str,
        log_dir: str,
        ec_config: dict | None,
        dtype: str,
        max_model_len: int,
        env: dict | None = None,
        extra: tuple[str, ...] = (),
        images_per_prompt: int = 1,
    ):
        from epdserve.testing.cluster import free_port

        self.name, self.model, self.port = name, model, free_port()
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.trace_path = os.path.join(log_dir, f"{name}.trace")
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            dtype,
            "--enforce-eager",
            "--max-model-len",
            str(max_model_len),
            "--limit-mm-per-prompt",
            json.dumps({"image": images_per_prompt, "video": 1}),
            *extra,
        ]
        self.engine_url = None  # the EPD connector's http_port, where it runs one
        if ec_config is not None:
            if ec_config.get("ec_connector") == "EPDConnector":
                extra_config = ec_config.get("ec_connector_extra_config") or {}
                if "http_port" not in extra_config:
                    extra_config = {**extra_config, "http_port": free_port()}
                    ec_config = {**ec_config, "ec_connector_extra_config": extra_config}
                self.engine_url = f"http://127.0.0.1:{extra_config['http_port']}"
            command += ["--ec-transfer-config", json.dumps(ec_config)]
        env = {
            **os.environ,
            TRACE_ENV: self.trace_path,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
            "MC_LOG_LEVEL": "ERROR",
            **(env or {}),
        }
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode}: {self.log_tail()}"
            )
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 6) -> str:
        with open(self.log_path, errors="replace") as f:
            kept = [
                line.strip()
                for line in f
                if any(word in line for word in ("Error", "error", "raise", "fail"))
                and "ulimit" not in line
            ]  # vLLM's start-up warning about the fd limit says "failed"
        return " | ".join(kept[-lines:]) or "(no error in its log)"

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) so far of each process of the server, by process name (the
        API server's, vLLM's ``VLLM::EngineCore``, ...)."""
        return cpu_seconds({self.process.pid, *descendants(self.process.pid)})

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def events(self) -> list[dict]:
        if not os.path.exists(self.trace_path):
            return []
        with open(self.trace_path) as f:
            return [json.loads(line) for line in f]


def cpu_seconds(pids) -> dict[str, float]:
    """CPU time (user + system) so far of these processes, summed by process name (from /proc)."""
    by_name: dict[str, float] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                name, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
        except OSError:  # ended meanwhile
            continue
        fields = rest.split()
        by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf(
            "SC_CLK_TCK"
        )
    return by_name


def descendants(root: int) -> set[int]:
    """The processes under ``root``, now (from /proc)."""
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                parents[int(stat.split("/")[2])] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:  # the process ended while we listed
            continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _wait_healthy(servers: list[Server], timeout_s: float) -> dict[str, str]:
    """Until every server answers /health; the ones that exit or time out, with why."""
    failed, waiting = {}, list(servers)
    end = time.monotonic() + timeout_s
    while waiting:
        for server in list(waiting):
            try:
                if server.healthy():
                    waiting.remove(server)
            except RuntimeError as exc:
                failed[server.name] = str(exc)
                waiting.remove(server)
        if waiting and time.monotonic() > end:
            for server in waiting:
                failed[server.name] = f"not healthy within {timeout_s:.0f} s: {server.log_tail()}"
            break
        time.sleep(0.5)
    return failed


def _ec(
    connector: str, role: str, module: str | None = "epdserve.bench.benchmarks.vllm", **fields
) -> dict:
    config = {"ec_connector": connector, "ec_role": role, **fields}
    if module:
        config["ec_connector_module_path"] = module
    return config
