"""Byte-exact transfers into a receiver running in another process, over Mooncake TCP and SHM."""

import time

import pytest
import torch

from bench.peer import PeerConfig, pattern, start_peer, stop_peer
from data_plane.commit import make_commit
from data_plane.offers import MooncakeOffer, ShmOffer
from data_plane.pool import MemoryRegion
from data_plane.transport import TransferState

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
    from data_plane.transport import build_transports

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
    from data_plane.transport import TransferRefused

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

    from data_plane.transport import TransferRefused

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
        started = time.monotonic()
        try:
            with pytest.raises(TransferRefused, match="did not answer"):
                transports["mooncake"].submit(
                    region.tensor[: WIDTH * 2], offer, time.monotonic() + 1.0
                )
            assert time.monotonic() - started < 2.0
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
