"""SHM segments and handles: validated names, no symlinks, no segment left when a side crashes."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from epdserve.data_plane.pool import MemoryRegion
from epdserve.data_plane.shm import (
    ShmError,
    ShmSegment,
    ShmTensorHandle,
    namespace_id,
    validate_name,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "name",
    [
        "",
        "epd-",
        "psm_1234",
        "epd-../../etc/passwd",
        "epd-a/b",
        "/epd-a",
        "epd-a b",
        "epd-" + "x" * 101,
        "EPD-a",
        "epd-\x00",
    ],
)
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError):
        validate_name(name)
    with pytest.raises(ValueError):
        ShmSegment.attach(name)


@given(st.text(max_size=120))
def test_only_our_names_pass_validation(name):
    try:
        validate_name(name)
    except ValueError:
        return
    assert name.startswith("epd-") and "/" not in name and len(name) <= 104 and name.isascii()


def test_symlinks_and_foreign_files_are_not_opened(tmp_path, no_new_segments):
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 64)
    link = "/dev/shm/epd-test-link"
    os.symlink(target, link)
    try:
        with pytest.raises(ShmError):
            ShmSegment.attach("epd-test-link")
    finally:
        os.unlink(link)
    with pytest.raises(ShmError):
        ShmSegment.attach("epd-does-not-exist")


def test_segment_round_trip_and_owner_only_unlink(no_new_segments):
    owner = ShmSegment.create(4096, kind="t")
    peer = ShmSegment.attach(owner.name, min_size=4096)
    owner.tensor[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert peer.tensor[:3].tolist() == [1, 2, 3]
    with pytest.raises(ShmError):
        peer.unlink()
    with pytest.raises(ShmError):
        ShmSegment.attach(owner.name, min_size=8192)  # shorter than promised
    owner.unlink()
    peer.close(), owner.close()
    assert not os.path.exists(f"/dev/shm/{owner.name}")


def test_namespace_id_is_stable_and_names_this_tmpfs():
    assert namespace_id() == namespace_id()
    assert namespace_id().endswith(f":{os.stat('/dev/shm').st_dev}")


def test_handle_lifecycle_publish_attach_consume(no_new_segments):
    tensor = torch.randn(33, 7).to(torch.bfloat16)
    handle = ShmTensorHandle.publish(tensor)
    wire = ShmTensorHandle.from_wire(handle.to_wire())
    wire.attach()
    out = wire.consume()
    assert torch.equal(out, tensor) and out.dtype == torch.bfloat16
    assert not os.path.exists(f"/dev/shm/{handle.shm_name}")
    with pytest.raises(RuntimeError):
        wire.consume()


def test_handle_release_without_reading(no_new_segments):
    handle = ShmTensorHandle.publish(torch.ones(5))
    handle.release()
    handle.release()  # idempotent
    assert not os.path.exists(f"/dev/shm/{handle.shm_name}")


def test_handle_refuses_bad_wire_fields():
    with pytest.raises(ValueError):
        ShmTensorHandle.from_wire({"shm_name": "../x", "shape": [1], "dtype": "float32"})
    with pytest.raises(ValueError):
        ShmTensorHandle.from_wire({"shm_name": "epd-x", "shape": [1], "dtype": "complex64"})


def _python(code: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_WAIT_POLICY="PASSIVE")
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=env
    )


def _gone_within(path: str, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not os.path.exists(path):
            return True
        time.sleep(0.05)
    return False


def test_pool_owner_killed_leaves_no_segment(no_new_segments):
    child = _python("""
        import time
        from epdserve.data_plane.pool import MemoryRegion
        region = MemoryRegion.shared(1 << 20)
        print(region.shm.name, flush=True)
        time.sleep(60)
    """)
    name = child.stdout.readline().strip()
    assert os.path.exists(f"/dev/shm/{name}")
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert _gone_within(f"/dev/shm/{name}", 5)


def test_handle_consumer_killed_mid_way_leaves_no_segment(no_new_segments):
    handle = ShmTensorHandle.publish(torch.arange(1000.0))
    child = _python(f"""
        import time, torch
        from epdserve.data_plane.shm import ShmTensorHandle
        handle = ShmTensorHandle.from_wire({handle.to_wire()!r})
        handle.attach()
        print("attached", flush=True)
        time.sleep(60)
    """)
    assert child.stdout.readline().strip() == "attached"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert _gone_within(f"/dev/shm/{handle.shm_name}", 5)


def test_full_dev_shm_is_a_clean_error(no_new_segments):
    free = os.statvfs("/dev/shm")
    too_big = free.f_bavail * free.f_frsize + (1 << 30)
    with pytest.raises(ShmError) as info:
        MemoryRegion.shared(too_big)
    assert info.value.errno is not None


def test_a_writer_lets_go_of_the_pools_of_receivers_that_are_gone(no_new_segments):
    """A writer keeps each receiver's pool mapped. Once a pool's name is gone (its receiver closed
    it or died), the writer unmaps it when it next maps a pool, and refuses to write into it: a
    dead receiver's pages stay allocated while anyone maps them (found by the soak: the SHM writer's
    shared memory grew with every prefill process it outlived)."""
    import time

    from epdserve.data_plane.pool import SlotPool
    from epdserve.data_plane.shm_transport import ShmTransport
    from epdserve.data_plane.transport import TransferRefused, TransferState

    transport = ShmTransport()
    pools = [SlotPool(MemoryRegion.shared(1 << 20), 1 << 16, 1.0) for _ in range(2)]
    try:
        offers = [transport.offer(pool, pool.lease(4096)) for pool in pools]
        source = torch.ones(4096, dtype=torch.uint8)
        assert (
            transport.submit(source, offers[0], time.monotonic() + 5).wait() is TransferState.DONE
        )
        pools[0].region.close()  # the first receiver goes
        assert (
            transport.submit(source, offers[1], time.monotonic() + 5).wait() is TransferState.DONE
        )
        assert list(transport._attached) == [offers[1].segment]
        with pytest.raises(TransferRefused, match="cannot map"):
            transport.submit(source, offers[0], time.monotonic() + 5)
    finally:
        pools[1].region.close()
        transport.close()
