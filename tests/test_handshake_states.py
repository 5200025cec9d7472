"""Random operation sequences against the room table never break its invariants."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, rule

from handshake.models import RoomState
from handshake.rooms import RoomError, RoomLimits, RoomTable
from tests.handshake_helpers import begin, commit, registration

RANK = {RoomState.PENDING: 0, RoomState.REGISTERED: 1, RoomState.WRITING: 2}
LIMITS = RoomLimits(max_live_rooms=6, max_tombstones=4, tombstone_ttl_s=5.0)


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


class RoomMachine(RuleBasedStateMachine):
    rooms = Bundle("rooms")

    @initialize()
    def setup(self):
        self.clock = Clock()
        self.table = RoomTable(LIMITS, clock=self.clock)
        self.seen = {}  # room -> (state, version) last observed

    @rule(target=rooms, count=st.integers(1, 3), ttl=st.floats(0.5, 20))
    def mint(self, count, ttl):
        try:
            minted = self.table.mint(count, ttl)
        except RoomError:
            assert self.table.live_rooms + count > LIMITS.max_live_rooms
            return multiple()
        assert len(set(minted)) == count and not set(minted) & set(self.seen)  # never reused
        return multiple(*minted)

    def _call(self, room, fn):
        try:
            view = fn()
        except RoomError:
            view = None
        self._observe(room)
        return view

    def _observe(self, room):
        try:
            view = self.table.view(room)
        except RoomError:
            return
        old = self.seen.get(room)
        if old is not None:
            old_state, old_version = old
            assert view.version >= old_version
            if old_state.terminal:
                assert view.state is old_state  # terminal states are sticky
            elif not view.state.terminal:
                assert RANK[view.state] >= RANK[old_state]  # forward only
        self.seen[room] = (view.state, view.version)

    @rule(room=rooms, generation=st.integers(0, 2))
    def register(self, room, generation):
        self._call(room, lambda: self.table.register(registration(room, generation)))

    @rule(room=rooms, generation=st.integers(0, 2))
    def begin_write(self, room, generation):
        self._call(room, lambda: self.table.begin_write(begin(room, generation, write_timeout_s=2)))

    @rule(room=rooms, generation=st.integers(0, 2), rows=st.sampled_from([64, 65]))
    def commit(self, room, generation, rows):
        before = self._snapshot(room)
        view = self._call(room, lambda: self.table.commit(commit(room, generation, rows=rows)))
        if view is None and before is not None:  # a refused commit changes nothing
            after = self._snapshot(room)
            assert after is None or after == before or after[0] is RoomState.EXPIRED

    def _snapshot(self, room):
        try:
            view = self.table.view(room)
        except RoomError:
            return multiple()
        return view.state, view.version

    @rule(room=rooms, settled=st.booleans())
    def fail(self, room, settled):
        self._call(room, lambda: self.table.fail(room, "boom", settled))

    @rule(room=rooms)
    def cancel(self, room):
        self._call(room, lambda: self.table.cancel(room, "stop"))

    @rule(seconds=st.floats(0, 4))
    def advance(self, seconds):
        self.clock.now += seconds
        self.table.sweep()
        for room in list(self.seen):
            self._observe(room)

    @invariant()
    def bounded(self):
        counts = self.table.counts()
        terminal = sum(counts[s] for s in RoomState if s.terminal)
        live = sum(counts[s] for s in RoomState if not s.terminal)
        assert terminal <= LIMITS.max_tombstones
        assert live <= LIMITS.max_live_rooms
        assert live == self.table.live_rooms


TestRoomMachine = RoomMachine.TestCase
TestRoomMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def _cancelled_while_writing():
    table = RoomTable()
    (room,) = table.mint(1, 10)
    table.register(registration(room))
    table.begin_write(begin(room))
    table.cancel(room, "user went away")
    return table, room


def test_a_commit_after_cancel_during_write_settles_as_cancelled():
    table, room = _cancelled_while_writing()
    view = table.commit(commit(room))
    assert view.state is RoomState.CANCELLED and view.writer_settled and view.commit is not None


def test_fail_after_cancel_keeps_both_reasons():
    table, room = _cancelled_while_writing()
    view = table.fail(room, "peer reset", settled=False)
    assert view.state is RoomState.CANCELLED and "user went away" in view.reason and "peer reset" in view.reason
    assert not view.writer_settled


def test_tombstones_answer_like_the_room_and_are_not_tracked_by_the_gc():
    import gc

    table = RoomTable()
    (room,) = table.mint(1, 60)
    table.register(registration(room))
    table.begin_write(begin(room))
    live_view = table.commit(commit(room))
    assert live_view.state is RoomState.SUCCESS
    tombstone_view = table.view(room)
    assert tombstone_view == live_view.model_copy(update={"expires_in_s": tombstone_view.expires_in_s})
    assert table.commit(commit(room)).state is RoomState.SUCCESS  # an idempotent retry against the tombstone
    gc.collect()
    assert not any(gc.is_tracked(record) for record in table._tombstones.values())


def test_a_second_writer_is_refused_and_the_first_may_retry():
    from handshake.rooms import RoomConflict

    table = RoomTable()
    (room,) = table.mint(1, 60)
    table.register(registration(room))
    assert table.begin_write(begin(room, writer="worker-a")).state is RoomState.WRITING
    assert table.begin_write(begin(room, writer="worker-a")).state is RoomState.WRITING  # idempotent retry
    try:
        table.begin_write(begin(room, writer="worker-b"))
        raise AssertionError("a second writer was let in")
    except RoomConflict as exc:
        assert "another writer (worker-a)" in str(exc)
    assert table.commit(commit(room)).state is RoomState.SUCCESS


def test_a_long_poll_answers_on_a_change_made_on_its_own_loop_and_after_its_wait_otherwise():
    """A change made on the waiter's own loop's thread (the encode worker's sender shares the
    server's loop) wakes it; an unchanged room answers after ``wait_s``; a waiter that is cancelled
    (its client went away) or answered leaves nothing armed."""
    import asyncio
    import time

    table = RoomTable()

    async def scenario():
        (changed, quiet, dropped) = table.mint(3, 60)
        version = table.view(changed).version
        watcher = asyncio.ensure_future(table.watch({changed: version}, 5.0))
        await asyncio.sleep(0)
        assert table.waiters == 1
        table.register(registration(changed))  # on this loop's thread
        (view,) = await asyncio.wait_for(watcher, 1.0)
        assert view.state is RoomState.REGISTERED

        started = time.monotonic()
        (view,) = await table.watch({quiet: version}, 0.2)
        assert view.state is RoomState.PENDING and 0.15 <= time.monotonic() - started < 2

        abandoned = asyncio.ensure_future(table.watch({dropped: version}, 5.0))
        await asyncio.sleep(0)
        abandoned.cancel()
        await asyncio.gather(abandoned, return_exceptions=True)
        table.register(registration(dropped))  # waking a cancelled waiter is harmless
        assert table.waiters == 0

    asyncio.run(scenario())
