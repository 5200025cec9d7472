"""Event loops on threads of their own, for the packages that run asyncio work beside threads:
the handshake server's and clients', the encode worker's sender, the prefill receiver's. Every
loop is uvloop's (uvicorn[standard] brings it; why: docs/performance.md, "Event loops")."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine

import uvloop


def new_event_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop()


class LoopThread:
    """An event loop running on a daemon thread until ``stop``."""

    def __init__(self, name: str):
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
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
