"""The handshake service against a real uvicorn server on loopback, through the project's client."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from epdserve.process_settings.secrets import handshake_token as load_token
from epdserve.wire.room_client import HandshakeError, SyncHandshakeClient
from epdserve.wire.rooms import FailBody, RoomState
from handshake.app import create_app
from handshake.rooms import RoomLimits, RoomTable
from handshake.server import ThreadedServer
from tests.handshake_helpers import begin, commit, get_json, registration


def _serve(**limits_and_token):
    token = limits_and_token.pop("token", None)
    table = RoomTable(RoomLimits(**limits_and_token))
    server = ThreadedServer(create_app(table, token=token, max_body_bytes=64 << 10)).start()
    return server, table


@pytest.fixture(scope="module")
def served():
    server, table = _serve()
    client = SyncHandshakeClient(server.url)
    yield server, client, table
    client.close()
    server.stop()


def _one(results):
    (result,) = results
    return result


def test_full_lifecycle_and_every_call_idempotent(served):
    server, client, _ = served
    (room,) = client.mint(1, 30)
    assert client.get(room).state is RoomState.PENDING
    reg = registration(room)
    first = _one(client.register([reg]))
    assert first.ok and first.view.state is RoomState.REGISTERED
    again = _one(client.register([reg]))
    assert again.view.state is RoomState.REGISTERED and again.view.version == first.view.version
    writing = _one(client.begin_write([begin(room)]))
    assert writing.view.state is RoomState.WRITING and writing.view.transport == "loopback"
    assert _one(client.begin_write([begin(room)])).view.version == writing.view.version
    done = _one(client.commit([commit(room)]))
    assert (
        done.view.state is RoomState.SUCCESS
        and done.view.commit.checksum == 7
        and done.view.writer_settled
    )
    assert _one(client.commit([commit(room)])).view.version == done.view.version  # a retried commit
    # terminal is sticky: late fail / cancel / register answer the same terminal view
    assert _one(client.fail([FailBody(room=room, reason="late")])).view.state is RoomState.SUCCESS
    assert _one(client.cancel([room])).view.state is RoomState.SUCCESS
    assert _one(client.register([reg])).view.state is RoomState.SUCCESS
    assert client.get(room).version == done.view.version


def test_conflicting_calls_are_refused_and_change_nothing(served):
    _, client, _ = served
    (room,) = client.mint()
    assert _one(client.begin_write([begin(room)])).status == 409  # no receiver yet
    client.register([registration(room, generation=5)])
    other = _one(client.register([registration(room, generation=6)]))
    assert not other.ok and other.status == 409
    version = client.get(room).version
    stale = _one(client.commit([commit(room, generation=4)]))
    assert stale.status == 409 and "stale generation" in stale.error
    wrong_shape = _one(client.commit([commit(room, generation=5, rows=65)]))
    assert wrong_shape.status == 409 and "does not match" in wrong_shape.error
    assert _one(client.begin_write([begin(room, generation=4)])).status == 409
    skipped = _one(client.commit([commit(room, generation=5)]))  # no begin_write: WRITING skipped
    assert skipped.status == 409 and "no write has begun" in skipped.error
    view = client.get(room)
    assert view.state is RoomState.REGISTERED and view.version == version
    client.begin_write([begin(room, generation=5)])
    assert _one(client.commit([commit(room, generation=5)])).view.state is RoomState.SUCCESS
    assert _one(client.commit([commit(room, generation=5, checksum=8)])).status == 409


def test_receiver_first_then_sender_learns_by_long_poll(served):
    _, client, _ = served
    (room,) = client.mint()
    version = client.get(room).version
    threading.Timer(
        0.2,
        lambda: (
            client.client
            and SyncHandshakeClient(client.client.base_url).register([registration(room)])
        ),
    ).start()
    (result,) = client.watch({room: version}, wait_s=10)
    # woken by the registration: a long-poll that waited its 10 s out would answer PENDING
    assert result.view.state is RoomState.REGISTERED


def test_a_receivers_register_and_wait_until_ended_answers_with_the_commit(served):
    """Over REST: the register that waits ``until_ended`` is not answered when the write begins
    (no second round trip for the receiver), and is answered by the commit."""
    _, client, _ = served
    (room,) = client.mint()
    writer = SyncHandshakeClient(client.client.base_url)

    def write():
        writer.begin_write([begin(room)])
        time.sleep(0.3)  # a write in flight; the watch must not answer meanwhile
        writer.commit([commit(room)])

    threading.Timer(0.2, write).start()
    (result,) = client.register([registration(room)], wait_s=10, until_ended=True)
    assert result.view.state is RoomState.SUCCESS
    writer.close()


def test_a_changed_only_watch_answers_with_the_rooms_that_ended_only(served):
    """Over REST, a receiver's long-poll over a request's rooms with ``changed_only``: the answer
    holds the room that ended, not the views of the others (each would be parsed again at every
    answer); the next watch answers the next room to end, and one past its wait answers empty."""
    _, client, _ = served
    rooms = client.mint(3)
    registered = client.register([registration(room) for room in rooms])
    versions = {result.room: result.view.version for result in registered}
    writer = SyncHandshakeClient(client.client.base_url)

    def end(room):
        writer.begin_write([begin(room)])
        writer.commit([commit(room)])

    threading.Timer(0.2, end, args=(rooms[1],)).start()
    results = client.watch(versions, wait_s=10, until_ended=True, changed_only=True)
    assert [(r.room, r.view.state) for r in results] == [(rooms[1], RoomState.SUCCESS)]
    del versions[rooms[1]]
    writer.fail([FailBody(room=rooms[2], reason="tower error", settled=True)])
    results = client.watch(versions, wait_s=10, until_ended=True, changed_only=True)
    assert [(r.room, r.view.state) for r in results] == [(rooms[2], RoomState.FAILED)]
    assert client.watch({rooms[0]: versions[rooms[0]]}, wait_s=0.1, changed_only=True) == []
    everything = client.watch({rooms[0]: versions[rooms[0]]}, wait_s=0.1)
    assert [(r.room, r.view.state) for r in everything] == [(rooms[0], RoomState.REGISTERED)]
    writer.close()


def test_encoder_fails_before_receiver_registers(served):
    _, client, _ = served
    (room,) = client.mint()
    client.fail([FailBody(room=room, reason="corrupt image: cannot decode PNG", settled=True)])
    late = _one(client.register([registration(room)]))
    assert (
        not late.ok
        and late.status == 409
        and "ended FAILED" in late.error
        and "cannot decode" in late.error
    )


def test_registering_after_a_cancel_is_refused_and_changes_nothing(served):
    """It answered ``ok: true`` (with the CANCELLED view) although no registration was taken."""
    _, client, _ = served
    (room,) = client.mint()
    client.cancel([room], "request aborted")
    before = client.get(room)
    late = _one(client.register([registration(room)]))
    assert not late.ok and late.status == 409 and late.view is None
    assert "ended CANCELLED before this receiver registered: request aborted" in late.error
    after = client.get(room)
    assert (after.state, after.version, after.registration) == (before.state, before.version, None)


def test_cancel_during_write_waits_for_the_writer(served):
    _, client, _ = served
    rooms = client.mint(2)
    for room in rooms:
        client.register([registration(room)])
        client.begin_write([begin(room, write_timeout_s=0.5)])
    for room in rooms:
        view = _one(client.cancel([room], "request aborted")).view
        assert view.state is RoomState.WRITING and view.cancel_requested
    finished = _one(client.commit([commit(rooms[0])])).view
    assert finished.state is RoomState.CANCELLED and finished.writer_settled
    # the second writer never reports: its write deadline ends the room, unsettled
    (result,) = client.watch({rooms[1]: client.get(rooms[1]).version}, wait_s=5)
    assert result.view.state is RoomState.CANCELLED and not result.view.writer_settled


def test_cancel_before_write_stops_the_writer(served):
    _, client, _ = served
    (room,) = client.mint()
    client.register([registration(room)])
    assert _one(client.cancel([room])).view.state is RoomState.CANCELLED
    assert _one(client.begin_write([begin(room)])).view.state is RoomState.CANCELLED


def test_expiry_wakes_long_pollers(served):
    _, client, _ = served
    (room,) = client.mint(1, ttl_s=0.3)
    version = client.get(room).version
    answered = {}
    poller = threading.Thread(
        target=lambda: answered.setdefault(
            "view", client.get(room, after_version=version, wait_s=30)
        )
    )
    poller.start()
    poller.join(15)  # far less than the long-poll's own 30 s: only the expiry can end it first
    assert not poller.is_alive(), "the room's expiry did not wake its long-poll"
    assert answered["view"].state is RoomState.EXPIRED


def test_tombstones_have_a_ttl_and_a_bound():
    server, table = _serve(max_tombstones=3, tombstone_ttl_s=0.3)
    client = SyncHandshakeClient(server.url)
    try:
        rooms = client.mint(5)
        for room in rooms:
            client.cancel([room])
        assert [_one(client.watch({r: 0})).status for r in rooms] == [404, 404, 200, 200, 200]
        time.sleep(0.5)
        assert all(_one(client.watch({r: 0})).status == 404 for r in rooms)
        with pytest.raises(HandshakeError) as info:
            client.get(rooms[-1])
        assert info.value.status == 404
    finally:
        client.close()
        server.stop()


def test_live_rooms_are_bounded_with_retry_after():
    server, table = _serve(max_live_rooms=4)
    client = SyncHandshakeClient(server.url)
    try:
        client.mint(4)
        request = urllib.request.Request(
            server.url + "/v1/rooms",
            data=b'{"count": 1}',
            headers={"content-type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=5)
        assert info.value.code == 503 and info.value.headers["Retry-After"] == "1"
        with pytest.raises(HandshakeError) as refused:
            client.mint(1)
        assert refused.value.status == 503
        assert table.live_rooms == 4
    finally:
        client.close()
        server.stop()


def test_bearer_token(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    assert load_token(str(token_file)) == "s3cret"
    monkeypatch.setenv("EPD_HANDSHAKE_TOKEN", "from-env")
    assert load_token(None) == "from-env"
    server, _ = _serve(token="s3cret")
    anonymous = SyncHandshakeClient(server.url, retries=0)
    wrong = SyncHandshakeClient(server.url, token="nope", retries=0)
    right = SyncHandshakeClient(server.url, token="s3cret")
    try:
        for client in (anonymous, wrong):
            with pytest.raises(HandshakeError) as info:
                client.mint()
            assert info.value.status == 401
        assert right.mint(2)
        assert anonymous.healthy()  # probes need no token
    finally:
        for client in (anonymous, wrong, right):
            client.close()
        server.stop()


def _post(url, data: bytes):
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/rooms", b"{not json", 422),
        ("/v1/rooms", b'{"count": true}', 422),
        ("/v1/rooms", b'{"count": "3"}', 422),
        ("/v1/rooms", b'{"count": 0}', 422),
        ("/v1/rooms", b'{"count": 1, "bogus": 1}', 422),
        ("/v1/rooms/cancel", b'{"rooms": [0]}', 422),
        ("/v1/rooms/cancel", b'{"rooms": [9223372036854775808]}', 422),
        (
            "/v1/rooms/cancel",
            b'{"rooms": [9223372036854775808.0]}',
            422,
        ),  # as a float it rounds onto the bound
        ("/v1/rooms/cancel", b'{"rooms": [1.5]}', 422),
        ("/v1/rooms/watch", b'{"rooms": [{"room": 1}], "wait_s": "1"}', 422),
        (
            "/v1/rooms/commit",
            b'{"commits": [{"room": 1, "generation": 1, "transport": "loopback", "rows": 1, '
            b'"width": 1, "dtype": "float64"}]}',
            422,
        ),
        (
            "/v1/rooms/register",
            b'{"receivers": [{"room": 1, "generation": 1, "rows": 1, "width": 1, '
            b'"dtype": "bfloat16", "offers": [{"kind": "shm", "namespace": "n", '
            b'"segment": "../etc", "offset": 0, "capacity": 2}]}]}',
            422,
        ),
        # 64 TiB of rows against a 1 MiB offer
        (
            "/v1/rooms/register",
            b'{"receivers": [{"room": 1, "generation": 1, "rows": 16777216, "width": 1048576, '
            b'"dtype": "float32", "offers": [{"kind": "loopback", "region": 1, "offset": 0, '
            b'"capacity": 1048576}]}]}',
            422,
        ),
        ("/v1/rooms", b'{"count": 256, "ttl_s": 3600}', 400),  # over the table's room lifetime
        ("/v1/rooms/cancel", b'{"rooms": [1]}' + b" " * (70 << 10), 413),
    ],
)
def test_bad_input_gets_4xx_with_a_reason(served, path, body, status):
    server, client, table = served
    before = table.counts()
    code, answer = _post(server.url + path, body)
    assert code == status and answer.get("detail")
    assert table.counts() == before


def test_a_room_id_of_thousands_of_digits_is_not_found_not_a_server_error():
    """Python's int() refuses more than 4,300 digits: such a path once gave a 500 and a
    traceback."""
    server = ThreadedServer(create_app(RoomTable())).start()
    try:
        for digits in (5000, 19):
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(f"{server.url}/v1/rooms/{'9' * digits}", timeout=5)
            assert answer.value.code == (404 if digits == 5000 else 422)  # 9...9 > 2**63
    finally:
        server.stop()


def test_the_router_answers_a_wrong_method_an_unknown_path_and_a_root_path_as_fastapi_does():
    table = RoomTable()
    app = create_app(table)
    server = ThreadedServer(app).start()
    try:
        request = urllib.request.Request(server.url + "/v1/rooms/cancel", method="GET")
        with pytest.raises(urllib.error.HTTPError) as wrong_method:
            urllib.request.urlopen(request, timeout=5)
        assert wrong_method.value.code == 405
        assert wrong_method.value.headers["allow"] == "POST"
        assert json.loads(wrong_method.value.read()) == {"detail": "Method Not Allowed"}
        assert _post(server.url + "/v1/rooms/cancelled", b'{"rooms": [1]}') == (
            404,
            {"detail": "Not Found"},
        )
    finally:
        server.stop()
    # behind a proxy that strips a prefix (root_path), the room API is still routed
    app.root_path = "/epd"
    server = ThreadedServer(app).start()
    try:
        status, answer = _post(server.url + "/epd/v1/rooms", b'{"count": 1}')
        assert status == 200 and len(answer["rooms"]) == 1
    finally:
        server.stop()


def test_a_full_room_table_is_not_ready_and_says_why():
    """A mint flood (256 rooms a call, no token) filled the table and locked dispatch out while
    /readyz answered 200: now /readyz is 503 with the reason until rooms expire or end."""
    server, table = _serve(max_live_rooms=4, max_ttl_s=1)
    client = SyncHandshakeClient(server.url)
    try:
        assert get_json(server.url + "/readyz", timeout=5) == (
            200,
            {"ready": True, "live_rooms": 0},
        )
        rooms = client.mint(4, ttl_s=1)
        status, body = get_json(server.url + "/readyz", timeout=5)
        assert status == 503 and body == {
            "ready": False,
            "reason": "room table full: 4 live rooms, no room can be minted",
        }
        for liveness in ("/health", "/healthz"):  # alive meanwhile, under either name
            assert get_json(server.url + liveness, timeout=5) == (200, {"ok": True})
        client.cancel(rooms[:1])
        assert get_json(server.url + "/readyz", timeout=5)[0] == 200
    finally:
        client.close()
        server.stop()


def test_a_listener_open_to_anyone_is_warned_about(caplog):
    """A room API bound beyond loopback without a token (the default of epd-handshake and of an
    encode worker's bootstrap port) was silent about it."""
    from handshake.server import open_listener_warning

    open_app, locked_app = create_app(), create_app(token="s3cret")
    assert "INSECURE: EPD handshake listens on 0.0.0.0" in open_listener_warning(
        open_app, "0.0.0.0"
    )
    assert "INSECURE" in open_listener_warning(open_app, "10.0.0.5")
    assert "INSECURE" in open_listener_warning(open_app, "epd-encode-0.epd")
    for host in ("127.0.0.1", "::1", "localhost"):
        assert open_listener_warning(open_app, host) is None
    assert open_listener_warning(locked_app, "0.0.0.0") is None
    with caplog.at_level("WARNING", logger="handshake.server"):
        ThreadedServer(open_app, host="0.0.0.0").stop()  # never started: nothing bound
        ThreadedServer(locked_app, host="0.0.0.0").stop()
        ThreadedServer(create_app(), host="127.0.0.1").stop()
    assert [record.getMessage()[:40] for record in caplog.records] == [
        "INSECURE: EPD handshake listens on 0.0.0"
    ]


def test_metrics_and_probes(served):
    server, client, _ = served
    (room,) = client.mint()
    client.cancel([room])
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'epd_handshake_rooms{state="CANCELLED"}' in text
    assert 'epd_handshake_transitions_total{to="CANCELLED"}' in text
    assert "epd_handshake_longpoll_waiters" in text
    assert 'epd_handshake_request_seconds_count{method="POST",route="/v1/rooms/cancel"}' in text
    with urllib.request.urlopen(server.url + "/readyz", timeout=5) as response:
        assert json.loads(response.read())["ready"] is True


def test_concurrent_lifecycles_all_succeed(served):
    server, _, table = served
    errors = []

    def worker():
        client = SyncHandshakeClient(server.url)
        try:
            for _ in range(20):
                rooms = client.mint(8)
                client.register([registration(r) for r in rooms])
                client.begin_write([begin(r) for r in rooms])
                results = client.commit([commit(r) for r in rooms])
                if not all(r.view.state is RoomState.SUCCESS for r in results):
                    errors.append(results)
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a client thread did not finish within 60 s"
    assert not errors


def test_idle_connections_outlive_the_clients_keep_alive():
    """The server keeps an idle keep-alive connection longer than HandshakeClient pools it. With
    uvicorn's default (5 s) the server closed idle connections while clients still reused them: a
    request sent just then failed with "Server disconnected", and a mint (never retried) made a
    dispatcher take a healthy worker out of its ring (found by the soak)."""
    from epdserve.wire.room_client import KEEPALIVE_S
    from handshake.server import UVICORN_OPTIONS

    assert UVICORN_OPTIONS["timeout_keep_alive"] > KEEPALIVE_S
    server = ThreadedServer(create_app()).start()
    client = SyncHandshakeClient(server.url, retries=0)
    try:
        client.mint(1)
        time.sleep(5.5)  # past uvicorn's default keep-alive
        assert (
            len(server.server.server_state.connections) == 1
        )  # still open: the pooled one is reused
        assert client.mint(1)
    finally:
        client.close()
        server.stop()


class _CannedPeer:
    """A TCP peer on loopback that answers every request with ``answer`` and closes the
    connection (an endpoint dying mid-answer, or something that is not a room API)."""

    def __init__(self, answer: bytes):
        import socket

        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        import socket

        while not self.stopping.is_set():
            try:
                connection, _ = self.listener.accept()
            except socket.timeout:
                continue
            with connection:
                connection.settimeout(5)
                request = b""
                while b"\r\n\r\n" not in request:
                    request += connection.recv(65536)
                connection.sendall(self.answer)

    def stop(self):
        self.stopping.set()
        self.thread.join(5)
        assert not self.thread.is_alive()
        self.listener.close()


@pytest.mark.parametrize(
    "answer, why",
    [
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            b'1923\r\n\r\n{"res',
            "ClientPayloadError",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: "
            b"13\r\n\r\n<html></html>",
            "malformed answer",
        ),
    ],
)
def test_a_peer_that_dies_mid_answer_or_answers_nonsense_is_a_handshake_error(answer, why):
    """A worker killed while it sent an answer raised aiohttp's ClientPayloadError, and a 200 that
    is no room API answer pydantic's ValidationError: neither is what callers handle, so the
    receiver's job crashed (epd-prefill answered 500; the fault lab's kill scenario caught it)."""
    peer = _CannedPeer(answer)
    client = SyncHandshakeClient(peer.url, retries=1, backoff_s=0.01)
    try:
        for call in (lambda: client.watch({1: 0}), lambda: client.get(1), lambda: client.mint(1)):
            with pytest.raises(HandshakeError, match=why) as info:
                call()
            assert info.value.status == 0
    finally:
        client.close()
        peer.stop()
