"""Waiting in tests: a condition polled until it holds, or a loud ``TimeoutError``."""

import time


def eventually(condition, what: str, seconds: float = 10, interval: float = 0.01) -> None:
    """Until ``condition()`` holds; ``TimeoutError`` naming ``what`` if it does not in ``seconds``."""
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= end:
            raise TimeoutError(f"{what}: not within {seconds} s")
        time.sleep(interval)
