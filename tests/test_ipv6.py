"""An IPv6 loopback path end to end: an encode worker listening and naming itself on ``::1``,
the dispatcher reaching its rooms and intake there, a reference prefill process registering in
rooms at ``http://[::1]:port`` and receiving the rows (SHM), checked against its own tower."""

import asyncio
import socket

import aiohttp
import pytest

from bench.cluster import LocalCluster
from bench.images import synthetic_image
from dispatcher import Dispatcher, WorkerSet
from dispatcher.cli import prefill_body
from dispatcher.workers import WorkerAddress
from encode_worker.small_checkpoints import build_vision_only


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_a_worker_on_ipv6_loopback_delivers(tmp_path, no_new_segments):
    from transformers import AutoImageProcessor

    model = build_vision_only("qwen2_5_vl", str(tmp_path / "tower"), out_width=256)
    with LocalCluster(model, log_dir=str(tmp_path)) as cluster:
        worker = cluster.start_encode_worker("worker-v6", transports="shm", host="::1")
        prefill = cluster.start_prefill("prefill", transports="shm")
        cluster.wait_ready()
        assert worker.url.startswith("http://[::1]:")
        address = WorkerAddress.parse(f"[::1]:{worker.worker.bootstrap_port}:{worker.worker.intake_port}")

        async def run():
            workers = WorkerSet([address], check_timeout_s=2)
            await workers.refresh()
            assert workers.status() == {address.name: "healthy"}
            dispatcher = Dispatcher(workers, AutoImageProcessor.from_pretrained(model))
            try:
                items = await dispatcher.dispatch("v6", [synthetic_image(112, 84, 7), synthetic_image(84, 84, 8)])
                assert [item.error for item in items] == [None, None]
                assert {item.encode_handshake.url.split("]")[0] for item in items} == {"http://[::1"}
                async with aiohttp.ClientSession() as session:
                    async with session.post(prefill.url + "/v1/prefill",
                                            json=prefill_body("v6", items, verify=True)) as response:
                        return await response.json()
            finally:
                await dispatcher.close()
                await workers.close()

        report = asyncio.run(run())
        assert report["state"] == "DONE"
        assert [(item["state"], item["transport"], item["verified"]) for item in report["items"]] == [
            ("DONE", "shm", True)] * 2
        codes = cluster.stop()
    assert codes == {"worker-v6": 0, "prefill": 0}
