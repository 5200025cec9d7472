"""Random operation sequences against the room table never break its invariants."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, rule

from epdserve.wire.rooms import Registration, RoomState, RoomView
from handshake.rooms import RoomConflict, RoomError, RoomLimits, RoomNotFound, RoomsFull, RoomTable
from tests.handshake_helpers import begin, commit, registration
from tests.profiles import examples

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

    @invariant()
    def each_rooms_stream_answer_is_its_view(self):
        """The room stream's answer made without a model (``handshake.answers``) is the view's
        document, in whatever state the steps left the room."""
        rooms = list(self.seen)
        for room, status in zip(rooms, self.table.statuses(rooms)):
            if isinstance(status, RoomError):
                continue
            assert RoomView.model_validate_json(bytes(status.view_json())) == self.table.view(room)


TestRoomMachine = RoomMachine.TestCase
TestRoomMachine.settings = settings(
    max_examples=examples(200), stateful_step_count=40, deadline=None
)


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
    assert (
        view.state is RoomState.CANCELLED
        and "user went away" in view.reason
        and "peer reset" in view.reason
    )
    assert not view.writer_settled


def test_tombstones_answer_like_the_room_and_are_not_tracked_by_the_gc():
    """A room that just ended answers from the object kept beside its tombstone; an older one
    from the tombstone itself: the same view either way."""
    import gc

    from handshake.room_store import RECENT_ROOMS

    table = RoomTable()
    (room,) = table.mint(1, 60)
    table.register(registration(room))
    table.begin_write(begin(room))
    live_view = table.commit(commit(room))
    assert live_view.state is RoomState.SUCCESS
    recent_view = table.view(room)
    for other in table.mint(RECENT_ROOMS, 60):  # push it out of the recent rooms
        table.cancel(other, "gone")
    tombstone_view = table.view(room)
    for view in (recent_view, tombstone_view):
        assert view == live_view.model_copy(update={"expires_in_s": view.expires_in_s})
    assert (
        table.commit(commit(room)).state is RoomState.SUCCESS
    )  # an idempotent retry against the tombstone
    gc.collect()
    assert not any(gc.is_tracked(record) for record in table._store.tombstones.values())


def test_a_second_writer_is_refused_and_the_first_may_retry():
    from handshake.rooms import RoomConflict

    table = RoomTable()
    (room,) = table.mint(1, 60)
    table.register(registration(room))
    assert table.begin_write(begin(room, writer="worker-a")).state is RoomState.WRITING
    assert (
        table.begin_write(begin(room, writer="worker-a")).state is RoomState.WRITING
    )  # idempotent retry
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
        assert view.state is RoomState.PENDING and time.monotonic() - started >= 0.15  # waited

        abandoned = asyncio.ensure_future(table.watch({dropped: version}, 5.0))
        await asyncio.sleep(0)
        abandoned.cancel()
        await asyncio.gather(abandoned, return_exceptions=True)
        table.register(registration(dropped))  # waking a cancelled waiter is harmless
        assert table.waiters == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("end", ["commit", "fail", "cancel"])
def test_a_watch_until_ended_sleeps_through_the_write_and_wakes_at_the_end(end):
    """``until_ended`` (the receiver's long-poll): a write that begins, or a cancel requested
    during it, answers nothing; the room's end answers at once. A room that changed before the
    watch was armed does not answer it either, unless it has ended."""
    import asyncio

    table = RoomTable()

    async def scenario():
        (room,) = table.mint(1, 60)
        version = table.register(registration(room)).version
        watcher = asyncio.ensure_future(table.watch({room: version}, 5.0, until_ended=True))
        await asyncio.sleep(0)
        table.begin_write(begin(room))
        if end == "cancel":  # a cancel during the write wakes the writer only
            table.cancel(room, "the client left")
        await asyncio.sleep(0.05)
        assert not watcher.done() and table.waiters == 1
        late = asyncio.ensure_future(table.watch({room: version}, 5.0, until_ended=True))
        await asyncio.sleep(0.05)
        assert not late.done()  # past its version, but not ended: armed
        if end == "commit":
            table.commit(commit(room))
        else:
            table.fail(room, "tower error", settled=True)
        for waiting in (watcher, late):
            (view,) = await asyncio.wait_for(waiting, 1.0)
            assert view.state.terminal
        assert table.waiters == 0
        (view,) = await asyncio.wait_for(
            table.watch({room: version}, 5.0, until_ended=True), 1.0
        )  # ended before the watch: answered at once
        assert view.state.terminal

    asyncio.run(scenario())


def test_a_changed_only_watch_builds_views_of_the_rooms_with_news_only():
    """``changed_only``: None for each room still at its version, a view for one past it, the
    refusal for one unknown, in the order asked."""
    import asyncio

    table = RoomTable()
    quiet, moved = table.mint(2, 60)
    versions = {room: table.register(registration(room)).version for room in (quiet, moved)}
    table.begin_write(begin(moved))
    versions[12345] = 0
    quiet_view, moved_view, unknown = asyncio.run(table.watch(versions, 0.0, changed_only=True))
    assert quiet_view is None and moved_view.state is RoomState.WRITING
    assert isinstance(unknown, RoomNotFound)


def test_a_commit_needs_a_begun_write_and_its_writer():
    """A commit on a REGISTERED room skipped WRITING, and with it the one-writer rule: refused,
    and the room is unchanged. A commit or a failure naming another writer than the one that
    began the write is refused too."""
    from handshake.rooms import RoomConflict

    table = RoomTable(clock=Clock())
    (room,) = table.mint(1, 60)
    table.register(registration(room))
    before = table.view(room)
    with pytest.raises(RoomConflict, match="no write has begun"):
        table.commit(commit(room))
    assert table.view(room) == before
    table.begin_write(begin(room, writer="worker-a"))
    with pytest.raises(RoomConflict, match="worker-a began"):
        table.commit(commit(room).model_copy(update={"writer": "worker-b"}))
    with pytest.raises(RoomConflict, match="worker-a is writing"):
        table.fail(room, "not mine", settled=True, writer="worker-b")
    view = table.view(room)
    assert view.state is RoomState.WRITING and not view.writer_settled
    assert (
        table.commit(commit(room).model_copy(update={"writer": "worker-a"})).state
        is RoomState.SUCCESS
    )


@pytest.mark.parametrize("end", ["cancel", "fail", "expire"])
def test_registering_in_a_room_that_ended_is_refused_with_why(end):
    """A registration in a room that ended before any receiver came answered ok with the terminal
    view; now it is refused with the state and the reason, and the room is unchanged. A retry of
    the registration a room took still answers its view."""
    from handshake.rooms import RoomConflict

    clock = Clock()
    table = RoomTable(clock=clock)
    (room, taken) = table.mint(2, 10)
    if end == "cancel":
        table.cancel(room, "request aborted")
    elif end == "fail":
        table.fail(room, "corrupt image", settled=True)
    else:
        clock.now += 11
    before = table.view(room)
    with pytest.raises(
        RoomConflict, match=f"ended {before.state.value} before this receiver registered"
    ) as info:
        table.register(registration(room))
    assert before.reason in str(info.value)
    assert table.view(room) == before
    if end != "expire":
        table.register(registration(taken))
        table.cancel(taken, "request aborted")
        assert (
            table.register(registration(taken)).state is RoomState.CANCELLED
        )  # a retry of the one it took


def test_a_registration_is_checked_against_its_own_offers():
    """64 TiB of rows against a 1 MiB offer was accepted; so were two offers of one transport and
    an offer running past the end of its address space."""
    from pydantic import ValidationError

    from epdserve.wire.offers import LoopbackOffer, MooncakeOffer

    def offer(capacity, offset=0):
        return LoopbackOffer(kind="loopback", region=1, offset=offset, capacity=capacity)

    huge = dict(room=1, generation=1, rows=1 << 24, width=1 << 20, dtype="float32")
    with pytest.raises(
        ValidationError, match="70368744177664 bytes, more than the loopback offer's capacity"
    ):
        Registration(**huge, offers=[offer(1 << 20)])
    small = dict(room=1, generation=1, rows=4, width=8, dtype="bfloat16")  # 64 bytes
    with pytest.raises(ValidationError, match="more than the loopback offer's capacity of 63"):
        Registration(**small, offers=[offer(63)])
    with pytest.raises(ValidationError, match="one offer per transport"):
        Registration(**small, offers=[offer(64), offer(64, offset=64)])
    with pytest.raises(ValidationError, match="runs past"):
        Registration(
            **small,
            offers=[
                MooncakeOffer(kind="mooncake", session="h:1", address=(1 << 64) - 32, capacity=64)
            ],
        )
    with pytest.raises(ValidationError, match="runs past"):
        Registration(**small, offers=[offer(64, offset=1 << 40)])
    assert Registration(**small, offers=[offer(64)]).nbytes == 64


def test_room_lifetimes_are_bounded_and_a_full_table_says_so():
    """Mints asked for up to an hour per room: a flood held the table that long. A TTL over the
    table's maximum is refused; ``full`` tells readiness when no room can be minted."""
    clock = Clock()
    table = RoomTable(RoomLimits(max_live_rooms=4, max_ttl_s=30), clock=clock)
    with pytest.raises(RoomError, match="outside"):
        table.mint(1, 3600)
    assert table.live_rooms == 0 and not table.full()
    table.mint(4, 30)
    assert table.full()
    clock.now += 30
    assert not table.full() and table.live_rooms == 0  # past their deadline: expired, room again


def test_a_room_opened_by_its_id_is_never_a_reused_id_and_discard_leaves_no_trace():
    """``open`` (an encode worker's intake, with the dispatcher's id) takes only an id never used
    here; ``discard`` forgets an untouched room only, without a tombstone."""
    clock = Clock()
    table = RoomTable(RoomLimits(max_live_rooms=2, max_ttl_s=30), clock=clock)
    table.open(7, 30)
    assert table.view(7).state is RoomState.PENDING
    with pytest.raises(RoomConflict, match="exists already"):
        table.open(7, 30)
    table.cancel(7, "gone")
    with pytest.raises(RoomConflict):  # a tombstone's id is not reused either
        table.open(7, 30)
    with pytest.raises(RoomError, match="outside"):
        table.open(8, 3600)
    with pytest.raises(RoomError, match="outside"):
        table.open(0, 30)
    table.open(8, 30)
    table.open(9, 30)
    with pytest.raises(RoomsFull):
        table.open(10, 30)
    table.discard(8)
    with pytest.raises(RoomNotFound):
        table.view(8)
    assert table.live_rooms == 1 and table.counts()[RoomState.PENDING] == 1
    table.register(registration(9))
    with pytest.raises(RoomConflict, match="untouched"):  # a receiver came: it stays
        table.discard(9)
    with pytest.raises(RoomConflict, match="untouched"):
        table.discard(7)
    clock.now += 30
    table.sweep()  # the discarded room's deadline passes without a trace
    assert table.counts()[RoomState.EXPIRED] == 1 and table.live_rooms == 0
