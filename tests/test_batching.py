"""The batch queue's window: a batch that is not full waits for more items, within the window from
its oldest item's arrival; full, closed by a budget, or already old, it goes at once. Each wait
here is bounded by a join that fails loudly; no test asserts a duration."""

import threading
import time

import pytest

from encode_worker.config import WorkerConfig
from encode_worker.scheduler import PACE_WINDOW_S, BatchQueue, EncodeJob
from epdserve.process_settings import SettingError
from epdserve.wire.addresses import EncodeHandshake
from tests.waiting import FakeClock

LONG_S = 60.0  # a window no test waits out: a batch that went early did not wait for it


def job(index: int, patches: int = 4, age_s: float = 0.0) -> EncodeJob:
    handshake = EncodeHandshake(bootstrap_room=index + 1, bootstrap_host="h", bootstrap_port=1)
    return EncodeJob(
        f"r{index}",
        handshake,
        index,
        "bytes",
        b"",
        patches=patches,
        received_at=time.monotonic() - age_s,
    )


class Taker:
    """``take_batch`` on a thread of its own, as the Prepare stage calls it."""

    def __init__(self, queue: BatchQueue):
        self.batch: list[EncodeJob] | None = None
        self._thread = threading.Thread(target=self._take, args=(queue,), daemon=True)
        self._thread.start()

    def _take(self, queue: BatchQueue) -> None:
        self.batch = queue.take_batch(LONG_S)

    def result(self, seconds: float = 10.0) -> list[int]:
        self._thread.join(seconds)
        if self._thread.is_alive():
            raise TimeoutError(f"take_batch still waiting after {seconds} s")
        return [j.content_hash for j in self.batch]


def test_a_burst_fills_one_batch_within_the_window():
    queue = BatchQueue(max_items=16, patch_budget=10**6, batch_items=3, window_s=LONG_S)
    assert queue.put(job(0))
    taker = Taker(queue)
    time.sleep(0.05)  # the taker holds a batch of one, waiting for more
    assert taker.batch is None
    assert queue.put(job(1)) and queue.put(job(2)) and queue.put(job(3))
    assert taker.result() == [0, 1, 2]  # full: it went without waiting out the window
    assert [j.content_hash for j in queue.drain()] == [3]  # (taken, it would wait out its own)


def test_a_budget_the_next_item_would_pass_closes_the_batch_at_once():
    queue = BatchQueue(max_items=16, patch_budget=10, batch_items=8, window_s=LONG_S)
    assert queue.put(job(0, patches=6)) and queue.put(job(1, patches=6))
    assert Taker(queue).result() == [0]


def test_an_item_that_already_waited_its_window_does_not_wait_again():
    queue = BatchQueue(max_items=16, patch_budget=10**6, batch_items=8, window_s=LONG_S)
    assert queue.put(job(0, age_s=LONG_S + 1))  # queued behind a busy tower for longer
    assert Taker(queue).result() == [0]


def test_a_lone_item_goes_when_its_window_ends():
    queue = BatchQueue(max_items=16, patch_budget=10**6, batch_items=8, window_s=0.05)
    assert queue.put(job(0))
    assert Taker(queue).result() == [0]


def test_without_a_window_a_batch_takes_what_is_queued():
    queue = BatchQueue(max_items=16, patch_budget=10**6, batch_items=8, window_s=0.0)
    assert queue.put(job(0))
    assert [j.content_hash for j in queue.take_batch(0)] == [0]


def test_draining_the_queue_ends_a_waiting_batch():
    queue = BatchQueue(max_items=16, patch_budget=10**6, batch_items=8, window_s=LONG_S)
    assert queue.put(job(0))
    taker = Taker(queue)
    time.sleep(0.05)
    queue.drain()
    assert taker.result() in ([0], [])  # taken before the drain, or drained with the queue


@pytest.mark.parametrize("window", ["-0.001", "0.5"])
def test_the_window_is_bounded(window, tmp_path):
    with pytest.raises((SettingError, ValueError)):
        WorkerConfig(model=str(tmp_path), bind="127.0.0.1", batch_window_s=window)


def _take_at(queue: BatchQueue, clock: FakeClock, now: float, arriving: int = 0) -> int:
    """Queue ``arriving`` jobs of 100 patches, then take a batch at ``now``: its size."""
    for _ in range(arriving):
        assert queue.put(job(queue._puts + 1000, patches=100))
    clock.now = now
    return len(queue.take_batch(0))


def test_the_wait_a_queued_item_would_have_follows_the_quiet_pace_measured_under_a_backlog():
    """Unknown until the consumer came back three times to jobs that waited with none arriving
    meanwhile (a burst's arrival slows the batches taken while it lasts, not the drain after);
    then the patches queued times the lower quartile of those batches' seconds per patch; a take
    after the queue had emptied (an idle pipeline) is no sample."""
    clock = FakeClock()
    queue = BatchQueue(max_items=64, patch_budget=400, batch_items=4, clock=clock)
    for index in range(24):
        assert queue.put(job(index, patches=100))
    # batches of 400 patches: 0.8 s twice while jobs arrive, then 0.2-0.24 s each
    assert _take_at(queue, clock, 0.0) == 4
    for now in (0.8, 1.6):
        assert _take_at(queue, clock, now, arriving=4) == 4
        assert queue.wait_s() is None
    for now in (1.8, 2.04):
        assert _take_at(queue, clock, now) == 4
        assert queue.wait_s() is None  # one, then two quiet samples
    assert _take_at(queue, clock, 2.24) == 4
    # the lower quartile of 0.0005, 0.0006, 0.0005 (the median of all five: 0.0006)
    assert queue.seconds_per_patch == pytest.approx(0.0005)
    assert queue.patches == 800 and queue.wait_s() == pytest.approx(800 * 0.0005)
    assert _take_at(queue, clock, 2.44) == 4
    assert _take_at(queue, clock, 2.64) == 4  # the last: the queue is empty behind it
    assert queue.put(job(40, patches=100))
    clock.now = 100.0  # idle meanwhile: no sample of 97 s
    assert len(queue.take_batch(0)) == 1
    assert queue.seconds_per_patch == pytest.approx(0.0005) and queue.wait_s() == 0.0


def test_under_arrivals_that_last_the_window_their_pace_is_the_pace():
    """Jobs arriving while every batch is taken, for ``PACE_WINDOW_S``: the contention lasts,
    and the estimate is the lower quartile of those batches."""
    clock = FakeClock()
    queue = BatchQueue(max_items=128, patch_budget=100, batch_items=1, clock=clock)
    assert queue.put(job(0, patches=100)) and queue.put(job(1, patches=100))
    now = 0.0
    _take_at(queue, clock, now)
    while now < PACE_WINDOW_S:  # 0.4 s per batch, a job arriving during each
        assert queue.wait_s() is None
        now = round(now + 0.4, 6)
        _take_at(queue, clock, now, arriving=1)
    assert queue.seconds_per_patch == pytest.approx(0.004)


def test_a_pipeline_slowed_for_good_is_followed_within_the_window():
    """Every batch slow for ``PACE_WINDOW_S``: the estimate is theirs."""
    clock = FakeClock()
    queue = BatchQueue(max_items=256, patch_budget=100, batch_items=1, clock=clock)
    for index in range(200):
        assert queue.put(job(index, patches=100))
    now = 0.0
    for _ in range(5):  # 0.1 s per batch
        _take_at(queue, clock, now)
        now = round(now + 0.1, 6)
    assert queue.seconds_per_patch == pytest.approx(0.001)
    slowed = now
    while now < slowed + PACE_WINDOW_S + 0.4:  # 0.4 s per batch from now on
        _take_at(queue, clock, now)
        now = round(now + 0.4, 6)
    assert queue.seconds_per_patch == pytest.approx(0.004)
