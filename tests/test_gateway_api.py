"""`epd-gateway`'s parts without vLLM: what a chat body may carry, how it is rewritten for vLLM,
where images may be fetched from, and the app's answers to any body (OpenAI's error shape, never
a 500), with vLLM unreachable."""

import asyncio
import base64
import contextlib
import io
import json
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from epdserve.dispatcher.workers import WorkerAddress
from epdserve.gateway.chat import (
    ChatRequest,
    ChatRequestError,
    EncodedMedia,
    InlineMedia,
    media_refs,
    rewrite,
)
from epdserve.gateway.media import MediaError, MediaFetcher
from epdserve.process_settings import SettingError
from epdserve.testing.cluster import HOST, free_port
from epdserve.testing.images import synthetic_image
from tests.busy_worker import BusyWorker
from tests.image_server import serving
from tests.profiles import examples


@pytest.fixture(scope="module")
def image_server():
    with serving({"/a.png": ("image/png", synthetic_image(112, 84, seed=71))}) as url:
        yield url


def test_only_the_gateway_sets_rooms_embeds_and_identifiers():
    def refs(content, **extra):
        return media_refs(
            ChatRequest.model_validate(
                {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
            )
        )

    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ChatRequestError, match="ec_transfer_params"):
        refs([part], ec_transfer_params={"rooms": {}})
    with pytest.raises(ChatRequestError, match="set by the gateway") as refused:
        refs([{**part, "uuid": "x"}])
    assert refused.value.param == "messages[0].content[0].uuid"
    with pytest.raises(ChatRequestError, match="image_embeds"):
        refs([{"type": "image_embeds", "image_embeds": {}}])
    with pytest.raises(ChatRequestError, match="video_embeds"):
        refs([{"type": "video_embeds", "video_embeds": {}}])
    with pytest.raises(ChatRequestError, match="video's uuid") as refused:
        refs(
            [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}, "uuid": "x"}]
        )
    with pytest.raises(ChatRequestError, match="'url'"):
        refs([{"type": "image_url", "image_url": {}}])
    assert refs("just text") == []


def test_rewrite_replaces_each_image_and_video_part_and_keeps_the_rest():
    body = {
        "model": "m",
        "temperature": 0,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Two:"},
                    {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "video_url", "video_url": {"url": "http://example.com/v.mp4"}},
                ],
            },
        ],
    }
    refs = media_refs(ChatRequest.model_validate(body))
    assert [(r.message, r.part, r.kind) for r in refs] == [
        (1, 1, "image"),
        (1, 2, "image"),
        (1, 3, "video"),
    ]
    out = rewrite(
        body,
        refs,
        [
            EncodedMedia("ab" * 16, (1, 4, 6)),
            InlineMedia("data:image/png;base64,AAAA"),
            EncodedMedia("cd" * 16, (2, 4, 6), "video", 1.25),
        ],
        {"ab" * 16: {"bootstrap_room": 7, "bootstrap_host": "10.0.0.5", "bootstrap_port": 8990}},
    )
    assert out["messages"][1]["content"][1] == {
        "type": "image_embeds",
        "uuid": "ab" * 16,
        "image_embeds": {"image_grid_thw": [1, 4, 6]},
    }
    assert out["messages"][1]["content"][2] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AAAA"},
    }
    assert out["messages"][1]["content"][3] == {
        "type": "video_embeds",
        "uuid": "cd" * 16,
        "video_embeds": {"video_grid_thw": [2, 4, 6], "second_per_grid_ts": [1.25]},
    }
    assert out["ec_transfer_params"]["rooms"]["ab" * 16]["bootstrap_room"] == 7
    assert out["messages"][0] == body["messages"][0] and out["temperature"] == 0
    assert (
        body["messages"][1]["content"][1]["type"] == "image_url"
    )  # the client's body is untouched


def test_placed_images_go_as_grids_or_carried_by_the_familys_flag():
    """A placed image reaches vLLM as its grid and identifier where vLLM takes a request of grids
    alone; else as the image itself (the client's data URI as sent, a fetched URL's bytes as a
    data URI) named by the same identifier; its room goes in ``ec_transfer_params`` either way,
    and an image no worker took goes inline, unnamed."""
    from epdserve.dispatcher.media import DispatchedItem
    from epdserve.gateway.prepared import PreparedChat
    from epdserve.wire.addresses import EncodeHandshake
    from epdserve.wire.ec_params import identifier

    png = synthetic_image(112, 84, seed=72)
    sent = "data:image/png;base64," + base64.b64encode(png).decode()
    fetched = "data:image/png;base64," + base64.b64encode(png[::-1]).decode()
    content = [
        {"type": "image_url", "image_url": {"url": sent}},
        {"type": "image_url", "image_url": {"url": "http://example.com/b.png"}},
        {"type": "image_url", "image_url": {"url": sent}},
        {"type": "text", "text": "Three:"},
    ]
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    room = EncodeHandshake(bootstrap_room=7, bootstrap_host="10.0.0.5", bootstrap_port=8990)

    def item(index: int, data: bytes, placed: bool) -> DispatchedItem:
        return DispatchedItem(
            index,
            data,
            content_hash=1000 + index,
            width=112,
            height=84,
            grid_thw=(1, 4, 4),
            rows=16,
            encode_handshake=room if placed else None,
            worker="127.0.0.1:9000" if placed else None,
            image_format="PNG",
        )

    def vllm_body(grid_only_requests: bool, second_placed: bool = True) -> dict:
        prepared = PreparedChat(
            "gw-1",
            body,
            False,
            media_refs(ChatRequest.model_validate(body)),
            items=[item(0, png, True), item(1, png[::-1], second_placed)],
            of_ref=[0, 1, 0],
            grid_only_requests=grid_only_requests,
        )
        return prepared.vllm_body()

    first, second = identifier(1000), identifier(1001)
    grids = vllm_body(grid_only_requests=True)
    assert grids["messages"][0]["content"][:3] == [
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": key}
        for key in (first, second, first)
    ]
    carried = vllm_body(grid_only_requests=False)
    assert carried["messages"][0]["content"][:3] == [
        {"type": "image_url", "image_url": {"url": url}, "uuid": key}
        for url, key in ((sent, first), (fetched, second), (sent, first))
    ]
    for out in (grids, carried):
        assert set(out["ec_transfer_params"]["rooms"]) == {first, second}
        assert out["messages"][0]["content"][3] == content[3]
    inline = vllm_body(grid_only_requests=False, second_placed=False)
    assert inline["messages"][0]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": fetched},
    }
    assert set(inline["ec_transfer_params"]["rooms"]) == {first}


def test_data_uris_are_held_to_their_kinds_type_and_limit():
    fetcher = MediaFetcher(max_bytes=64, max_video_bytes=16)
    video = "data:video/mp4;base64," + base64.b64encode(b"v" * 12).decode()
    assert fetcher.decode_data_uri(video, "video") == b"v" * 12
    big = "data:video/mp4;base64," + base64.b64encode(b"v" * 32).decode()
    with pytest.raises(MediaError, match="video larger than 16 bytes"):
        fetcher.decode_data_uri(big, "video")  # within the image limit: the video one applies
    with pytest.raises(MediaError, match=r"a video/\* type is required"):
        fetcher.decode_data_uri("data:image/png;base64,AAAA", "video")
    with pytest.raises(MediaError, match=r"an image/\* type is required"):
        fetcher.decode_data_uri(video, "image")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/a.png",
        "http://10.1.2.3/a.png",
        "http://[::1]/a.png",
        "http://169.254.169.254/latest/meta-data",
        "http://localhost:8000/a.png",
        "http://[::ffff:127.0.0.1]/a.png",
        "http://0.0.0.0/a.png",
    ],
)
def test_private_addresses_are_not_fetched(url):
    async def load():
        fetcher = MediaFetcher()
        try:
            return await fetcher.load(url)
        finally:
            await fetcher.close()

    with pytest.raises(MediaError, match="private or reserved"):
        asyncio.run(load())


def test_a_name_resolving_to_a_private_address_is_not_fetched():
    """The resolver itself refuses (what a name resolves to at connect time is what counts)."""
    from epdserve.gateway.media import PublicOnlyResolver

    async def resolve():
        resolver = PublicOnlyResolver()
        try:
            return await resolver.resolve("localhost", 80)
        finally:
            await resolver.close()

    with pytest.raises(OSError, match="private or reserved"):
        asyncio.run(resolve())


def test_redirects_are_bounded(image_server):
    """Redirects followed up to the limit, every hop checked."""

    async def load(url, redirects):
        fetcher = MediaFetcher(max_redirects=redirects, allow_private=True)
        try:
            return await fetcher.load(url)
        finally:
            await fetcher.close()

    assert Image.open(io.BytesIO(asyncio.run(load(image_server + "/redirect/3", 3)))).size == (
        112,
        84,
    )
    with pytest.raises(MediaError, match="more than 2 redirects"):
        asyncio.run(load(image_server + "/redirect/3", 2))


# vLLM's per-prompt limits, as the engine below says them
LIMITS = {"image": 4, "video": 1}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The engine description the EPD connector would serve (``/v1/engine``) for vLLM running the
    small Qwen2-VL checkpoint ``gateway_in_process`` builds (its seed makes every build the same
    model), with ``LIMITS``: the description, served (``url``)."""
    from epdserve.vision.fingerprint import tower_fingerprint
    from epdserve.vision.small_checkpoints import build_full
    from epdserve.vision.tower import VisionTower
    from epdserve.wire.fingerprint import EngineDescription

    model = build_full("qwen2_vl", str(tmp_path_factory.mktemp("engine-model")))
    description = EngineDescription(
        served_model_name="m",
        fingerprint=tower_fingerprint(VisionTower.load(model)),
        limit_mm_per_prompt=LIMITS,
    )
    document = description.model_dump_json().encode()
    with serving({"/v1/engine": ("application/json", document)}) as url:
        yield SimpleNamespace(url=url, description=description)


@pytest.fixture(scope="module")
def engine_url(engine):
    return engine.url


def gateway_in_process(model: str, engine_url: str, vllm_url: str | None = None, **settings):
    """A ``Gateway`` (model name "m") over a small Qwen2-VL checkpoint built at ``model``, in
    front of the engine ``engine_url`` describes, with vLLM at ``vllm_url`` (default: a port where
    nothing listens) and no encode worker unless ``workers`` names some."""
    from epdserve.gateway.app import Gateway, GatewaySettings
    from epdserve.vision.small_checkpoints import build_full

    build_full("qwen2_vl", model)
    settings.setdefault("workers", (WorkerAddress(HOST, free_port(), free_port()),))
    config = GatewaySettings(
        model=model,
        host=HOST,
        vllm_url=vllm_url or f"http://{HOST}:{free_port()}",
        engine_url=engine_url,
        served_model_name="m",
        worker_wait_s=0,
        **settings,
    )
    return Gateway(config)


@contextlib.contextmanager
def serving_in_process(gateway):
    """A ``TestClient`` of ``gateway``'s app, once the gateway is ready (it has read its engine
    and probed its workers)."""
    from fastapi.testclient import TestClient

    from epdserve.gateway.app import build_app
    from tests.waiting import eventually

    with TestClient(build_app(gateway)) as client:
        eventually(lambda: gateway.not_ready() is None, "the gateway ready")
        yield client


@pytest.fixture(scope="module")
def app_without_vllm(tmp_path_factory, engine_url):
    """The gateway app in-process: vLLM at a port where nothing listens, no encode worker."""
    gateway = gateway_in_process(
        str(tmp_path_factory.mktemp("model")), engine_url, max_body_bytes=1 << 20
    )
    with serving_in_process(gateway) as client:
        yield client


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.one_of(
                st.fixed_dictionaries(
                    {
                        "url": st.sampled_from(
                            [
                                "data:image/png;base64,AAAA",
                                "data:,x",
                                "data:image/png;base64,@@",
                                "ftp://x/y.png",
                                "http://127.0.0.1/a.png",
                                "",
                            ]
                        )
                    }
                ),
                JSON,
            ),
        }
    ),
    JSON,
)
BODY = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {
            "model": st.one_of(st.just("m"), JSON),
            "messages": st.one_of(
                st.lists(
                    st.fixed_dictionaries(
                        {
                            "role": st.just("user"),
                            "content": st.one_of(
                                st.text(max_size=10), st.lists(PART, max_size=3), JSON
                            ),
                        }
                    ),
                    max_size=3,
                ),
                JSON,
            ),
        },
        optional={"stream": st.one_of(st.booleans(), JSON), "ec_transfer_params": JSON},
    ),
)


@settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=BODY)
def test_any_body_gets_an_openai_answer(app_without_vllm, body):
    """Whatever the body: a refusal (400, OpenAI's error shape naming the problem) before vLLM, or,
    for a valid request, 502 because vLLM cannot be reached; never a 500."""
    response = app_without_vllm.post("/v1/chat/completions", content=json.dumps(body))
    assert response.status_code in (400, 502), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["code"] == response.status_code


def test_bodies_that_are_not_json_or_too_large(app_without_vllm):
    assert app_without_vllm.post("/v1/chat/completions", content=b"{").status_code == 400
    assert app_without_vllm.post("/v1/chat/completions", content=b"[]").json()["error"][
        "message"
    ] == ("request body must be a JSON object")
    for depth in (100_000, 2_000):  # deeper than Python's recursion limit, and within it
        body = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
        answer = app_without_vllm.post("/v1/chat/completions", content=body)
        assert answer.status_code == 400, answer.text  # was a 500 (RecursionError)
        assert "nested" in answer.json()["error"]["message"]
    too_large = app_without_vllm.post("/v1/chat/completions", content=b" " * ((1 << 20) + 1))
    assert (
        too_large.status_code == 413
        and "larger than 1048576 bytes" in too_large.json()["error"]["message"]
    )


def test_requests_beyond_max_in_flight_are_refused_at_once(tmp_path, engine_url):
    """With vLLM not answering (a socket that accepts and never replies), the one request the
    gateway may hold waits; the next gets 503 with Retry-After at once; the held one ends with
    502 when its time is up."""
    import socket
    import threading

    from tests.waiting import eventually

    silent = socket.socket()
    silent.bind((HOST, 0))
    silent.listen(8)
    gateway = gateway_in_process(
        str(tmp_path),
        engine_url,
        f"http://{HOST}:{silent.getsockname()[1]}",
        max_in_flight=1,
        request_timeout_s=3,
    )
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
    try:
        with serving_in_process(gateway) as client:
            held = {}
            waiting = threading.Thread(
                target=lambda: held.setdefault(
                    "response", client.post("/v1/chat/completions", content=body)
                )
            )
            waiting.start()
            eventually(
                lambda: (
                    'epd_gateway_requests_in_flight{model_name="m"} 1.0'
                    in client.get("/metrics").text
                ),
                "the first request held",
                seconds=10,
            )
            refused = client.post("/v1/chat/completions", content=body)
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert "--max-in-flight" in refused.json()["error"]["message"]
            waiting.join(30)
            assert not waiting.is_alive(), "the held request did not end"
            assert held["response"].status_code == 502
            assert (
                client.post("/v1/chat/completions", content=body).status_code == 502
            )  # room again
    finally:
        silent.close()


@pytest.mark.processes
def test_slow_uploads_and_hang_ups_hold_nothing(tmp_path):
    """A real epd-gateway process (vLLM unreachable), --max-in-flight 4: 16 connections that send
    half a body and stall do not take its places (a full request is still served, here with vLLM's
    502, not refused with 503) and are answered 408 once --body-timeout-s passes; 16 clients that
    hang up mid-body are counted as such, not as internal errors, and log no traceback."""
    import socket

    from epdserve.testing.cluster import LocalCluster
    from epdserve.vision.small_checkpoints import build_full
    from tests.test_gateway import metric
    from tests.waiting import eventually

    build_full("qwen2_vl", str(tmp_path / "model"))
    cluster = LocalCluster(str(tmp_path / "model"), log_dir=str(tmp_path))
    unreachable = SimpleNamespace(  # no vLLM, no engine listens there
        url=f"http://{HOST}:{free_port()}", engine_url=f"http://{HOST}:{free_port()}"
    )
    gateway = cluster.start_gateway(
        unreachable,
        [WorkerAddress(HOST, free_port(), free_port())],
        extra=("--max-in-flight", "4", "--body-timeout-s", "2"),
    )
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    port = int(gateway.url.rsplit(":", 1)[1])

    def half_sent() -> socket.socket:
        sock = socket.create_connection((HOST, port), timeout=10)
        sock.sendall(head + body[: len(body) // 2])
        return sock

    try:
        cluster.wait_ready()
        stalled = [half_sent() for _ in range(16)]
        served = urllib.request.Request(
            gateway.url + "/v1/chat/completions", data=body, method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(served, timeout=10)
        assert answer.value.code == 502  # vLLM unreachable: served, not refused (503)
        for sock in stalled:
            status = sock.recv(64)  # the gateway answers once the body timeout passes
            assert status.startswith(b"HTTP/1.1 408"), status
            sock.close()
        for _ in range(16):
            half_sent().close()
        eventually(
            lambda: (
                metric(gateway.url, "epd_gateway_requests_total", outcome="client_disconnected")
                == 16
            ),
            "every hang-up counted",
        )
        assert metric(gateway.url, "epd_gateway_requests_total", outcome="internal_error") == 0
        assert metric(gateway.url, "epd_gateway_requests_total", outcome="overloaded") == 0
    finally:
        cluster.stop()
    with open(gateway.log_path) as log:
        assert "Traceback" not in log.read()


def test_an_image_too_large_to_decode_is_refused_not_sent_inline(app_without_vllm):
    """A 12000x12000 PNG of a few KB: refused (400) from its header, before any worker or vLLM
    (which would decode 144 M pixels) sees it; vLLM being unreachable, a 502 would mean it was
    forwarded."""
    buffer = io.BytesIO()
    Image.new("1", (12000, 12000)).save(buffer, format="PNG")
    assert len(buffer.getvalue()) < 100_000
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "?"}]
    answer = app_without_vllm.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": content}]},
    )
    assert answer.status_code == 400, answer.text
    assert "12000x12000 pixels is larger than accepted" in answer.json()["error"]["message"]


def test_unknown_paths_and_wrong_methods_answer_in_openais_shape(app_without_vllm):
    for answer, status in (
        (app_without_vllm.get("/v1/nothing-here"), 404),
        (app_without_vllm.get("/v1/chat/completions"), 405),
    ):
        assert answer.status_code == status
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert app_without_vllm.get("/v1/chat/completions").headers["allow"] == "POST"


def test_more_images_than_vllm_takes_are_refused_before_any_encode(app_without_vllm):
    """vLLM's --limit-mm-per-prompt, read from its engine (the gateway is given none): 5 images
    where 4 are taken is a 400 at once, before any worker encodes them (vLLM would refuse the
    request after the workers had)."""
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    answer = app_without_vllm.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": [part] * 5}]},
    )
    assert answer.status_code == 400
    assert "At most 4 image(s) may be provided in one prompt, got 5" in answer.text


def test_bodies_being_received_are_bounded_in_bytes(tmp_path, engine_url):
    """--max-receiving-bytes: a body that would take the bytes being received past it is refused
    (503, Retry-After), and the bytes come back once a body is in."""

    gateway = gateway_in_process(str(tmp_path), engine_url, max_receiving_bytes=1000)
    small = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
    with serving_in_process(gateway) as client:
        refused = client.post("/v1/chat/completions", content=small + " " * 2000)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert "--max-receiving-bytes" in refused.json()["error"]["message"]
        assert client.post("/v1/chat/completions", content=small).status_code == 502
        assert gateway.reading.held == 0


@pytest.mark.parametrize("max_inline_patches", [0, 10**6])
def test_images_the_busy_encode_workers_cannot_take_in_time_overflow_within_the_inline_cap(
    tmp_path, engine, max_inline_patches
):
    """Every worker refuses the image as busy past its deadline. Under --max-inline-patches it
    goes to vLLM inline (vLLM being unreachable, the answer is the 502 that says it was sent) and
    its patches are released once the call ended; past it (0: never) the request is refused (503,
    Retry-After from the worker's), not sent to vLLM. Either way counted, no room left behind."""

    busy = BusyWorker(
        "busy: about 40.0 s of work queued ahead",
        retry_after_s=19.2,
        fingerprint=engine.description.fingerprint,
    )
    try:
        gateway = gateway_in_process(
            str(tmp_path),
            engine.url,
            workers=(busy.address,),
            max_inline_patches=max_inline_patches,
        )
        with serving_in_process(gateway) as client:
            image = base64.b64encode(synthetic_image(64, 64, 1)).decode()
            content = [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
                {"type": "text", "text": "?"},
            ]
            answer = client.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": content}]},
            )
            metrics = client.get("/metrics").text
        if max_inline_patches:
            assert answer.status_code == 502, answer.text  # vLLM's: it was sent inline
            assert 'route="vllm"' in _series(metrics, "epd_gateway_placements_total", "1.0")
            assert gateway.inline.patches == 0 and gateway.inline.peak == 16  # 64x64: 4x4
        else:
            assert answer.status_code == 503, answer.text
            assert answer.headers["retry-after"] == "20"
            message = answer.json()["error"]["message"]
            assert "the encode workers are busy" in message and "--max-inline-patches 0" in message
            refused = _series(metrics, "epd_gateway_placements_total", "1.0")
            assert 'route="refused"' in refused and 'reason="inline_full"' in refused
            assert gateway.inline.peak == 0
        assert busy.items == 1 and busy.table.live_rooms == 0
    finally:
        busy.stop()


@pytest.mark.parametrize("max_inline_patches", [0, 10**6])
def test_placement_by_cost_sends_images_inline_only_within_the_inline_cap(
    tmp_path, engine, max_inline_patches
):
    """--placement cost with vLLM's tower measured sooner: under the cap the image goes to vLLM
    inline without a word to the workers (vLLM being unreachable, the 502 says it was sent),
    counted as sooner, its patches released after; past it (0) it goes to the workers after all
    (here busy, and overflow past the cap too: 503), counted as inline_full."""
    from epdserve.gateway.placement import Route

    busy = BusyWorker(
        "busy: about 40.0 s of work queued ahead",
        retry_after_s=19.2,  # past the intake timeout: not tried again
        fingerprint=engine.description.fingerprint,
    )
    try:
        gateway = gateway_in_process(
            str(tmp_path),
            engine.url,
            workers=(busy.address,),
            placement="cost",
            max_inline_patches=max_inline_patches,
        )
        gateway.costs.observe(Route.VLLM, 16, 0.1)
        gateway.costs.observe(Route.ENCODE_WORKER, 16, 2.0)
        with serving_in_process(gateway) as client:
            image = base64.b64encode(synthetic_image(64, 64, 4)).decode()
            content = [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}
            ]
            answer = client.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": content}]},
            )
            placed = _series(client.get("/metrics").text, "epd_gateway_placements_total", "1.0")
        if max_inline_patches:
            assert answer.status_code == 502, answer.text
            assert 'route="vllm"' in placed and 'reason="sooner"' in placed
            assert busy.items == 0 and gateway.inline.peak == 16
        else:
            assert answer.status_code == 503, answer.text
            assert 'route="refused"' in placed and 'reason="inline_full"' in placed
            assert busy.items == 1 and gateway.inline.peak == 0
        assert gateway.inline.patches == 0 and busy.table.live_rooms == 0
    finally:
        busy.stop()


def test_placement_min_items_sends_requests_of_fewer_images_to_vllm_whole(tmp_path, engine):
    """--placement min-items=2 (SGLang's rule): a one-image request goes to vLLM inline without a
    word to the workers (vLLM being unreachable, the 502 says it was sent), counted as few_items;
    a two-image request goes to the workers (here busy: it overflows)."""
    busy = BusyWorker(
        "busy: about 40.0 s of work queued ahead",
        retry_after_s=19.2,  # past the intake timeout: not tried again
        fingerprint=engine.description.fingerprint,
    )
    try:
        gateway = gateway_in_process(
            str(tmp_path), engine.url, workers=(busy.address,), placement="min-items=2"
        )
        with serving_in_process(gateway) as client:

            def ask(seeds):
                content = [
                    {
                        "type": "image_url",
                        "image_url": {
                            "url": "data:image/png;base64,"
                            + base64.b64encode(synthetic_image(64, 64, seed)).decode()
                        },
                    }
                    for seed in seeds
                ]
                return client.post(
                    "/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": content}]},
                )

            assert ask([1]).status_code == 502
            assert busy.items == 0
            few = _series(client.get("/metrics").text, "epd_gateway_placements_total", "1.0")
            assert 'route="vllm"' in few and 'reason="few_items"' in few
            assert ask([2, 3]).status_code == 502
            assert busy.items == 2
        assert gateway.inline.patches == 0
    finally:
        busy.stop()


@pytest.mark.parametrize("placement", ["min-items=0", "costs", "min-items=x", "min-items=1000"])
def test_placement_outside_its_forms_is_refused(tmp_path, engine_url, placement):
    with pytest.raises((SettingError, ValueError)):
        gateway_in_process(str(tmp_path), engine_url, placement=placement)


def _series(metrics: str, name: str, value: str) -> str:
    """The one series of ``name`` in the exposition ``metrics`` (which has that ``value``)."""
    (line,) = [line for line in metrics.splitlines() if line.startswith(name + "{")]
    assert line.endswith(" " + value), line
    return line


def test_an_image_in_a_format_workers_do_not_decode_goes_to_vllm_within_the_same_limits(
    app_without_vllm,
):
    """A TIFF (vLLM reads it, the workers do not) is sent to vLLM inline: vLLM being unreachable,
    the answer is vLLM's 502, not a 400; one that declares 12000x12000 pixels is refused from its
    header (400) like any image, never sent inline."""

    def ask(image: Image.Image, **options):
        buffer = io.BytesIO()
        image.save(buffer, format="TIFF", **options)
        uri = "data:image/tiff;base64," + base64.b64encode(buffer.getvalue()).decode()
        content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "?"}]
        return app_without_vllm.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": content}]},
        )

    small = ask(Image.open(io.BytesIO(synthetic_image(64, 48, 3))))
    assert small.status_code == 502, small.text
    huge = ask(Image.new("1", (12000, 12000)), compression="packbits")
    assert huge.status_code == 400, huge.text
    assert "12000x12000 pixels is larger than accepted" in huge.json()["error"]["message"]


def test_the_gateway_asks_for_its_api_key_and_serves_docs_only_when_asked(tmp_path, engine_url):
    """--api-key-file: a /v1 call without the key (or with another) is refused 401 in OpenAI's
    shape before anything is read; with it, it is served (here: vLLM unreachable, 502); probes
    and metrics stay open. /docs and /openapi.json are served only with --docs."""
    gateway = gateway_in_process(str(tmp_path / "a"), engine_url, api_key="the-key")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
    with serving_in_process(gateway) as client:
        for headers in ({}, {"Authorization": "Bearer another"}, {"Authorization": "the-key"}):
            refused = client.post("/v1/chat/completions", content=body, headers=headers)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert refused.json()["error"]["type"] == "authentication_error"
        assert client.get("/v1/models").status_code == 401
        served = client.post(
            "/v1/chat/completions", content=body, headers={"Authorization": "Bearer the-key"}
        )
        assert served.status_code == 502
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert client.get("/docs").status_code == 404
        assert client.get("/openapi.json").status_code == 404
    documented = gateway_in_process(str(tmp_path / "b"), engine_url, docs=True)
    with serving_in_process(documented) as client:
        assert client.get("/docs").status_code == 200
        assert client.get("/openapi.json").status_code == 200


@contextlib.contextmanager
def slow_stream(events: int, every_s: float):
    """A stand-in for vLLM's chat completions that streams ``events`` chunks, one every
    ``every_s`` seconds, then ``[DONE]``: its URL."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for index in range(events):
                chunk = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": f"t{index} "},
                            "finish_reason": "length" if index == events - 1 else None,
                        }
                    ],
                }
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(every_s)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def log_message(self, *args):
            return

    server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.processes
def test_a_stream_in_flight_when_the_gateway_is_told_to_stop_completes(tmp_path):
    """SIGTERM to a gateway while it relays a stream of 8 s (--drain-s 20; the drain was 5 s): the
    stream goes on to its last chunk and [DONE], no new connection is taken meanwhile, and the
    gateway then exits 0."""
    import signal
    import socket

    from epdserve.testing.cluster import LocalCluster
    from epdserve.vision.small_checkpoints import build_full
    from tests.waiting import eventually

    build_full("qwen2_vl", str(tmp_path / "model"))
    cluster = LocalCluster(str(tmp_path / "model"), log_dir=str(tmp_path))
    with slow_stream(events=20, every_s=0.4) as vllm_url:
        gateway = cluster.start_gateway(
            SimpleNamespace(url=vllm_url, engine_url=f"http://{HOST}:{free_port()}"),
            [WorkerAddress(HOST, free_port(), free_port())],
            extra=("--drain-s", "20"),
        )
        try:
            cluster.wait_ready()
            body = json.dumps(
                {"model": "m", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
            )
            request = urllib.request.Request(
                gateway.url + "/v1/chat/completions", data=body.encode(), method="POST"
            )
            lines = []
            with urllib.request.urlopen(request, timeout=30) as stream:
                lines.append(stream.readline())  # the first event is on its way: stop now
                gateway.process.send_signal(signal.SIGTERM)
                port = int(gateway.url.rsplit(":", 1)[1])

                def listener_closed() -> bool:
                    try:
                        socket.create_connection((HOST, port), timeout=5).close()
                    except OSError:
                        return True
                    return False

                eventually(listener_closed, "the gateway taking no new connection")
                lines += stream.read().splitlines(keepends=True)
            events = [line for line in lines if line.startswith(b"data: ")]
            assert len(events) == 21 and events[-1] == b"data: [DONE]\n", events
            assert b'"finish_reason": "length"' in events[-2]
            assert gateway.process.wait(30) == 0
        finally:
            cluster.stop()
