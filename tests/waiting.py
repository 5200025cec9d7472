"""Time in tests: a condition polled until it holds (or a loud ``TimeoutError``), and a clock
the test moves by hand (``FakeClock``), for deadlines without sleeping."""

import time


def eventually(condition, what: str, seconds: float = 10, interval: float = 0.01) -> None:
    """Until ``condition()`` holds; ``TimeoutError`` naming ``what`` if it does not in
    ``seconds``."""
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= end:
            raise TimeoutError(f"{what}: not within {seconds} s")
        time.sleep(interval)


class FakeClock:
    """A monotonic clock that stands still until the test sets ``now``."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now
