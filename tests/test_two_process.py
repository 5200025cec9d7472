"""Byte-exact transfers into a receiver running in another process, over Mooncake TCP and SHM."""

import threading
import time

import pytest
import torch

from epdserve.data_plane.commit import make_commit
from epdserve.data_plane.pool import MemoryRegion
from epdserve.data_plane.transport import TransferState
from epdserve.testing.peer import PeerConfig, pattern, start_peer, stop_peer
from epdserve.wire.offers import MooncakeOffer, ShmOffer

pytestmark = pytest.mark.processes

WIDTH = 2048
SIZES = {  # bf16 rows x 2048 = 4 KiB per row
    "4KiB": 1,
    "1MiB": 256,
    "16MiB": 4096,
    "128MiB": 32768,
}


@pytest.fixture(scope="module")
def peer():
    process, conn = start_peer(
        PeerConfig(transports=("shm", "mooncake"), pool_bytes=160 << 20, slot_bytes=1 << 20)
    )
    yield conn
    stats = stop_peer(process, conn)
    assert stats["leased_slots"] == 0


@pytest.fixture(scope="module")
def sender():
    from epdserve.data_plane.transport import build_transports

    transports = build_transports(("shm", "mooncake"))
    region = MemoryRegion.anonymous(160 << 20)
    for transport in transports.values():
        if transport.name == "mooncake":
            transport.register(region)
    yield transports, region


def _send(peer, transports, region, name, rows, seed):
    payload = pattern(rows, WIDTH, "bfloat16", seed)
    src = region.tensor[: payload.numel() * 2]
    src.copy_(payload.view(-1).view(torch.uint8))
    peer.send(("reserve", rows, WIDTH, "bfloat16"))
    kind, generation, offers = peer.recv()
    offer_type = {"mooncake": MooncakeOffer, "shm": ShmOffer}[name]
    transfer = transports[name].submit(
        src, offer_type.model_validate(offers[name]), time.monotonic() + 30
    )
    assert transfer.wait() is TransferState.DONE, transfer.error
    peer.send(("commit", make_commit(payload, generation).model_dump(), seed))
    return peer.recv()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", ["mooncake", "shm"])
def test_bf16_byte_exact(peer, sender, name, size):
    transports, region = sender
    assert _send(peer, transports, region, name, SIZES[size], seed=len(size) * 7 + len(name)) == (
        "accepted",
        True,
    )


def test_receiver_rejects_bytes_that_do_not_match_the_commit(peer, sender):
    transports, region = sender
    payload = pattern(16, WIDTH, "bfloat16", 5)
    peer.send(("reserve", 16, WIDTH, "bfloat16"))
    _, generation, offers = peer.recv()
    src = region.tensor[: payload.numel() * 2]
    src.copy_(payload.view(-1).view(torch.uint8))
    src[100] ^= 0xFF  # one flipped byte in flight
    transfer = transports["shm"].submit(
        src, ShmOffer.model_validate(offers["shm"]), time.monotonic() + 5
    )
    assert transfer.wait() is TransferState.DONE
    peer.send(("commit", make_commit(payload, generation).model_dump(), None))
    kind, reason = peer.recv()
    assert kind == "rejected" and "checksum" in reason
    peer.send(("stats",))
    assert peer.recv()[1]["quarantined_slots"] == 1  # the rejected slot is held, not reused


def test_mooncake_liveness_probe_and_source_registration(peer, sender):
    transports, region = sender
    mooncake = transports["mooncake"]
    peer.send(("reserve", 1, WIDTH, "bfloat16"))
    _, generation, offers = peer.recv()
    offer = MooncakeOffer.model_validate(offers["mooncake"])
    assert mooncake.alive(offer.session)
    assert not mooncake.alive("127.0.0.1:1")
    from epdserve.data_plane.transport import TransferRefused

    with pytest.raises(TransferRefused, match="registered"):
        mooncake.submit(torch.ones(WIDTH, dtype=torch.bfloat16), offer, time.monotonic() + 5)
    payload = pattern(1, WIDTH, "bfloat16", 3)
    region.tensor[: WIDTH * 2].copy_(payload.view(-1).view(torch.uint8))
    assert (
        mooncake.submit(region.tensor[: WIDTH * 2], offer, time.monotonic() + 5).wait()
        is TransferState.DONE
    )
    peer.send(("commit", make_commit(payload, generation).model_dump(), 3))
    assert peer.recv() == ("accepted", True)


def test_first_contact_with_a_stalled_peer_is_refused_not_hung(sender):
    import os
    import signal

    from epdserve.data_plane.transport import TransferRefused

    transports, region = sender
    process, conn = start_peer(
        PeerConfig(transports=("mooncake",), pool_bytes=8 << 20, slot_bytes=1 << 20)
    )
    try:
        conn.send(("reserve", 1, WIDTH, "bfloat16"))
        _, generation, offers = conn.recv()
        offer = MooncakeOffer.model_validate(offers["mooncake"])
        # Mooncake picks its port at random: an earlier peer of this module may have had this
        # address, and then the sender knows it as reached and makes no first contact at all
        transports["mooncake"]._reached.discard(offer.session)
        os.kill(process.pid, signal.SIGSTOP)
        try:
            outcome = []

            def first_contact():
                try:
                    transports["mooncake"].submit(
                        region.tensor[: WIDTH * 2], offer, time.monotonic() + 1.0
                    )
                except TransferRefused as exc:
                    outcome.append(exc)

            contact = threading.Thread(target=first_contact, daemon=True)
            contact.start()
            contact.join(30)  # the write's own deadline is 1 s: a hung first contact fails here
            assert not contact.is_alive(), "the first contact with a stalled peer hung"
            assert outcome and "did not answer" in str(outcome[0]), outcome
        finally:
            os.kill(process.pid, signal.SIGCONT)
        payload = pattern(1, WIDTH, "bfloat16", 71)  # once it answers, writes go through
        region.tensor[: WIDTH * 2].copy_(payload.view(-1).view(torch.uint8))
        assert (
            transports["mooncake"]
            .submit(region.tensor[: WIDTH * 2], offer, time.monotonic() + 10)
            .wait()
            is TransferState.DONE
        )
        conn.send(("commit", make_commit(payload, generation).model_dump(), 71))
        assert conn.recv() == ("accepted", True)
    finally:
        stop_peer(process, conn)


def test_an_awaited_write_to_a_peer_that_died_goes_to_a_thread_and_fails_with_the_reason(sender):
    """A Mooncake write awaited through the ``CompletionPoller`` (as the encode worker awaits a
    write to a peer it has reached) whose peer died: the poller makes no call that may wait (a
    failed status is followed by a probe and maybe a resubmit), so it hands the write back (None)
    and ``wait`` on a thread of the caller's finds out: FAILED, the peer gone."""
    import asyncio

    from epdserve.data_plane.transport import CompletionPoller

    transports, region = sender
    process, conn = start_peer(
        PeerConfig(transports=("mooncake",), pool_bytes=16 << 20, slot_bytes=1 << 20)
    )
    poller = CompletionPoller()
    try:
        rows = 1024  # 4 MiB
        conn.send(("reserve", rows, WIDTH, "bfloat16"))
        _, _, offers = conn.recv()
        offer = MooncakeOffer.model_validate(offers["mooncake"])
        src = region.tensor[: rows * WIDTH * 2]
        reached = transports["mooncake"].submit(src[:4096], offer, time.monotonic() + 10)
        assert reached.wait() is TransferState.DONE
        assert transports["mooncake"].submits_in_background(offer)
        process.kill()
        process.join(10)
        transfer = transports["mooncake"].submit(src, offer, time.monotonic() + 10)

        async def awaited():
            return await asyncio.wait_for(poller.completion(transfer), 10)

        assert asyncio.run(awaited()) is None
        assert transfer.state is TransferState.PENDING
        assert transfer.wait() is TransferState.FAILED
        assert "gone" in transfer.error, transfer.error
        assert not transports["mooncake"].submits_in_background(offer)  # a new first contact
    finally:
        poller.close()
        conn.close()


def test_paused_mooncake_receiver_late_write_never_reaches_the_next_tenant(sender):
    """Notes P4 for real: the receiving process is SIGSTOPped during a write, the write misses
    its deadline (unsettled), the process resumes and the bytes land late. The receiver refuses
    the commit-less slot and quarantines it; the next tenant gets other slots and exact bytes."""
    import os
    import signal

    transports, region = sender
    process, conn = start_peer(
        PeerConfig(transports=("mooncake",), pool_bytes=160 << 20, slot_bytes=1 << 20)
    )
    try:
        rows = 16384  # 64 MiB
        stale = pattern(rows, WIDTH, "bfloat16", 61)
        conn.send(("reserve", rows, WIDTH, "bfloat16"))
        _, generation, offers = conn.recv()
        first = MooncakeOffer.model_validate(offers["mooncake"])
        src = region.tensor[: stale.numel() * 2]
        src.copy_(stale.view(-1).view(torch.uint8))
        # connect first, so the stall hits a write in flight (a stalled first contact is refused)
        assert (
            transports["mooncake"].submit(src[:4096], first, time.monotonic() + 10).wait()
            is TransferState.DONE
        )
        os.kill(process.pid, signal.SIGSTOP)
        try:
            transfer = transports["mooncake"].submit(src, first, time.monotonic() + 1.0)
            assert transfer.wait() is TransferState.FAILED and not transfer.settled
        finally:
            os.kill(process.pid, signal.SIGCONT)
        # the sender never commits; the receiver gives up on the slot (a commit it cannot verify)
        conn.send(("commit", make_commit(stale, generation + 1).model_dump(), None))
        assert conn.recv()[0] == "rejected"
        fresh = pattern(rows, WIDTH, "bfloat16", 62)
        conn.send(("reserve", rows, WIDTH, "bfloat16"))
        _, generation2, offers2 = conn.recv()
        second = MooncakeOffer.model_validate(offers2["mooncake"])
        assert generation2 > generation
        assert (
            second.address >= first.address + first.capacity
            or second.address + second.capacity <= first.address
        )
        time.sleep(0.5)  # let the late write finish landing in the quarantined slot
        src.copy_(fresh.view(-1).view(torch.uint8))
        assert (
            transports["mooncake"].submit(src, second, time.monotonic() + 30).wait()
            is TransferState.DONE
        )
        conn.send(("commit", make_commit(fresh, generation2).model_dump(), 62))
        assert conn.recv() == ("accepted", True)
        conn.send(("stats",))
        assert conn.recv()[1]["quarantined_slots"] == 64
    finally:
        stop_peer(process, conn)


ENGINE_OWNER = """
import os, sys, time
os.environ["MC_TRANSFER_TIMEOUT"] = "40"  # the engine's own setting, before anything of ours runs
from mooncake.engine import TransferEngine
from epdserve.testing.peer import PeerConfig, pattern, start_peer, stop_peer
from epdserve.data_plane.commit import make_commit
from epdserve.data_plane.mooncake import MooncakeConfig, MooncakeTransport
from epdserve.wire.offers import MooncakeOffer
from epdserve.data_plane.pool import MemoryRegion

def main():
    config = MooncakeConfig(hostname="127.0.0.1", force_tcp=True, transfer_timeout_s=7)
    # an engine's own TransferEngine, which the receiver adopts instead of making a second
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    adopted = MooncakeTransport.adopt(engine, config)
    assert MooncakeTransport.for_process(MooncakeConfig(hostname="127.0.0.1")) is adopted
    assert adopted.engine is engine and adopted.session.endswith(str(engine.get_rpc_port()))
    process, peer = start_peer(PeerConfig(("mooncake",), pool_bytes=2 << 20, slot_bytes=1 << 20))
    try:
        payload = pattern(64, 1024, "bfloat16", 7)
        region = MemoryRegion.anonymous(payload.numel() * 2)
        adopted.register(region)
        region.tensor.copy_(payload.reshape(-1).view(region.tensor.dtype))
        peer.send(("reserve", 64, 1024, "bfloat16"))
        _, generation, offers = peer.recv()
        offer = MooncakeOffer.model_validate(offers["mooncake"])
        transfer = adopted.submit(region.tensor, offer, time.monotonic() + 30)
        assert transfer.wait().value == "done", transfer.error
        peer.send(("commit", make_commit(payload, generation, False).model_dump(), 7))
        assert peer.recv() == ("accepted", True)
    finally:
        stop_peer(process, peer)
    # a transport that makes its own engine leaves the process's Mooncake settings as they were
    MooncakeTransport._instance = None
    made = MooncakeTransport(config)
    assert not made.adopted and made.engine is not engine
    print("env", os.environ.get("MC_TRANSFER_TIMEOUT"), os.environ.get("MC_FORCE_TCP"))

if __name__ == "__main__":
    main()
"""


def test_an_engines_own_transfer_engine_is_adopted_and_its_settings_left_alone(tmp_path):
    """Inside an engine that runs Mooncake for its KV cache: the receiver writes through that
    TransferEngine (adopted, no second one), and making our own engine sets Mooncake's variables
    only while it is made (the engine's MC_TRANSFER_TIMEOUT=40 is 40 after, MC_FORCE_TCP unset)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "engine_owner.py"
    script.write_text(ENGINE_OWNER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "MC_LOG_LEVEL": "ERROR"}
    env.pop("MC_FORCE_TCP", None)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "env 40 None" in result.stdout
