"""Late writes: bytes that arrive in a slot after its room failed. They must really land in the
quarantined slot (the quarantine is not for nothing), the slot must go to no one while they can
land, and the slot's next tenant must publish its own bytes, bit-exact, never the late ones.

The loopback transport's ``late`` fault fails a write at once and copies its bytes later, as a
Mooncake write that returned an error can still land. Here the later copy is held until the test
lands it (the ``gate`` fixture), so it lands after the slot was quarantined, not merely some
time after; the pools' quarantine runs on a clock the test moves, so no assertion depends on
timing.
"""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from epdserve.data_plane import loopback as loopback_module
from epdserve.data_plane.commit import ContractError, EmbeddingLayout, accept_commit, make_commit
from epdserve.data_plane.loopback import LoopbackFault, LoopbackTransport
from epdserve.data_plane.pool import MemoryRegion, NoCapacity, SlotPool
from epdserve.data_plane.shm_transport import ShmTransport
from epdserve.data_plane.transport import TransferState
from epdserve.testing.receive_items import loopback_handshake
from tests.waiting import FakeClock, eventually

SLOT = 1 << 16
QUARANTINE_S = 30.0


class Gate:
    """Holds the loopback transport's delayed copies until ``land()`` runs them (the transport's
    own copy of the bytes it was given)."""

    def __init__(self):
        self.held = []

    def timer(self, seconds, function, args=()):
        gate = self

        class HeldTimer:
            daemon = True

            def start(self):
                gate.held.append(lambda: function(*args))

        return HeldTimer()

    def land(self) -> None:
        assert self.held, "no late copy is waiting"
        while self.held:
            self.held.pop(0)()


@pytest.fixture
def gate(monkeypatch):
    held = Gate()
    monkeypatch.setattr(
        loopback_module,
        "threading",
        SimpleNamespace(Timer=held.timer, Event=threading.Event, Lock=threading.Lock),
    )
    return held


def slot_rows(pool, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The pool's memory at ``offset`` read as rows shaped like ``like``."""
    nbytes = like.numel() * like.element_size()
    return pool.region.tensor[offset : offset + nbytes].view(like.dtype).view(like.shape)


@pytest.mark.parametrize("kind", ["loopback-late-fault", "shm-write-issued-late"])
def test_late_bytes_land_in_the_quarantined_slot_and_never_reach_the_next_tenant(
    kind, gate, no_new_segments
):
    """One slot: the next tenant can only get the very memory the late bytes landed in."""
    clock = FakeClock()
    pool = SlotPool(MemoryRegion.shared(SLOT), SLOT, quarantine_s=QUARANTINE_S, clock=clock)
    transport = LoopbackTransport() if kind.startswith("loopback") else ShmTransport()
    transport.register(pool.region)
    try:
        layout = EmbeddingLayout(8, 64, "float32")
        lease = pool.lease(layout.nbytes)
        offer = transport.offer(pool, lease)
        late = torch.randn(8, 64)
        if kind.startswith("loopback"):
            transport.inject(LoopbackFault("late", 0.0))
            failed = transport.submit(late, offer, time.monotonic() + 5)
            assert (
                failed.poll() is TransferState.FAILED and not failed.settled
            )  # failed, bytes still to come
        pool.quarantine(lease)  # the receiver gives up on the slot: held, not freed
        assert not torch.equal(slot_rows(pool, lease.offset, late), late)  # nothing has landed yet
        if kind.startswith("loopback"):
            gate.land()
        else:  # a writer that never heard of the failure writes through its own mapping of the pool
            assert transport.submit(late, offer, time.monotonic() + 5).wait() is TransferState.DONE
        assert torch.equal(
            slot_rows(pool, lease.offset, late), late
        )  # the late bytes are in the slot
        assert pool.stats()["quarantined_slots"] == 1 and pool.stats()["leased_slots"] == 0
        with pytest.raises(NoCapacity):
            pool.lease(layout.nbytes)  # no one gets the slot while it is held
        with pytest.raises(ContractError):
            accept_commit(
                pool, lease, layout, make_commit(late, lease.generation)
            )  # nor publishes it
        clock.now += QUARANTINE_S
        tenant = pool.lease(layout.nbytes)
        assert (
            tenant.offset == lease.offset and tenant.generation > lease.generation
        )  # the same memory
        own = torch.randn(8, 64)
        assert (
            transport.submit(own, transport.offer(pool, tenant), time.monotonic() + 5).wait()
            is TransferState.DONE
        )
        published = accept_commit(pool, tenant, layout, make_commit(own, tenant.generation))
        assert torch.equal(published, own) and not torch.equal(published, late)
        assert published.data_ptr() == slot_rows(pool, lease.offset, late).data_ptr()
    finally:
        transport.unregister(pool.region)
        transport.close()
        pool.region.close()


# ---- the same through the real receiver and encode worker -------------------------------------


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    from epdserve.vision.small_checkpoints import build_full
    from epdserve.vision.tower import VisionTower

    return VisionTower.load(build_full("qwen2_5_vl", str(tmp_path_factory.mktemp("q25"))))


def test_a_late_write_from_the_encode_worker_is_held_in_quarantine_and_the_next_request_gets_its_own_rows(  # noqa: E501
    tower, gate, no_new_segments
):
    """A real encode worker writes over loopback into a real ``PrefillReceiver`` whose pool is one
    slot (zero-copy: a published item is a view of the slot itself). The worker's write fails and
    its bytes land later: the receiver fails the item and quarantines the slot; the late bytes land
    in it; a request during the quarantine is refused (no slot), not given the slot; once the
    quarantine ends the next request gets the same slot, and its rows are its own, bit-exact."""
    from epdserve.multimodal.items import Modality, MultimodalDataItem, MultimodalInputs
    from epdserve.vision.images import image_from_bytes
    from epdserve.wire.intake import IntakeClient
    from epdserve.wire.rooms import RoomState
    from prefill_side import JobState, PrefillReceiver, ReceiverConfig
    from tests.encode_helpers import loopback_stack, png

    def rows_of(image):
        inputs = tower.processor(images=[image_from_bytes(image)], return_tensors="pt")
        return tower.encode_items(inputs["pixel_values"], inputs["image_grid_thw"])[0]

    with loopback_stack(tower, worker=dict(cache_bytes=0)) as (worker, _, loopback):
        clock = FakeClock()  # the receiver's pool's, a clock the test moves
        receiver = PrefillReceiver(
            ReceiverConfig(
                width=tower.info.wire_width,
                dtype="float32",
                pool_bytes=SLOT,
                slot_bytes=SLOT,
                item_timeout_s=10,
                zero_copy=True,
                quarantine_s=QUARANTINE_S,
            ),
            transports={"loopback": loopback},
            clock=clock,
        )
        intake = IntakeClient(f"tcp://127.0.0.1:{worker.intake_port}")

        def request(image, tag):
            (room,) = worker.table.mint(1, 60)
            item = MultimodalDataItem(
                Modality.IMAGE,
                offsets=[[0, rows_of(image).shape[0] - 1]],
                encode_handshake=loopback_handshake(room, worker.bootstrap_port),
            )
            return receiver.start(tag, MultimodalInputs([item])), item, room

        def send(image, room, tag):
            assert intake.send(
                {
                    "request_id": tag,
                    "source": "bytes",
                    "encode_handshake": loopback_handshake(room, worker.bootstrap_port),
                },
                image,
            ).ok

        try:
            first, second = png(64, 64, 1), png(64, 64, 2)
            late, own = rows_of(first), rows_of(second)
            assert late.shape == own.shape and not torch.equal(late, own)
            loopback.inject(LoopbackFault("late", 0.0))
            job, _, room = request(first, "late")
            send(first, room, "late")
            assert job.wait(20) is JobState.FAILED and "write failed" in job.reasons[0], job.reasons
            view = worker.table.view(room)
            assert (
                view.state is RoomState.FAILED and not view.writer_settled
            )  # bytes may still land
            assert (
                receiver.pool.stats()["quarantined_slots"] == 1
                and receiver.pool.stats()["leased_slots"] == 0
            )
            assert not torch.equal(
                slot_rows(receiver.pool, 0, late), late
            )  # held by the gate: not yet
            gate.land()
            assert torch.equal(
                slot_rows(receiver.pool, 0, late), late
            )  # the worker's bytes, in the held slot
            during, _, during_room = request(second, "during")
            assert during.wait(10) is JobState.FAILED and "cannot reserve" in during.reasons[0], (
                during.reasons
            )
            # its worker is told to stop (the cancel follows the item's failure: not at the same
            # instant)
            eventually(
                lambda: worker.table.view(during_room).state is RoomState.CANCELLED,
                "the room cancelled",
            )
            assert (
                receiver.pool.stats()["quarantined_slots"] == 1
                and receiver.pool.stats()["leased_slots"] == 0
            )
            clock.now += QUARANTINE_S
            job, item, room = request(second, "next")
            send(second, room, "next")
            assert job.wait(20) is JobState.DONE, job.reasons
            assert (
                item.encoded.data_ptr() == slot_rows(receiver.pool, 0, late).data_ptr()
            )  # the same memory
            assert torch.equal(item.encoded, own) and not torch.equal(item.encoded, late)
            job.release()
            assert (
                receiver.pool.stats()["leased_slots"] == 0
                and receiver.pool.stats()["quarantined_slots"] == 0
            )
        finally:
            intake.close()
            receiver.close()
