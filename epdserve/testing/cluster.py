"""Every EPD role as its own process on this machine: what `make demo`, `epd-bench e2e` and the
integration tests run. Each process is the real command (`epd-handshake`, `epd-encode-worker`,
`epd-prefill`, `epd-gateway`) on 127.0.0.1 with free ports, its output in a log file. ``start_*``
spawn (they start in parallel); ``wait_ready()`` waits until each answers its readiness URL;
``stop()`` sends SIGTERM (then SIGKILL after a grace period) and reports each exit code.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from epdserve.dispatcher.workers import WorkerAddress
from epdserve.testing.forked_roles import ForkedRole
from epdserve.wire.addresses import Endpoint

# the checkout's root (epdserve/testing/cluster.py is three levels below it): the roles run its code
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST = "127.0.0.1"


async def metric_total(session, url: str, name: str, **labels: str) -> float | None:
    """The sum of a role's ``name`` samples (its ``/metrics`` at ``url``, read with the aiohttp
    ``session``) whose labels include ``labels``; None when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(url + "/metrics") as response:
        text = await response.text()
    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values) if values else None


def _ephemeral_ports() -> range:
    """The ports the kernel hands out itself (to ``bind(0)`` and to outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


# Ports free_port handed out in this process: free when handed out, but bound only once the
# role that got one has started, so a later call must not hand one out again meanwhile.
_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=4096)


def free_port(host: str = HOST) -> int:
    """A port free on ``host`` now and not handed out here before, chosen at random below the
    kernel's ephemeral range: a port ``bind(0)`` returned could be handed to another process's
    outgoing connection (or its own ``bind(0)``) before a server binds it, which two test
    processes at once made happen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = 10000
    high = _ephemeral_ports().start
    # the system's randomness, not the module's generator: an engine in the same process seeds
    # that (vLLM: ``random.seed(0)``), and two test processes would then try the same ports
    for port in random.SystemRandom().sample(range(low, high), min(200, high - low)):
        if port in _HANDED_OUT:
            continue
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.append(port)
        return port
    with socket.socket(family) as s:  # the low range taken: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Role:
    name: str
    process: subprocess.Popen | ForkedRole
    url: str  # its HTTP endpoint (rooms, /healthz, /metrics)
    ready_path: str
    log_path: str
    ready: bool = False
    worker: WorkerAddress | None = None  # encode workers: how a dispatcher reaches it

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])


class LocalCluster:
    # True: roles are forked from a server that has their imports done (``forked_roles``), as the
    # test suite sets it (tests/conftest.py); False: each role is a new interpreter, as deployed
    fork_roles = False
    # every gateway's --placement unless its ``extra`` names one (None: the gateway's default);
    # the test suite pins ``workers`` (tests/conftest.py): its tests follow the disaggregated path
    placement: str | None = None

    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        log_dir: str | None = None,
        env: dict | None = None,
    ):
        """``env``: added to every role's environment (the deployment's tokens, say)."""
        self.model_dir = model_dir
        self.dtype = dtype
        self.env = env or {}
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="epd-cluster-")
        self.roles: list[Role] = []

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- roles -----------------------------------------------------------------------------

    # ``env`` adds environment variables to a role's process; ``prefix`` runs it under another
    # command (the fault tests start one in a private mount namespace with ``unshare``).

    def start_handshake(
        self, name: str = "handshake", extra: tuple[str, ...] = (), **launch
    ) -> Role:
        port = free_port()
        return self._start(
            name,
            ["handshake.server", "--host", HOST, "--port", str(port), *extra],
            Endpoint(HOST, port).url("http"),
            ready_path="/healthz",
            **launch,
        )

    def start_encode_worker(
        self,
        name: str = "encode-worker",
        transports: str = "shm,mooncake",
        cache_bytes: int = 1 << 30,
        extra: tuple[str, ...] = (),
        host: str = HOST,
        module: str = "encode_worker.cli",
        model: str | None = None,
        dtype: str | None = None,
        address: WorkerAddress | None = None,
        **launch,
    ) -> Role:
        """``host``: the loopback address it listens on and names itself by (``::1`` for IPv6);
        ``module``: what runs it (``bench.stand_in_worker`` for the control plane's ceiling);
        ``model`` / ``dtype``: its own, other than the cluster's; ``address``: its ports (a
        worker that takes a stopped one's place), else free ones."""
        address = address or WorkerAddress(host, free_port(host), free_port(host))
        host, bootstrap, intake = address.host, address.bootstrap_port, address.intake_port
        role = self._start(
            name,
            [
                module,
                "--model",
                model or self.model_dir,
                "--dtype",
                dtype or self.dtype,
                "--host",
                host,
                "--bind",
                host,
                "--bootstrap-port",
                str(bootstrap),
                "--intake-port",
                str(intake),
                "--transports",
                transports,
                "--cache-bytes",
                str(cache_bytes),
                "--ring-bytes",
                str(256 << 20),
                *extra,
            ],
            address.url,
            ready_path="/readyz",
            **launch,
        )
        role.worker = address
        return role

    def start_prefill(
        self,
        name: str = "prefill",
        transports: str = "shm,mooncake",
        pool_bytes: int = 512 << 20,
        extra: tuple[str, ...] = (),
        **launch,
    ) -> Role:
        port = free_port()
        return self._start(
            name,
            [
                "epdserve.prefill_server.cli",
                "--host",
                HOST,
                "--port",
                str(port),
                "--model",
                self.model_dir,
                "--dtype",
                self.dtype,
                "--transports",
                transports,
                "--pool-bytes",
                str(pool_bytes),
                *extra,
            ],
            Endpoint(HOST, port).url("http"),
            ready_path="/healthz",
            **launch,
        )

    def start_gateway(
        self,
        vllm,
        workers: list[WorkerAddress],
        name: str = "gateway",
        extra: tuple[str, ...] = (),
        **launch,
    ) -> Role:
        """``epd-gateway`` in front of ``vllm`` (a ``testing.vllm_servers.Server`` with the EPD
        connector: its API and its engine description), ready once it serves (vLLM may still be
        starting: the gateway's /readyz says when it is ready to take requests)."""
        port = free_port()
        return self._start(
            name,
            [
                "epdserve.gateway.cli",
                "--host",
                HOST,
                "--port",
                str(port),
                "--model",
                self.model_dir,
                "--vllm-url",
                vllm.url,
                "--engine-url",
                vllm.engine_url,
                "--workers",
                ",".join(str(w) for w in workers),
                *(
                    ("--placement", self.placement)
                    if self.placement is not None and "--placement" not in extra
                    else ()
                ),
                *extra,
            ],
            Endpoint(HOST, port).url("http"),
            ready_path="/health",
            **launch,
        )

    def _start(
        self,
        name: str,
        module_args: list[str],
        url: str,
        ready_path: str,
        env: dict | None = None,
        prefix: tuple[str, ...] = (),
    ) -> Role:
        env = {
            **os.environ,
            "PYTHONPATH": ROOT,
            "OMP_WAIT_POLICY": "PASSIVE",
            "MC_LOG_LEVEL": "ERROR",
            **self.env,
            **(env or {}),
        }
        log_path = os.path.join(self.log_dir, f"{name}.log")
        if self.fork_roles and not prefix:
            process = ForkedRole(module_args, env, ROOT, log_path)
        else:
            with open(log_path, "ab") as log:
                process = subprocess.Popen(
                    [*prefix, sys.executable, "-m", *module_args],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
        role = Role(name, process, url, ready_path, log_path)
        self.roles.append(role)
        return role

    def wait_ready(self, timeout_s: float = 120) -> None:
        """Until every role started so far answers 200 on its readiness URL."""
        end = time.monotonic() + timeout_s
        for role in self.roles:
            while not role.ready:
                if not role.alive():
                    raise RuntimeError(
                        f"{role.name} exited with {role.process.returncode} while starting:\n"
                        f"{role.log_tail()}"
                    )
                if time.monotonic() > end:
                    raise TimeoutError(
                        f"{role.name} was not ready within {timeout_s} s:\n{role.log_tail()}"
                    )
                try:
                    with urllib.request.urlopen(role.url + role.ready_path, timeout=1) as response:
                        role.ready = response.status == 200
                except OSError:
                    time.sleep(0.1)

    # ---- ending ----------------------------------------------------------------------------

    def kill(self, role: Role, signum: int = signal.SIGKILL) -> None:
        if role.alive():
            role.process.send_signal(signum)
            role.process.wait(30)

    def stop(self, grace_s: float = 30.0) -> dict[str, int]:
        """SIGTERM to every role still running, SIGKILL after ``grace_s``; exit code per role."""
        for role in self.roles:
            if role.alive():
                role.process.send_signal(signal.SIGTERM)
        codes = {}
        for role in self.roles:
            try:
                codes[role.name] = role.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                role.process.kill()
                codes[role.name] = role.process.wait(10)
        self.roles.clear()
        return codes
