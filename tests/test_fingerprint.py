"""Model fingerprints: one model gives one fingerprint whatever its checkpoint's layout, each kind
of difference is named, the engine side computes from what vLLM loaded the same fingerprint the
worker computes from its tower, and rows of another model are refused before they are computed,
written or published."""

import pytest
import torch

from epdserve.vision.families import FAMILIES
from epdserve.vision.fingerprint import tower_fingerprint
from epdserve.vision.sizing import FIXED_SIZE, TILED
from epdserve.vision.small_checkpoints import build_full, save_processors
from epdserve.vision.tower import VisionTower
from epdserve.wire.ec_params import MODEL_TYPES
from epdserve.wire.fingerprint import PARTS, compact_differences
from epdserve.wire.intake import IntakeClient, IntakeStatus
from epdserve.wire.rooms import RoomState
from tests.encode_helpers import loopback_stack, png
from tests.waiting import eventually


@pytest.fixture(scope="module")
def qwen25(checkpoints):
    directory = checkpoints["qwen2_5_vl"]
    tower = VisionTower.load(directory)
    return directory, tower, tower_fingerprint(tower)


def test_one_model_has_one_fingerprint_whatever_its_checkpoints_layout(qwen25, tmp_path):
    """The tower out of a sharded full checkpoint and the same tower saved alone (another layout,
    other file names, keys under ``visual.``) are the same model."""
    directory, tower, full = qwen25
    alone = tmp_path / "vision-only"
    tower.model.save_pretrained(alone)
    save_processors("qwen2_5_vl", str(alone))
    assert tower_fingerprint(VisionTower.load(str(alone))) == full
    assert full.compact.count(".") == len(PARTS) - 1


@pytest.mark.parametrize(
    "change, part, said",
    [
        ("weights", "weights", "the vision weights differ"),
        ("family", "architecture", "(qwen2_5_vl against qwen2_vl)"),
        ("max_pixels", "preprocessing", 'size {"longest_edge": 1003520'),
        ("dtype", "dtype", "the dtype differs: float32 (worker), bfloat16 (engine)"),
    ],
)
def test_each_difference_is_named(qwen25, tmp_path, change, part, said):
    """Same architecture with other weights (the same folder name: the same served name), another
    family, other processor settings, another dtype: each changes its part of the fingerprint, and
    the difference is said with what differs."""
    directory, tower, mine = qwen25
    if change == "weights":
        other = VisionTower.load(build_full("qwen2_5_vl", str(tmp_path / "qwen2_5_vl"), seed=1))
    elif change == "family":
        other = VisionTower.load(build_full("qwen2_vl", str(tmp_path / "qwen2_vl")))
    elif change == "max_pixels":
        other = VisionTower.load(directory, processor_kwargs={"max_pixels": 100352})
    else:
        other = VisionTower.load(directory, dtype="bfloat16")
    theirs = tower_fingerprint(other)
    assert part in compact_differences(mine.compact, theirs.compact)
    said_all = " ".join(mine.differences(theirs, "worker", "engine"))
    assert said in said_all, said_all
    assert mine.differences(mine, "worker", "engine") == []


@pytest.mark.vllm
@pytest.mark.parametrize("family", MODEL_TYPES)
def test_the_engine_fingerprint_is_the_model_vllm_loaded(family):
    """The connector's fingerprint, from vLLM's own config and the processors its multimodal
    registry builds (with its --mm-processor-kwargs), equals the worker's for the same checkpoint
    and settings, and tells a worker with other settings apart."""
    from vllm.config import ModelConfig, VllmConfig

    from epdserve.vision.vlm_checkpoints import cached_vlm
    from prefill_side.vllm_connector import model_row_width
    from prefill_side.vllm_connector.engine_model import engine_description

    directory = cached_vlm(family)
    # a setting of the family's image processor (Gemma 3's fixed-size one and InternVL's tiles
    # have no pixel budget)
    kwargs = {FIXED_SIZE: {"pan_and_scan_max_num_crops": 2}, TILED: {"max_patches": 4}}.get(
        FAMILIES[family].sizing, {"max_pixels": 100352}
    )
    model_config = ModelConfig(model=directory, dtype="float32", mm_processor_kwargs=kwargs)
    vllm_config = VllmConfig(model_config=model_config)
    width, levels, _ = model_row_width(vllm_config)
    # Qwen3-VL's rows: the main embedding and its two DeepStack levels, each the LLM's width
    deepstack = "deepstack_visual_indexes" in FAMILIES[family].small_vision_config(128, 2, 64)
    assert (width, levels) == ((128 * 3, 2) if deepstack else (128, 0))
    engine = engine_description(vllm_config, width, levels)
    assert engine.mm_processor_kwargs == kwargs
    assert engine.limit_mm_per_prompt == {"image": 999, "video": 999}  # vLLM's defaults
    worker = tower_fingerprint(VisionTower.load(directory, processor_kwargs=kwargs))
    assert worker == engine.fingerprint
    default = tower_fingerprint(VisionTower.load(directory))
    # max_pixels: Qwen3-VL's video processor (Qwen3.5's too) sizes frames by its own size setting
    qwen3_video = FAMILIES[family].video_timestamps
    no_video = FAMILIES[family].small_video_processor is None
    changed = ["preprocessing"] if qwen3_video or no_video else ["preprocessing", "video"]
    assert compact_differences(default.compact, engine.fingerprint.compact) == changed


def _another_models(fingerprint) -> str:
    """The compact fingerprint of a model with other vision weights."""
    parts = fingerprint.compact.split(".")
    parts[1] = "0" * len(parts[1])
    return ".".join(parts)


def test_an_item_for_another_model_is_refused_at_intake_before_any_encode(qwen25):
    """An item sent for another model's engine is refused as incompatible, with the part that
    differs; nothing is encoded; the same item for this model is accepted."""
    from tests.test_encode_worker import make_worker, request

    directory, tower, mine = qwen25
    worker, receiver = make_worker(directory, tower=tower)
    intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
    try:
        first, second = worker.table.mint(2, 60)
        image = png(96, 96, 1)
        reply = intake.send({**request(worker, first), "fingerprint": _another_models(mine)}, image)
        assert reply.status is IntakeStatus.REFUSED and reply.incompatible
        assert "the vision weights" in reply.reason and "differ" in reply.reason
        assert worker.table.view(first).state is RoomState.PENDING  # untouched: others may take it
        reply = intake.send({**request(worker, second), "fingerprint": mine.compact}, image)
        assert reply.status is IntakeStatus.ACCEPTED and not reply.incompatible
        eventually(
            lambda: worker.metrics.registry.get_sample_value("epd_encoder_batch_items_sum") == 1,
            "the accepted item encoded, alone",
        )
    finally:
        intake.close()
        worker.stop()
        receiver.close()


def _receive_one(tower, writer_says_its_model=True, **receiver):
    """One image through a real worker into a real ``PrefillReceiver`` (``receiver``: its config's
    overrides): the item's outcome and its published rows (None when none were)."""
    from epdserve.multimodal.items import MultimodalDataItem, MultimodalInputs
    from epdserve.wire.addresses import EncodeHandshake
    from epdserve.wire.states import JobState

    with loopback_stack(tower, receiver=receiver) as (worker, prefill, _):
        if not writer_says_its_model:
            worker.sender.writer.fingerprint = None
        image = png(96, 96, 2)
        (rows,) = tower.rows_per_item(tower.image_inputs(image)["image_grid_thw"])
        (room,) = worker.table.mint(1, 60)
        handshake = EncodeHandshake(
            bootstrap_room=room, bootstrap_host="127.0.0.1", bootstrap_port=worker.bootstrap_port
        )
        item = MultimodalDataItem(
            "image", offsets=[[0, rows - 1]], encode_handshake=handshake.model_dump()
        )
        job = prefill.start("r", MultimodalInputs([item]))
        intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")
        try:
            body = {
                "request_id": "r",
                "encode_handshake": handshake.model_dump(),
                "source": "bytes",
            }
            assert intake.send(body, image).ok
            assert job.wait(30) is not JobState.PENDING, "the item did not settle within 30 s"
        finally:
            intake.close()
        outcome, encoded = job.outcomes[0], item.encoded
        encoded = encoded.clone() if encoded is not None else None
        job.release()
        return outcome, encoded


def test_a_receiver_of_another_model_gets_no_row_and_is_told_why(qwen25):
    """A receiver registered for another model's engine: the worker fails the room instead of
    writing (the reason names the part that differs) and the item falls to the engine's own
    fallback (here: failed, with that reason); the same receiver for this model gets the rows."""
    directory, tower, mine = qwen25
    outcome, encoded = _receive_one(tower, model_fingerprint=_another_models(mine))
    assert outcome.state.value == "FAILED" and encoded is None
    assert "incompatible" in outcome.reason and "the vision weights" in outcome.reason
    outcome, encoded = _receive_one(tower, model_fingerprint=mine.compact)
    assert outcome.state.value == "DONE" and isinstance(encoded, torch.Tensor), outcome.reason


def test_rows_whose_model_is_not_said_are_never_published(qwen25):
    """A writer that says no model (one that predates fingerprints) commits rows the receiver of a
    fingerprinted engine refuses: nothing is published."""
    directory, tower, mine = qwen25
    outcome, encoded = _receive_one(
        tower, writer_says_its_model=False, model_fingerprint=mine.compact
    )
    assert outcome.state.value == "FAILED" and encoded is None
    assert "did not say which model" in outcome.reason
