"""The room stream's and the REST routes' answers made without a model per room
(``handshake.answers``) are the documents the wire's models describe: each struct has its model's
fields in its order, a frame of views in every state, whole or without the registration and the
commit, and of refusals, parses to the answer the models make, and so does every REST route's
answer (the table's state machine checks every view after every step:
``tests/test_handshake_states.py``)."""

import pytest

from epdserve.wire.room_client import SyncHandshakeClient
from epdserve.wire.rooms import (
    BatchResponse,
    EncodeTimings,
    FailBody,
    RoomResult,
    RoomState,
    RoomView,
)
from handshake import answers, room_store
from handshake.app import create_app
from handshake.rooms import RoomError, RoomLimits, RoomTable
from handshake.server import ThreadedServer
from tests.handshake_helpers import begin, commit, registration
from tests.waiting import eventually


def test_each_struct_has_its_models_fields_in_its_order():
    assert answers.ViewJson.__struct_fields__ == tuple(RoomView.model_fields)
    assert answers.ResultJson.__struct_fields__ == tuple(RoomResult.model_fields)
    assert answers.FrameJson.__struct_fields__ == tuple(BatchResponse.model_fields)


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def _rooms_in_every_state(table: RoomTable) -> dict[str, int]:
    """A room of the table in each state a view can show (a reason that needs escaping)."""
    pending, staged, registered, writing, cancelling, done, failed, cancelled = table.mint(8, 30)
    table.mark_staged(staged)
    for room in (registered, writing, cancelling, done, failed):
        table.register(registration(room, deadline_s=12.5))
    for room in (writing, cancelling, done):
        table.begin_write(begin(room, write_timeout_s=5))
    table.cancel(cancelling, 'the "receiver" left \u2014 \u00e9\n')
    with_timings = commit(done).model_copy(
        update={"timings": EncodeTimings(queue_s=0.25, encode_s=1e-05, cache_hit=True)}
    )
    table.commit(with_timings)
    table.fail(failed, "no slot \\ left", settled=True)
    table.cancel(cancelled, "gone")
    return {
        "pending": pending,
        "staged": staged,
        "registered": registered,
        "writing": writing,
        "cancelling": cancelling,
        "success": done,
        "failed": failed,
        "cancelled": cancelled,
    }


@pytest.mark.parametrize("recent", [room_store.RECENT_ROOMS, 0], ids=["as-objects", "tombstones"])
def test_a_frame_of_views_and_refusals_parses_to_the_models_answer(monkeypatch, recent):
    monkeypatch.setattr(room_store, "RECENT_ROOMS", recent)  # 0: ended rooms read back as tuples
    clock = Clock()
    table = RoomTable(RoomLimits(), clock=clock)
    rooms = _rooms_in_every_state(table)
    clock.now += 3.25
    ids = list(rooms.values())
    assert {table.view(room).state for room in ids} == set(RoomState) - {RoomState.EXPIRED}
    for whole in (True, False):
        documents = [status.view_json(with_registration=whole) for status in table.statuses(ids)]
        for room, document in zip(ids, documents):
            expected = table.view(room)
            if not whole:
                expected = expected.model_copy(update={"registration": None})
            assert RoomView.model_validate_json(bytes(document)) == expected
    (writer,) = table.commit_all([commit(rooms["writing"])])
    writers_view = writer.view_json(with_registration=False, with_commit=False)
    assert RoomView.model_validate_json(bytes(writers_view)) == table.view(
        rooms["writing"]
    ).model_copy(update={"registration": None, "commit": None})
    pending = rooms["pending"]  # a room asked for twice is answered twice, in its places
    assert [bytes(s.view_json()) for s in table.statuses([pending, 12345, pending])[::2]] == [
        bytes(table.status(pending).view_json())
    ] * 2
    (missing,) = table.statuses([12345])
    assert isinstance(missing, RoomError)
    frame = answers.frame(
        [answers.viewed(room, s.view_json()) for room, s in zip(ids, table.statuses(ids))]
        + [answers.refused(12345, str(missing), missing.status)]
    )
    assert BatchResponse.model_validate_json(frame) == BatchResponse(
        results=[RoomResult.of_view(room, table.view(room)) for room in ids]
        + [RoomResult.refusal(12345, str(missing), missing.status)]
    )


def _refusal(room: int, call) -> RoomResult:
    """The refusal the table makes of ``call`` (which must refuse), as the API answers it."""
    with pytest.raises(RoomError) as refused:
        call()
    return RoomResult.refusal(room, str(refused.value), refused.value.status)


def test_every_rest_route_answers_the_documents_the_models_make():
    """The REST routes answer with ``handshake.answers``' JSON: each room's result is its model
    result from the table's view after the call, and each refusal the table's own (a frozen clock,
    so that ``expires_in_s`` holds still)."""
    table = RoomTable(RoomLimits(), clock=Clock())
    server = ThreadedServer(create_app(table)).start()
    client = SyncHandshakeClient(server.url)

    def models(*rooms: int) -> list[RoomResult]:
        return [RoomResult.of_view(room, table.view(room)) for room in rooms]

    try:
        a, b, c, d, e = client.mint(5, 30)
        assert client.register([registration(a), registration(b)]) == models(a, b)
        refused_d = _refusal(d, lambda: table.begin_write(begin(d)))
        assert client.begin_write([begin(a), begin(d)]) == models(a) + [refused_d]
        timed = commit(a).model_copy(update={"timings": EncodeTimings(queue_s=0.5)})
        assert client.commit([timed]) == models(a)
        assert client.fail([FailBody(room=b, reason='no "slot" \u2014 left')]) == models(b)
        unknown = _refusal(999, lambda: table.cancel(999, "gone"))
        assert client.cancel([c, 999], reason="gone") == models(c) + [unknown]
        assert client.watch({a: 0, b: 0, c: 0, 999: 0}) == models(a, b, c) + [
            RoomResult.refusal(999, unknown.error, unknown.status)
        ]
        version_a = table.view(a).version
        assert client.watch({a: version_a, d: 0}, changed_only=True) == models(d)
        assert client.get(a) == table.view(a)
        # a registration that waits: with a room refused, answered at once; else after the wait
        refused_c = _refusal(c, lambda: table.register(registration(c)))
        assert client.register([registration(c), registration(d)], wait_s=5) == [
            refused_c
        ] + models(d)
        assert client.register([registration(e)], wait_s=0.05) == models(e)
        # a room twice in a registration that waits: each answered now, in its place
        f, g = client.mint(2, 30)
        twice = [registration(f), registration(g), registration(g, generation=2)]
        answered = client.register(twice, wait_s=5)
        assert answered == models(f, g) + [
            _refusal(g, lambda: table.register(registration(g, generation=2)))
        ]
        (h,) = client.mint(1, 30)
        assert client.register([registration(h), registration(h)], wait_s=5) == models(h, h)
        # a registration that waits answers once its room changes
        (i,) = client.mint(1, 30)
        waiting = client.submit("register", [registration(i)], wait_s=10)
        eventually(lambda: table.waiters == 1, "the registration waiting")
        table.begin_write(begin(i))
        assert waiting.result(timeout=10) == models(i)
        assert table.view(i).state is RoomState.WRITING
    finally:
        client.close()
        server.stop()
