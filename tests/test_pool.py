"""Slot pools: leases never overlap, generations only grow, quarantine holds, nothing leaks."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from epdserve.data_plane.pool import MemoryRegion, NoCapacity, SlotPool, TooLarge
from tests.profiles import examples
from tests.waiting import FakeClock

SLOT = 64
SLOTS = 16


class PoolMachine(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.pool = SlotPool(
            MemoryRegion.anonymous(SLOT * SLOTS), SLOT, quarantine_s=5.0, clock=self.clock
        )
        self.live = {}  # first_slot -> lease
        self.held = {}  # first_slot -> (lease, until)
        self.last_generation = 0

    def _slots(self, lease):
        return set(range(lease.first_slot, lease.first_slot + lease.slot_count))

    @rule(target=leases, nbytes=st.integers(1, SLOT * SLOTS))
    def lease(self, nbytes):
        try:
            lease = self.pool.lease(nbytes)
        except NoCapacity:
            # refused only if no free run fits: check against our own model of the pool
            self._expire()
            taken = set().union(
                *(self._slots(lease) for lease in self.live.values()),
                *(self._slots(lease) for lease, _ in self.held.values()),
            )
            need = -(-nbytes // SLOT)
            runs = [
                all(s not in taken for s in range(start, start + need))
                for start in range(SLOTS - need + 1)
            ]
            assert not any(runs), "NoCapacity although a free run fitted"
            return None
        assert lease.generation > self.last_generation  # generations only grow
        self.last_generation = lease.generation
        assert lease.nbytes == nbytes and lease.slot_count * SLOT >= nbytes
        self._expire()
        for other in list(self.live.values()) + [held for held, _ in self.held.values()]:
            assert not (self._slots(other) & self._slots(lease)), (
                "lease overlaps a live or quarantined lease"
            )
        self.live[lease.first_slot] = lease
        return lease

    def _expire(self):
        for slot, (lease, until) in list(self.held.items()):
            if until <= self.clock.now:
                del self.held[slot]

    @rule(lease=leases)
    def release(self, lease):
        if lease is not None:
            self.pool.release(lease)  # idempotent, and a stale lease never frees a new tenant
            if self.live.get(lease.first_slot) == lease:
                del self.live[lease.first_slot]

    @rule(lease=leases)
    def quarantine(self, lease):
        if lease is not None:
            self.pool.quarantine(lease)
            if self.live.get(lease.first_slot) == lease:
                del self.live[lease.first_slot]
                self.held[lease.first_slot] = (lease, self.clock.now + 5.0)

    @rule(seconds=st.floats(0, 6))
    def advance(self, seconds):
        self.clock.now += seconds

    @invariant()
    def accounting_adds_up(self):
        self._expire()
        stats = self.pool.stats()  # reclaims ended quarantines first
        assert stats["leased_slots"] == sum(lease.slot_count for lease in self.live.values())
        assert stats["quarantined_slots"] == sum(
            lease.slot_count for lease, _ in self.held.values()
        )
        assert stats["free_slots"] + stats["leased_slots"] + stats["quarantined_slots"] == SLOTS

    def teardown(self):
        for lease in list(self.live.values()):
            self.pool.release(lease)
        self.clock.now += 10
        stats = self.pool.stats()
        assert stats["free_slots"] == SLOTS and stats["leases"] == 0  # nothing leaks
        self.pool.release(
            self.pool.lease(SLOT * SLOTS)
        )  # and the free runs coalesced back into one


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None
)


def test_exhaustion_answers_at_once_and_too_large_is_distinct():
    pool = SlotPool(MemoryRegion.anonymous(4 * SLOT), SLOT, quarantine_s=1.0)
    with pytest.raises(TooLarge):
        pool.lease(4 * SLOT + 1)
    leases = [pool.lease(SLOT) for _ in range(4)]
    with pytest.raises(NoCapacity):
        pool.lease(1)
    pool.release(leases[1])
    assert pool.lease(SLOT).first_slot == 1


def test_quarantine_holds_until_deadline():
    clock = FakeClock()
    pool = SlotPool(MemoryRegion.anonymous(SLOT), SLOT, quarantine_s=30.0, clock=clock)
    lease = pool.lease(10)
    pool.quarantine(lease)
    clock.now = 29.9
    with pytest.raises(NoCapacity):
        pool.lease(10)
    clock.now = 30.0
    assert pool.lease(10).generation == lease.generation + 1


def test_views_are_slices_of_the_one_region():
    pool = SlotPool(MemoryRegion.anonymous(4 * SLOT), SLOT, quarantine_s=1.0)
    a, b = pool.lease(SLOT + 1), pool.lease(5)
    assert (
        pool.view(a).numel() == SLOT + 1
        and pool.view(b).data_ptr() == pool.region.address + 2 * SLOT
    )
    with pytest.raises(ValueError):
        pool.lease(0)
