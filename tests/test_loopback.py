"""The loopback transport moves real bytes through the common interface, and its faults behave
like the real failures they stand for."""

import sys
import time

import pytest
import torch

from epdserve.data_plane.commit import ContractError, EmbeddingLayout, accept_commit, make_commit
from epdserve.data_plane.loopback import LoopbackFault, LoopbackTransport
from epdserve.data_plane.mooncake import MooncakeConfig, MooncakeUnavailable, _load_engine_class
from epdserve.data_plane.pool import MemoryRegion, SlotPool
from epdserve.data_plane.transport import TransferRefused, TransferState
from epdserve.wire.offers import MooncakeOffer


@pytest.fixture
def setup():
    transport = LoopbackTransport()
    pool = SlotPool(MemoryRegion.anonymous(1 << 20), 4096, quarantine_s=0.5)
    transport.register(pool.region)
    return transport, pool


def _reserve(transport, pool, rows, width=64, dtype="bfloat16"):
    layout = EmbeddingLayout(rows, width, dtype)
    lease = pool.lease(layout.nbytes)
    return layout, lease, transport.offer(pool, lease)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_bytes_arrive_exactly(setup, dtype):
    transport, pool = setup
    payload = torch.randn(37, 64).to(dtype)
    layout, lease, offer = _reserve(transport, pool, 37, dtype=str(dtype).removeprefix("torch."))
    assert transport.submit(payload, offer, time.monotonic() + 1).wait() is TransferState.DONE
    got = accept_commit(pool, lease, layout, make_commit(payload, lease.generation))
    assert torch.equal(got, payload) and got.data_ptr() == pool.view(lease).data_ptr()


def test_oversize_and_foreign_offers_are_refused_before_any_write(setup):
    transport, pool = setup
    layout, lease, offer = _reserve(transport, pool, 2)
    before = pool.region.tensor.clone()
    with pytest.raises(TransferRefused):
        transport.submit(torch.ones(3, 64, dtype=torch.bfloat16), offer, time.monotonic() + 1)
    with pytest.raises(TransferRefused):
        transport.submit(torch.ones(2, 64, dtype=torch.bfloat16).t(), offer, time.monotonic() + 1)
    with pytest.raises(TransferRefused):
        transport.submit(
            torch.ones(2, 64),
            MooncakeOffer(kind="mooncake", session="h:1", address=1, capacity=1 << 20),
            time.monotonic() + 1,
        )
    assert torch.equal(pool.region.tensor, before)


def test_delay_fault_lands_then_completes(setup):
    transport, pool = setup
    layout, lease, offer = _reserve(transport, pool, 4)
    transport.inject(LoopbackFault("delay", 0.05))
    payload = torch.randn(4, 64).to(torch.bfloat16)
    transfer = transport.submit(payload, offer, time.monotonic() + 2)
    assert transfer.poll() is TransferState.PENDING
    assert transfer.wait() is TransferState.DONE and transfer.settled
    assert torch.equal(pool.view(lease).view(torch.bfloat16).view(4, 64), payload)


def test_error_fault_fails_and_writes_nothing(setup):
    transport, pool = setup
    layout, lease, offer = _reserve(transport, pool, 4)
    transport.inject(LoopbackFault("error"))
    transfer = transport.submit(
        torch.ones(4, 64, dtype=torch.bfloat16), offer, time.monotonic() + 1
    )
    assert transfer.poll() is TransferState.FAILED and transfer.settled
    assert int(pool.view(lease).sum()) == 0


def test_drop_fault_fails_at_the_deadline(setup):
    transport, pool = setup
    layout, lease, offer = _reserve(transport, pool, 4)
    transport.inject(LoopbackFault("drop"))
    transfer = transport.submit(
        torch.ones(4, 64, dtype=torch.bfloat16), offer, time.monotonic() + 0.05
    )
    assert transfer.poll() is TransferState.PENDING
    assert transfer.wait() is TransferState.FAILED and transfer.error == "deadline exceeded"


def test_one_completion_poller_resolves_each_awaited_write_with_its_end(setup):
    """Writes awaited on an event loop through one ``CompletionPoller``: each future resolves with
    its own transfer's end (delayed ones after their bytes landed, a dropped one FAILED at its
    deadline), whatever order they finish in; a write already over resolves at once."""
    import asyncio

    from epdserve.data_plane.transport import CompletionPoller

    transport, pool = setup
    poller = CompletionPoller()
    try:

        async def scenario():
            faults = [
                LoopbackFault("delay", 0.2),
                LoopbackFault("delay", 0.05),
                LoopbackFault("drop"),
                LoopbackFault("error"),
            ]
            payloads, leases, transfers = [], [], []
            for index, fault in enumerate(faults):
                transport.inject(fault)
                layout, lease, offer = _reserve(transport, pool, 4)
                payload = torch.full((4, 64), float(index + 1), dtype=torch.bfloat16)
                deadline = time.monotonic() + (0.1 if fault.kind == "drop" else 5)
                transfers.append(transport.submit(payload, offer, deadline))
                payloads.append(payload)
                leases.append(lease)
            states = await asyncio.wait_for(
                asyncio.gather(*(poller.completion(t) for t in transfers)), 5
            )
            return payloads, leases, transfers, states

        payloads, leases, transfers, states = asyncio.run(scenario())
        assert states == [
            TransferState.DONE,
            TransferState.DONE,
            TransferState.FAILED,
            TransferState.FAILED,
        ]
        assert transfers[2].error == "deadline exceeded"
        for payload, lease in zip(payloads[:2], leases[:2]):
            assert torch.equal(pool.view(lease).view(torch.bfloat16).view(4, 64), payload)
    finally:
        poller.close()
    transport.inject(LoopbackFault("delay", 1.0))
    _, _, offer = _reserve(transport, pool, 4)
    pending = transport.submit(torch.ones(4, 64, dtype=torch.bfloat16), offer, time.monotonic() + 5)

    async def after_close():
        return await asyncio.wait_for(poller.completion(pending), 1)

    assert asyncio.run(after_close()) is None  # closed: the caller's own thread waits
    assert pending.wait() is TransferState.DONE


def test_commit_contract_is_checked(setup):
    transport, pool = setup
    payload = torch.randn(4, 64).to(torch.bfloat16)
    layout, lease, offer = _reserve(transport, pool, 4)
    transport.submit(payload, offer, time.monotonic() + 1).wait()
    good = make_commit(payload, lease.generation)
    for bad in (
        good.model_copy(update={"generation": lease.generation + 1}),
        good.model_copy(update={"rows": 2, "width": 128}),
        good.model_copy(update={"dtype": "float16"}),
        good.model_copy(update={"checksum": (good.checksum + 1) % (1 << 64)}),
    ):
        with pytest.raises(ContractError):
            accept_commit(pool, lease, layout, bad)
    assert torch.equal(accept_commit(pool, lease, layout, good), payload)
    pool.release(lease)
    with pytest.raises(ContractError, match="no longer live"):
        accept_commit(pool, lease, layout, good)


def test_missing_mooncake_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(MooncakeUnavailable, match="pip install"):
        _load_engine_class(MooncakeConfig())
