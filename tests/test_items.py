"""The item model: seed semantics, content hashes, pad ids, the row contract and the wire form."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from epdserve.data_plane.shm import ShmTensorHandle
from epdserve.multimodal.hashing import hash_feature
from epdserve.multimodal.items import (
    MM_PAD_BASE,
    MM_PAD_HASH_MASK,
    Modality,
    MultimodalDataItem,
    MultimodalInputs,
    is_mm_pad_value,
    maybe_substitute_mm_pad,
)
from epdserve.multimodal.rows import RowContractError, item_rows, split_rows
from epdserve.wire.addresses import EncodeHandshake


def test_pad_value_derives_from_hash_and_is_recognised():
    item = MultimodalDataItem(Modality.IMAGE, hash=(1 << 40) + 12345)
    item.set_pad_value()
    assert item.pad_value == MM_PAD_BASE + (((1 << 40) + 12345) & MM_PAD_HASH_MASK)
    ids = torch.tensor([5, item.pad_value, MM_PAD_BASE - 1, MM_PAD_BASE + MM_PAD_HASH_MASK + 1])
    assert is_mm_pad_value(ids).tolist() == [False, True, False, False]
    assert maybe_substitute_mm_pad(ids, 7).tolist() == [
        5,
        7,
        MM_PAD_BASE - 1,
        MM_PAD_BASE + MM_PAD_HASH_MASK + 1,
    ]
    assert maybe_substitute_mm_pad(ids, None) is ids


def test_ensure_hash_rules(monkeypatch, no_new_segments):
    given_hash = MultimodalDataItem(Modality.IMAGE, hash=42, feature=torch.ones(3))
    given_hash.ensure_hash()
    assert given_hash.hash == 42  # a gateway hash is kept, never recomputed

    inline = MultimodalDataItem(Modality.AUDIO, feature=torch.ones(3))
    inline.ensure_hash()
    assert inline.hash == hash_feature(torch.ones(3))

    handle = ShmTensorHandle.publish(torch.ones(3))
    try:
        with pytest.raises(ValueError, match="content hash"):
            MultimodalDataItem(Modality.IMAGE, feature=handle).ensure_hash()
    finally:
        handle.release()

    monkeypatch.setenv("EPD_MM_SKIP_COMPUTE_HASH", "1")
    a, b = MultimodalDataItem(Modality.IMAGE, hash=1), MultimodalDataItem(Modality.IMAGE, hash=1)
    a.ensure_hash(), b.ensure_hash()
    assert a.hash != b.hash  # dedup disabled: every item is unique


def test_hash_feature_separates_dtype_and_shape_but_not_equal_content():
    base = torch.arange(12, dtype=torch.float32)
    assert hash_feature(base) == hash_feature(base.clone())
    assert hash_feature(base) != hash_feature(base.reshape(3, 4))
    assert hash_feature(base) != hash_feature(base.view(torch.int32))
    assert hash_feature(b"png bytes") == hash_feature(bytearray(b"png bytes"))
    assert hash_feature(np.ones(3)) != hash_feature(np.ones(3, dtype=np.float32))
    with pytest.raises(TypeError):
        hash_feature("a string")


def test_model_specific_data_reads_as_attributes():
    item = MultimodalDataItem(Modality.IMAGE, model_specific_data={"image_grid_thw": [1, 4, 4]})
    assert item.image_grid_thw == [1, 4, 4]
    with pytest.raises(AttributeError):
        item.missing


def test_item_rows_sums_inclusive_spans_and_refuses_bad_spans():
    assert item_rows([(3, 66)]) == 64
    assert item_rows([(0, 9), (20, 29)]) == 20
    for bad in ([], None, [(5, 4)], [(-1, 3)], [(0, 9), (5, 12)], [(1, 2, 3)]):
        with pytest.raises(RowContractError):
            item_rows(bad)


@given(st.lists(st.integers(1, 50), min_size=1, max_size=8), st.integers(1, 16))
def test_split_rows_round_trips(rows, width):
    packed = torch.randn(sum(rows), width)
    parts = split_rows(packed, rows)
    assert [p.shape[0] for p in parts] == rows
    assert torch.equal(torch.cat(parts), packed)


def test_split_rows_refuses_mismatch():
    packed = torch.zeros(10, 4)
    for bad in ([4, 5], [5, 6], [10, 0], []):
        with pytest.raises(RowContractError):
            split_rows(packed, bad)
    with pytest.raises(RowContractError):
        split_rows(torch.zeros(10), [10])


@pytest.mark.parametrize(
    "handshake",
    [
        {"bootstrap_room": 0, "bootstrap_host": "h", "bootstrap_port": 1},
        {"bootstrap_room": -1, "bootstrap_host": "h", "bootstrap_port": 1},
        {"bootstrap_room": 1 << 63, "bootstrap_host": "h", "bootstrap_port": 1},
        {"bootstrap_room": 1, "bootstrap_host": "h/../x", "bootstrap_port": 1},
        {"bootstrap_room": 1, "bootstrap_host": "h", "bootstrap_port": 70000},
    ],
)
def test_encode_handshake_refuses_bad_addresses(handshake):
    with pytest.raises(ValueError):
        EncodeHandshake(**handshake)


def test_inputs_publish_and_release_shm_features(no_new_segments):
    inputs = MultimodalInputs(
        [MultimodalDataItem(Modality.IMAGE, hash=1, feature=torch.arange(6.0))]
    )
    inputs.publish_shm_features()
    assert inputs.has_pending_shm_features()
    inputs.attach_shm_features()
    assert torch.equal(inputs.mm_items[0].feature.consume(), torch.arange(6.0))
    inputs.release_shm_features()  # consumed already: release is a safe no-op
    assert not inputs.has_pending_shm_features()


@pytest.mark.parametrize(
    "host, url",
    [
        ("10.0.0.5", "http://10.0.0.5:8990"),
        ("::1", "http://[::1]:8990"),
        ("[::1]", "http://[::1]:8990"),
        ("worker-0.epd", "http://worker-0.epd:8990"),
    ],
)
def test_encode_handshake_url_brackets_an_ipv6_host_once(host, url):
    assert EncodeHandshake(bootstrap_room=1, bootstrap_host=host, bootstrap_port=8990).url == url
