"""Threads of our own: event loops on threads, for the packages that run asyncio work beside
threads (the handshake server's and clients', the encode worker's sender, the prefill
receiver's), and threads named where the OS shows them. Every loop is uvloop's (uvicorn[standard]
brings it; why: docs/performance.md, "Choices these measurements settled")."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import os
import threading
from collections.abc import Callable, Coroutine

import uvloop

PR_SET_NAME = 15  # prctl(2): the calling thread's name, 15 bytes and a NUL
_prctl = getattr(ctypes.CDLL(None), "prctl", None)  # Linux's C library has it


def name_os_thread(name: str | None = None) -> None:
    """Name the calling thread as the OS sees it (``top -H``, ``/proc/<pid>/task/<tid>/comm``,
    perf; ``epd-bench cost`` reads each thread's CPU by it): ``name``, or else its Python name,
    cut to 15 bytes. Python's own thread names stay inside the interpreter."""
    if _prctl is not None:
        _prctl(PR_SET_NAME, (name or threading.current_thread().name).encode()[:15])


def nice_this_thread(niceness: int) -> None:
    """Add ``niceness`` to the calling thread's nice value (Linux schedules threads apart: a
    bulk-work thread yields the CPU to the latency-bound ones of its process; raising it needs no
    privilege)."""
    if niceness:
        thread = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, current + niceness))


def named_thread(target: Callable[[], object], name: str, niceness: int = 0) -> threading.Thread:
    """A daemon thread (not started) running ``target``, named ``name`` in Python and the OS,
    ``niceness`` added to its nice value (``nice_this_thread``)."""

    def run() -> None:
        name_os_thread(name)
        nice_this_thread(niceness)
        target()

    return threading.Thread(target=run, name=name, daemon=True)


def new_event_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop()


class LoopThread:
    """An event loop running on a daemon thread until ``stop``."""

    def __init__(self, name: str):
        self.loop = new_event_loop()
        self.thread = named_thread(self.loop.run_forever, name)
        self.thread.start()

    def submit(self, coroutine: Coroutine) -> concurrent.futures.Future:
        """Run a coroutine on the loop; the future is its result, for any thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine, timeout: float | None = None):
        """``submit`` and wait for the result (never from the loop's own thread)."""
        return self.submit(coroutine).result(timeout)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)
        if not self.thread.is_alive():
            self.loop.close()
