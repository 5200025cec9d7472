"""Copied in as ``sitecustomize.py`` by the scripts beside it: in every process started with
``FUNC_TIMER`` set (``module:Class.method`` or ``module:function``, comma-separated), each named
callable is wrapped once its module is imported (looked for every 50 ms) to count its calls and
their thread CPU, written to ``$FUNC_TIMER_OUT.<pid>`` every 2 s as lines of name, calls, CPU
seconds and microseconds per call. A wrapper adds about 1 us to each call it times (nested ones
add theirs to their callers'); a callable bound before it was wrapped (a thread's target) is not
timed."""

import os
import sys
import threading
import time


def _wrap(owner, attribute: str, stats: list) -> None:
    original = getattr(owner, attribute)

    def timed(*args, **kwargs):
        started = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            stats[0] += 1
            stats[1] += time.thread_time() - started

    setattr(owner, attribute, timed)


def _run(targets: list[tuple[str, str]], out: str) -> None:
    stats: dict[str, list] = {}
    pending = list(targets)
    while True:
        time.sleep(0.05 if pending else 2)
        for module_name, path in list(pending):
            module = sys.modules.get(module_name)
            if module is None:
                continue
            *owners, attribute = path.split(".")
            owner = module
            try:  # (a module still being imported may not have it yet)
                for name in owners:
                    owner = getattr(owner, name)
                getattr(owner, attribute)
            except AttributeError:
                continue
            stats[path] = [0, 0.0]
            _wrap(owner, attribute, stats[path])
            pending.remove((module_name, path))
        if any(calls for calls, _ in stats.values()):
            with open(f"{out}.{os.getpid()}", "w") as file:
                for path, (calls, cpu_s) in stats.items():
                    per_call = 1e6 * cpu_s / max(1, calls)
                    file.write(f"{path} {calls} {cpu_s:.4f} {per_call:.2f}\n")


if os.environ.get("FUNC_TIMER"):
    _targets = [tuple(spec.split(":")) for spec in os.environ["FUNC_TIMER"].split(",")]
    threading.Thread(
        target=_run, args=(_targets, os.environ["FUNC_TIMER_OUT"]), daemon=True
    ).start()
