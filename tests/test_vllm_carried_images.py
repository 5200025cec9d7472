"""vLLM on the encode workers' rows for a family whose EPD request carries the image itself
(Gemma 3, InternVL: vLLM takes no request of their grids alone): the request sends the image and the
connector's rooms; vLLM preprocesses the image and places its rows, the connector loads the
worker's rows into its encoder cache, and vLLM's own tower is not run for it. A module of its own,
so its engine is made after the other modules' are closed and on whichever test worker is free."""

import io
import signal

import pytest
from PIL import Image

from epdserve.dispatcher.vllm_request import vllm_request
from epdserve.testing.images import synthetic_image
from epdserve.vision.families import FAMILIES
from epdserve.vision.vlm_checkpoints import cached_vlm
from tests.test_vllm_connector import CARRIED, Stack, closed_cleanly, dispatch, scraped
from tests.waiting import eventually

pytestmark = pytest.mark.vllm

# The test images (width, height) of three sizes and aspect ratios, and each family's rows for
# them: Gemma 3's are 16 whatever the size; InternVL's 16 per tile (1 tile; 4 and a thumbnail;
# 2 and a thumbnail).
SIZES = [(112, 112), (500, 120), (112, 224)]
ROWS = {"gemma3": [16, 16, 16], "internvl": [16, 80, 48]}


@pytest.fixture(scope="module", params=CARRIED)
def carried_stack(request, tmp_path_factory):
    running = Stack(request.param, str(tmp_path_factory.mktemp(f"logs-{request.param}")))
    with closed_cleanly(running):
        yield running


@pytest.fixture
def tower_calls(carried_stack, monkeypatch):
    """How many times vLLM's own tower ran (its model's ``embed_multimodal`` was called)."""
    model_class = _model_class(carried_stack.family)
    calls = []
    original = model_class.embed_multimodal

    def counted(self, **kwargs):
        calls.append(1)
        return original(self, **kwargs)

    monkeypatch.setattr(model_class, "embed_multimodal", counted)
    return calls


def _model_class(family: str):
    """vLLM's model class of ``family`` (its architecture is transformers' class name)."""
    from vllm.model_executor.models.registry import ModelRegistry

    return ModelRegistry._try_load_model_cls(FAMILIES[family].vlm.__name__)


def prompt(stack: Stack, count: int) -> str:
    image = FAMILIES[stack.family].small_tokens.image_prompt
    return "Describe " + " and ".join([image] * count) + "."


def pil(image: bytes) -> Image.Image:
    return Image.open(io.BytesIO(image)).convert("RGB")


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_carried_images_take_the_workers_rows_and_equal_colocated(
    carried_stack, tower_calls, transport
):
    """Images of three sizes and aspect ratios (InternVL: tile counts), one repeated (A, B, A,
    C), each carried with its
    room over ``transport``: three rooms delivered, vLLM's tower never run, and greedy tokens equal
    vLLM's colocated run of the same images (where its tower runs)."""
    stack = carried_stack
    seeds = [12 + len(transport), 13, 14 + len(transport)]
    a, b, c = (synthetic_image(*size, seed=seed) for size, seed in zip(SIZES, seeds))
    items = stack.dispatch([a, b, c], stack.workers[transport])
    assert [item.rows for item in items] == ROWS[stack.family]
    before = stack.items("done", transport)
    request, params = vllm_request(
        prompt(stack, 4),
        items,
        order=[0, 1, 0, 2],
        images=[pil(a), pil(b), pil(c)],
        model_type=stack.family,
    )
    output = stack.run(request, params)
    assert tower_calls == []  # every row came from the encode worker
    assert stack.items("done", transport) == before + 3
    deliveries = output.ec_transfer_params["items"].values()
    assert [(d["state"], d["transport"]) for d in deliveries] == [("DONE", transport)] * 3
    assert output.outputs[0].finish_reason == "length"
    colocated = stack.colocated(prompt(stack, 4), [a, b, a, c])
    assert tower_calls != []  # the colocated run's rows are vLLM's tower's
    assert list(output.outputs[0].token_ids) == colocated
    eventually(stack.pool_idle, "every slot back in the pool", seconds=10)


def test_the_rows_not_the_carried_pixels_make_the_answer(carried_stack, tower_calls):
    """Another image's rows under the carried image's identifier: the answer is that image's
    (its colocated tokens), not the carried one's: vLLM used the worker's rows."""
    stack = carried_stack
    image, other = synthetic_image(112, 84, seed=21), synthetic_image(112, 84, seed=22)
    (item,) = stack.dispatch([other], stack.workers["shm"])
    request, params = vllm_request(
        prompt(stack, 1), [item], images=[pil(image)], model_type=stack.family
    )
    tokens = list(stack.run(request, params).outputs[0].token_ids)
    assert tower_calls == []
    assert tokens == stack.colocated(prompt(stack, 1), [other])
    assert tokens != stack.colocated(prompt(stack, 1), [image])


def test_a_request_of_grids_alone_is_refused_for_this_family(carried_stack):
    stack = carried_stack
    (item,) = stack.dispatch([synthetic_image(84, 84, seed=31)], stack.workers["shm"])
    with pytest.raises(ValueError, match="takes no request of grids alone"):
        vllm_request(prompt(stack, 1), [item], model_type=stack.family)


def test_a_worker_killed_mid_request_falls_back_to_vllms_tower(carried_stack, tower_calls):
    """The worker is stopped before it can deliver and killed once the engine started receiving:
    vLLM's own tower encodes the carried image, tokens equal colocated, and the next request is
    served from the remaining worker."""
    stack = carried_stack
    doomed = stack.cluster.start_encode_worker("worker-doomed", transports="shm")
    stack.cluster.wait_ready()
    image = synthetic_image(112, 84, seed=71)
    colocated = stack.colocated(prompt(stack, 1), [image])
    items = stack.dispatch([image], doomed)
    doomed.process.send_signal(signal.SIGSTOP)
    request, params = vllm_request(
        prompt(stack, 1), items, images=[pil(image)], model_type=stack.family
    )
    failed = stack.items("failed", "none")
    calls = len(tower_calls)
    output = stack.run(request, params, on_first_step=lambda: stack.cluster.kill(doomed))
    assert stack.items("failed", "none") == failed + 1
    assert len(tower_calls) > calls  # vLLM's tower encoded it
    assert list(output.outputs[0].token_ids) == colocated
    eventually(stack.pool_idle, "every slot back in the pool", seconds=30)


def test_a_worker_of_another_family_is_refused(carried_stack, tower_calls):
    """A Qwen2-VL worker's rows for a 112x112 image are as many and as wide as Gemma 3's and
    InternVL's (16 of 128): the room fails on the fingerprint with the row layout in the reason,
    nothing is written, and vLLM's own tower encodes the carried image (same tokens as
    colocated)."""
    stack = carried_stack
    wrong = stack.cluster.start_encode_worker(
        "worker-qwen2_vl", transports="shm", model=cached_vlm("qwen2_vl")
    )
    stack.cluster.wait_ready()
    image = synthetic_image(112, 112, seed=91)
    items = dispatch(cached_vlm("qwen2_vl"), wrong, [image], f"qwen2_vl-{next(stack.ids)}")
    assert items[0].rows == 16
    request, params = vllm_request(
        prompt(stack, 1), items, images=[pil(image)], model_type=stack.family
    )
    output = stack.run(request, params)
    (delivery,) = output.ec_transfer_params["items"].values()
    reason = delivery["reason"]
    assert delivery["state"] == "FAILED" and "the row layout" in reason, reason
    assert tower_calls != []
    assert list(output.outputs[0].token_ids) == stack.colocated(prompt(stack, 1), [image])
    assert scraped(wrong.url, "epd_encoder_bytes_total", {}) == 0  # no row written
    stack.cluster.kill(wrong, signal.SIGTERM)
    stack.cluster.roles.remove(wrong)
    eventually(stack.pool_idle, "every slot back in the pool", seconds=30)
