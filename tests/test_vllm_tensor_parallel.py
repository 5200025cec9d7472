"""vLLM at tensor-parallel size 2 on the encode workers' rows (the EPD connector, Qwen3-VL with its
DeepStack levels, one process per rank): a module of its own, so its engine is made after the
single-rank ones are closed (each holds gigabytes) and on whichever test worker is free."""

import pytest

from epdserve.dispatcher.vllm_request import vllm_request
from epdserve.testing.images import synthetic_image
from tests.test_vllm_connector import Stack, closed_cleanly, prompt_for, scraped
from tests.waiting import eventually

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tp_stack(tmp_path_factory):
    """Qwen3-VL (4 heads, 2 KV heads; rows of the main embedding and two DeepStack levels) on two
    tensor-parallel ranks, each a process of its own."""
    running = Stack("qwen3_vl", str(tmp_path_factory.mktemp("logs-tp")), tensor_parallel_size=2)
    with closed_cleanly(running):
        yield running


@pytest.mark.parametrize("transport", ["shm", "mooncake"])
def test_tensor_parallel_ranks_take_rows_written_once(tp_stack, transport):
    """Tensor-parallel size 2: two images' rows come over `transport`, each written once by its
    encode worker into the engine's one pool; both ranks load them, greedy tokens equal the same
    engine's colocated run (vLLM's own tower on both ranks), and every slot goes back once both
    ranks reported their loads."""
    assert tp_stack.engine.vllm_config.parallel_config.tensor_parallel_size == 2
    assert tp_stack.connector._scheduler.loading_ranks == 2
    images = [synthetic_image(112, 84, seed=80 + len(transport)), synthetic_image(84, 56, seed=81)]
    worker = tp_stack.workers[transport]

    def written() -> float:
        return scraped(worker.url, "epd_encoder_transfer_seconds_count", {"transport": transport})

    before, delivered = written(), tp_stack.items("done", transport)
    items = tp_stack.dispatch(images, worker)
    output = tp_stack.run(*vllm_request(prompt_for(2), items))
    assert list(output.outputs[0].token_ids) == tp_stack.colocated(prompt_for(2), images)
    assert tp_stack.items("done", transport) == delivered + 2
    eventually(lambda: written() == before + 2, "the worker's two writes counted", seconds=10)
    eventually(tp_stack.pool_idle, "every slot back in the pool", seconds=10)
    assert written() == before + 2  # once each, whatever the number of ranks
