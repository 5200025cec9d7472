"""The towers' one-attention-call-per-layer path (``--vision-attention varlen``) against
transformers' reference loop, for all three families, on the CPU: the same structure the GPU runs
(one call per layer over the packed batch), held to the reference within the stated tolerance."""

import pytest
import torch
import torch.nn.functional as F

from epdserve.vision import attention
from epdserve.vision.families import PATCH_GRID_FAMILIES
from epdserve.vision.images import image_from_bytes
from epdserve.vision.tower import VisionTower
from epdserve.wire.rooms import RoomState
from tests.encode_helpers import png
from tests.test_encode_worker import (
    FULL_CLASSES,
    _parse,
    encode_in_this_thread,
    make_worker,
    reference_rows,
    request,
)

# Images of several sizes: Qwen2.5-VL windows of several lengths, sequences of several lengths.
SIZES = [(448, 448), (300, 500), (64, 64), (224, 168)]
COSINE_FLOOR = 0.9999  # the fast path's rows against the reference's, per row (docs)


def _batch(tower):
    images = [image_from_bytes(png(h, w, seed)) for seed, (h, w) in enumerate(SIZES)]
    inputs = tower.processor(images=images, return_tensors="pt")
    return inputs["pixel_values"], inputs["image_grid_thw"]


def _counting_sdpa(monkeypatch) -> list[int]:
    """Calls of torch's SDPA (transformers' reference and our padded path both end there)."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("family", PATCH_GRID_FAMILIES)
def test_varlen_calls_attention_once_per_layer_and_matches_the_reference(
    checkpoints, family, monkeypatch, record_property
):
    reference = VisionTower.load(checkpoints[family], vision_attention="reference")
    varlen = VisionTower.load(checkpoints[family], vision_attention="varlen")
    assert (reference.attention_path, varlen.attention_path) == ("reference", "varlen")
    assert "one call per layer" in varlen.attention_kernel
    pixel_values, grid_thw = _batch(reference)
    layers = len(reference.model.blocks)

    calls = _counting_sdpa(monkeypatch)
    expected = reference.encode(pixel_values, grid_thw)
    reference_calls = len(calls)
    calls.clear()
    got = varlen.encode(pixel_values, grid_thw)

    assert len(calls) == layers  # one call per layer for the whole batch of four images
    assert reference_calls >= len(SIZES) * layers  # the loop: at least one per image and layer
    assert got.shape == expected.shape
    cosine = F.cosine_similarity(got, expected, dim=1).min().item()
    max_abs = (got - expected).abs().max().item()
    record_property("min_cosine", cosine)
    record_property("max_abs_diff", max_abs)
    assert cosine >= COSINE_FLOOR, (cosine, max_abs)
    assert max_abs < 1e-4 * max(1.0, expected.abs().max().item()), max_abs


@pytest.mark.parametrize("family", PATCH_GRID_FAMILIES)
def test_a_worker_on_the_varlen_path_delivers_transformers_rows_within_tolerance(
    checkpoints, family
):
    """The whole worker (intake's jobs, prepare, one tower call, the send ring, a real loopback
    write, the commit) on the varlen path, against transformers' own get_image_features."""
    directory = checkpoints[family]
    full = FULL_CLASSES[family].from_pretrained(directory).eval()
    worker, receiver = make_worker(directory, vision_attention="varlen")
    try:
        assert worker.tower.attention_path == "varlen"
        images = [png(h, w, seed) for seed, (h, w) in enumerate(SIZES)]
        expected = [reference_rows(full, worker.tower, image) for image in images]
        rooms = worker.table.mint(len(images), 60)
        for room, rows in zip(rooms, expected):
            receiver.reserve(room, rows.shape[0], rows.shape[1], rows.dtype)
        jobs = [
            worker.intake.job(_parse(request(worker, room)), image)
            for room, image in zip(rooms, images)
        ]
        encode_in_this_thread(worker, jobs)
        for room, rows in zip(rooms, expected):
            state, got, view = receiver.wait(room)
            assert state is RoomState.SUCCESS, view.reason
            assert F.cosine_similarity(got, rows, dim=1).min().item() >= COSINE_FLOOR
    finally:
        worker.stop()
        receiver.close()


def test_auto_is_varlen_where_flash_runs_and_the_reference_elsewhere(monkeypatch):
    bf16 = torch.bfloat16
    assert attention.resolve("auto", "cpu", bf16) == "reference"
    assert attention.resolve("varlen", "cpu", torch.float32) == "varlen"
    assert not attention.flash_available(torch.device("cpu"), bf16)
    # a GPU with Flash (no GPU here: its capability as an Ampere card would report it)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    attention._capability.cache_clear()
    try:
        assert attention.resolve("auto", "cuda:0", bf16) == "varlen"
        assert attention.resolve("auto", "cuda", torch.float32) == "reference"  # Flash: 16 bits
        assert attention.resolve("reference", "cuda", bf16) == "reference"
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 0))
        attention._capability.cache_clear()
        assert attention.resolve("auto", "cuda", bf16) == "reference"  # a V100: no Flash
    finally:
        attention._capability.cache_clear()


def test_the_varlen_function_refuses_a_call_without_sequence_boundaries():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention.varlen_attention(None, q, q, q, None)


def test_padded_attention_keeps_each_sequence_to_itself():
    """Three sequences of 5, 1 and 3 tokens: each token's output is attention over its own
    sequence alone (what SDPA gives each sequence by itself)."""
    torch.manual_seed(0)
    lengths = [5, 1, 3]
    q, k, v = (torch.randn(1, 2, sum(lengths), 8) for _ in range(3))
    cu = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    out, _ = attention.varlen_attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        alone = F.scaled_dot_product_attention(
            q[:, :, part], k[:, :, part], v[:, :, part], scale=0.3
        )
        torch.testing.assert_close(out[0, part], alone[0].transpose(0, 1))
        start += length
