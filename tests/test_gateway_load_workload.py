"""The workloads of ``epd-bench gateway --scenario burst|steady|mixed``: what each policy of a
round is sent."""

import argparse

import pytest

from epdserve.bench.benchmarks.gateway_load import workload
from epdserve.bench.cli import build_parser


def _args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["gateway", *flags])


def test_a_burst_sends_its_requests_at_once():
    requests = workload(_args("--scenario", "burst", "--burst-requests", "5", "--images", "3"), 0)
    assert len(requests) == 5
    assert all(request.at_s == 0 and request.sides == (224, 224, 224) for request in requests)


@pytest.mark.parametrize("scenario", ["steady", "mixed"])
def test_arrivals_are_the_same_for_every_policy_of_a_round_and_differ_between_rounds(scenario):
    args = _args("--scenario", scenario, "--rate", "20", "--seconds", "30", "--images", "3")
    first, again, second = workload(args, 0), workload(args, 0), workload(args, 1)
    assert first == again and first != second
    offsets = [request.at_s for request in first]
    assert offsets == sorted(offsets) and 0 < offsets[0] and offsets[-1] < 30
    # Poisson arrivals at 20 a second for 30 s: 600 expected, 5 standard deviations either side
    assert 600 - 5 * 600**0.5 < len(first) < 600 + 5 * 600**0.5


def test_mixed_requests_draw_their_counts_and_sides_and_steady_ones_do_not():
    flags = ("--rate", "20", "--seconds", "10", "--images", "3", "--mixed-sizes", "112,448")
    mixed = workload(_args("--scenario", "mixed", *flags), 0)
    assert {len(request.sides) for request in mixed} == {1, 2, 3}
    assert {side for request in mixed for side in request.sides} == {112, 448}
    steady = workload(_args("--scenario", "steady", *flags), 0)
    assert {request.sides for request in steady} == {(224, 224, 224)}
