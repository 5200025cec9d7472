"""Copied in as ``sitecustomize.py`` by ``publish-insitu.sh``: in the process that imports the
receiver, ``Publisher.__call__`` is wrapped to count its calls and their thread CPU, written to
``$PUBLISH_TIMER_OUT`` every 2 s (calls, CPU seconds, us per call)."""

import importlib
import importlib.abc
import os
import sys
import threading
import time


def _install() -> None:
    from prefill_side import publish

    original = publish.Publisher.__call__
    stats = {"calls": 0, "cpu_s": 0.0}

    def timed(self, *args, **kwargs):
        started = time.thread_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            stats["cpu_s"] += time.thread_time() - started
            stats["calls"] += 1

    publish.Publisher.__call__ = timed

    def dump() -> None:
        while True:
            time.sleep(2)
            if not stats["calls"]:  # another process that imports the receiver, or not yet
                continue
            with open(os.environ["PUBLISH_TIMER_OUT"], "w") as out:
                per_call = 1e6 * stats["cpu_s"] / max(1, stats["calls"])
                out.write(f"{stats['calls']} {stats['cpu_s']:.4f} {per_call:.2f}\n")

    threading.Thread(target=dump, daemon=True).start()


class _OnReceiverImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "prefill_side.receiver":
            sys.meta_path.remove(self)
            importlib.import_module("prefill_side.publish")
            _install()
        return None


if "PUBLISH_TIMER_OUT" in os.environ:
    sys.meta_path.insert(0, _OnReceiverImport())
