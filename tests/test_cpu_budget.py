"""The worker's CPU per image by thread group, and what it lets one worker feed a GPU."""

from types import SimpleNamespace

import pytest

from epdserve.bench.benchmarks.cpu_budget import OTHER, by_group, feed_rate


def test_threads_are_grouped_by_their_os_names():
    seconds = {
        "*": 9.9,  # the process's own total: not a thread
        "intake": 0.1,
        "prepare": 0.2,
        "preprocess": 0.6,
        "encode": 0.3,
        "stage": 0.05,
        "handshake": 0.15,
        "sender_0": 0.01,
        "housekeeping": 0.001,
        "ZMQbg/IO/0": 0.04,
        "python3": 0.5,
    }
    ms = by_group(seconds, items=100)
    assert ms["decode + preprocessing"] == 8.0  # prepare + its pool, 0.8 s over 100 items
    assert ms["intake"] == 1.0 and ms["tower thread"] == 3.0 and ms["handshake loop"] == 1.5
    assert ms["senders"] == 0.1 and ms["ZMQ I/O"] == 0.4 and ms[OTHER] == 5.0
    assert sum(ms.values()) == pytest.approx(1000 * (sum(seconds.values()) - 9.9) / 100)


def test_the_feed_rate_is_the_lowest_ceiling_and_names_its_group():
    ms = {"intake": 0.5, "decode + preprocessing": 8.0, "tower thread": 1.0, "staging": 0.25}
    settings = SimpleNamespace(preprocess_workers=4, send_workers=8)
    rate = feed_rate(ms | {OTHER: 3.0}, settings, cores=16)
    assert rate["ceilings_items_per_s"]["decode + preprocessing"] == 500.0  # 4 threads
    assert rate["ceilings_items_per_s"]["tower thread"] == 1000.0
    assert rate["ceilings_items_per_s"]["the process's cores"] == round(16_000 / 9.75, 1)
    assert (rate["items_per_s"], rate["stopped_first_by"]) == (500.0, "decode + preprocessing")
    # on two cores, the process runs out of cores first
    rate = feed_rate(ms, settings, cores=2)
    assert rate["stopped_first_by"] == "the process's cores"
    assert rate["items_per_s"] == round(2000 / 9.75, 1)
