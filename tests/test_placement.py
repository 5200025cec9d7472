"""``--placement cost``'s model (``gateway.placement.PlacementCosts``): priors, medians of the
recent observations per route and size class, the inline load, probes."""

from hypothesis import given
from hypothesis import strategies as st

from epdserve.gateway.placement import (
    COST,
    COST_WINDOW,
    PROBE_EVERY,
    PlacementCosts,
    Reason,
    Route,
    size_class,
)
from epdserve.gateway.settings import GatewaySettings


def test_size_classes_bound_a_requests_patches():
    assert [size_class(n) for n in (1, 1024, 1025, 4096, 65536, 65537)] == [
        "1024",
        "1024",
        "4096",
        "4096",
        "65536",
        "larger",
    ]


def test_until_measured_the_workers_are_predicted_sooner():
    decided = PlacementCosts().decide(patches=1024, inline_patches=0)
    assert decided.route is Route.ENCODE_WORKER and decided.reason is Reason.SOONER
    assert decided.encode_worker_s < decided.vllm_s
    assert not decided.measured and decided.patches == 1024  # a prior


def test_a_slowed_route_is_left_within_a_few_requests_and_taken_again_once_fast():
    costs = PlacementCosts()
    costs.observe(Route.VLLM, 500, 1.0)
    for _ in range(COST_WINDOW):
        costs.observe(Route.ENCODE_WORKER, 500, 0.2)
    assert costs.decide(500, 0).route is Route.ENCODE_WORKER
    slow = 0
    while costs.decide(500, 0).route is Route.ENCODE_WORKER:
        costs.observe(Route.ENCODE_WORKER, 500, 6.0)
        slow += 1
    assert slow == COST_WINDOW // 2  # the median moves once half the recent requests were slow
    # the probes measure the workers again; once fast, they are sooner again
    probes = 0
    while costs.decide(500, 0).route is Route.VLLM:
        costs.observe(Route.VLLM, 500, 1.0)
        probes += 1
        assert probes <= 4 * PROBE_EVERY * COST_WINDOW, "the workers were never probed again"
    assert costs.decisions % PROBE_EVERY == 0  # a probe took the workers
    assert costs.decide(500, 0).route is Route.VLLM  # (and the next is the sooner again)
    for _ in range(COST_WINDOW // 2 + 1):  # the probed workers are fast again
        costs.observe(Route.ENCODE_WORKER, 500, 0.2)
    assert costs.decide(500, 0).route is Route.ENCODE_WORKER


def test_an_unmeasured_route_is_probed_once_the_other_is_measured_in_its_size_class():
    costs = PlacementCosts()
    assert costs.decide(100, 0).reason is Reason.SOONER  # neither measured: the prior
    costs.observe(Route.ENCODE_WORKER, 100, 0.3)
    probe = costs.decide(100, 0)
    assert probe.route is Route.VLLM and probe.reason is Reason.PROBE
    # one probe at a time: until it is measured, the sooner route
    assert costs.decide(100, 0).reason is Reason.SOONER
    costs.observe(Route.VLLM, 100, 0.1)  # the prior was wrong: vLLM is sooner
    decided = costs.decide(100, 0)
    assert decided.route is Route.VLLM and decided.reason is Reason.SOONER
    # another size class is measured on its own; no probe while vLLM encodes inline for others
    costs.observe(Route.ENCODE_WORKER, 10_000, 3.0)
    assert costs.decide(10_000, inline_patches=64).reason is Reason.SOONER
    assert costs.decide(10_000, 0).reason is Reason.PROBE


def test_a_probe_that_taught_nothing_lets_the_next_decision_probe_again():
    costs = PlacementCosts()
    costs.observe(Route.ENCODE_WORKER, 100, 0.3)
    probe = costs.decide(100, 0)
    assert probe.reason is Reason.PROBE and probe.probed is Route.VLLM and not probe.measured
    assert costs.decide(100, 0).reason is Reason.SOONER  # one probe at a time
    costs.settle(probe)  # its request failed, or its images went another way
    again = costs.decide(100, 0)
    assert again.reason is Reason.PROBE and again.route is Route.VLLM
    costs.observe(Route.VLLM, again.patches, 0.5)
    costs.settle(again)  # (settled after its observation: nothing more)
    measured = costs.decide(100, 0)
    assert measured.reason is Reason.SOONER and measured.measured and measured.probed is None


def test_the_cost_policy_is_the_default():
    assert GatewaySettings.model_fields["placement"].default == COST


def test_costs_are_per_size_class():
    costs = PlacementCosts()
    costs.observe(Route.ENCODE_WORKER, 100, 0.3)
    costs.observe(Route.ENCODE_WORKER, 10_000, 3.0)
    assert costs.cost_s(Route.ENCODE_WORKER, 200) == 0.3
    assert costs.cost_s(Route.ENCODE_WORKER, 9_000) == 3.0
    assert costs.costs() == {("encode_worker", "1024"): 0.3, ("encode_worker", "16384"): 3.0}


def test_no_probe_while_vllm_encodes_inline_for_others():
    costs = PlacementCosts()
    decided = [costs.decide(100, inline_patches=64) for _ in range(2 * PROBE_EVERY)]
    assert {d.reason for d in decided} == {Reason.SOONER}
    assert costs.decide(100, inline_patches=0).reason is Reason.SOONER  # the 33rd
    costs.decisions = PROBE_EVERY - 1
    assert costs.decide(100, inline_patches=0).reason is Reason.PROBE


def test_inline_patches_ahead_delay_vllms_route_at_its_measured_pace():
    costs = PlacementCosts()
    costs.observe(Route.VLLM, 1000, 1.0)  # 1 ms per patch
    costs.observe(Route.ENCODE_WORKER, 1000, 1.5)
    assert costs.decide(1000, inline_patches=0).route is Route.VLLM
    loaded = costs.decide(1000, inline_patches=1000)
    assert loaded.vllm_s == 2.0 and loaded.route is Route.ENCODE_WORKER


@given(
    seen=st.lists(st.floats(0.01, 100), min_size=1, max_size=40),
    patches=st.integers(1, 100_000),
)
def test_the_cost_is_the_median_of_the_last_window(seen, patches):
    costs = PlacementCosts()
    for seconds in seen:
        costs.observe(Route.VLLM, patches, seconds)
    recent = sorted(seen[-COST_WINDOW:])
    middle = len(recent) // 2
    median = recent[middle] if len(recent) % 2 else (recent[middle - 1] + recent[middle]) / 2
    assert abs(costs.cost_s(Route.VLLM, patches) - median) <= 1e-9 * median
