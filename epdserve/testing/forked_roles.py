"""Role processes forked from a server that has already imported what the roles import (torch,
transformers and its processors, the project's servers): each role is a real process of its own
that runs its command's real ``main`` (``python -m MODULE ARGS`` semantics: ``runpy``), with its
own arguments, environment, working directory and log, but without the 3 to 4 s of CPU a new
interpreter spends on those imports. The integration tests start their clusters' roles this way
(``LocalCluster.fork_roles``); `make demo`, the benchmarks and the CLI tests start each command as
a new interpreter, as a deployment does.

The contract: what a module reads from the environment when it is imported is read once, in the
fork server, from the environment of the process that started it (the test worker's, which every
role's environment extends). A role started under another command (``prefix``: ``unshare``) is a
new interpreter.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from multiprocessing import resource_tracker

# What the fork server imports before it forks a role: the heavy part of every role's imports.
PRELOAD = (
    __name__,  # first: it notes the environment before the others' imports add to it
    "torch",
    "transformers",
    "epdserve.vision.families",
    "epdserve.vision.tower",
    "epdserve.data_plane.mooncake",
    "encode_worker.worker",
    "epdserve.gateway.app",
    "epdserve.prefill_server.app",
    "handshake.app",
)
# the fork server's environment before its imports (in the server; the test process's otherwise)
ENVIRONMENT_BEFORE_IMPORTS = dict(os.environ)

_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
    return _context


def _run(module: str, args: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked process: the role's output to its log, its environment (plus what the
    server's imports set, as they would have in a new interpreter), then its module as
    ``__main__``; exit handlers run as at a new interpreter's exit."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    added = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_BEFORE_IMPORTS}
    os.environ.clear()
    os.environ.update({**added, **env})
    os.chdir(cwd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # a resource tracker of its own, as a new interpreter starts one: the one the fork server
    # passed on is the test process's, and would keep a killed role's /dev/shm segments until the
    # test process ends instead of unlinking them when the role dies
    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:
        os.close(tracker._fd)
        tracker._fd = tracker._pid = None
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()


class ForkedRole:
    """The ``subprocess.Popen`` calls the cluster and its tests make, on a forked role."""

    def __init__(self, module_args: list[str], env: dict[str, str], cwd: str, log_path: str):
        module, *args = module_args
        self._process = _forkserver().Process(
            target=_run, args=(module, args, env, cwd, log_path), name=module
        )
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not yet reaped: the pid is still the role's
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
