"""An IPv6 loopback path end to end: an encode worker listening and naming itself on ``::1``,
the dispatcher reaching its rooms and intake there, a reference prefill process registering in
rooms at ``http://[::1]:port`` and receiving the rows (SHM), checked against its own tower; a room
address whose host comes bracketed is the same endpoint. And ``Endpoint``, the one spelling of a
host and port every hop uses."""

import asyncio
import socket

import aiohttp
import pytest

from epdserve.dispatcher import Dispatcher, WorkerSet
from epdserve.dispatcher.cli import prefill_body
from epdserve.dispatcher.workers import WorkerAddress
from epdserve.multimodal.items import Modality, MultimodalDataItem, MultimodalInputs
from epdserve.testing.cluster import LocalCluster
from epdserve.testing.images import synthetic_image
from epdserve.vision.small_checkpoints import build_vision_only
from epdserve.wire.addresses import EncodeHandshake, Endpoint
from prefill_side import JobState, PrefillReceiver, ReceiverConfig


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_an_endpoint_is_one_value_however_its_host_is_spelled():
    v6 = Endpoint.parse("[::1]:8990")
    assert v6 == Endpoint("::1", 8990) == Endpoint("[::1]", 8990) == Endpoint("0:0::1", 8990)
    assert hash(v6) == hash(Endpoint("[::1]", 8990)) and v6.host == "::1"
    assert (v6.authority, v6.url("http"), v6.url("tcp")) == (
        "[::1]:8990",
        "http://[::1]:8990",
        "tcp://[::1]:8990",
    )
    assert Endpoint.parse(v6.authority) == v6 and str(v6) == "[::1]:8990"
    v4 = Endpoint.parse("10.0.0.5:9000")
    assert (v4.authority, v4.url("http")) == ("10.0.0.5:9000", "http://10.0.0.5:9000")
    assert Endpoint.parse("w-1:1").url("tcp") == "tcp://w-1:1"
    for bad in (
        "",
        "h",
        "[::1]",
        ":1",
        "h:0",
        "h:70000",
        "h:x",
        "h:1:2",
        "::1:8990",
        "[not-v6]:1",
        "[::1]x:1",
    ):
        with pytest.raises(ValueError):
            Endpoint.parse(bad)
    with pytest.raises(ValueError):
        Endpoint("[]", 1)
    handshake = EncodeHandshake.at(v6, 7)
    assert (handshake.bootstrap_host, handshake.bootstrap_port, handshake.url) == (
        "::1",
        8990,
        "http://[::1]:8990",
    )
    bracketed = EncodeHandshake(bootstrap_room=7, bootstrap_host="[::1]", bootstrap_port=8990)
    assert bracketed.endpoint == handshake.endpoint and bracketed.url == handshake.url
    worker = WorkerAddress.parse("[fd00::5]:9000:9001")
    assert (worker.name, str(worker), worker.rooms, worker.intake) == (
        "[fd00::5]:9000",
        "[fd00::5]:9000:9001",
        Endpoint("fd00::5", 9000),
        Endpoint("fd00::5", 9001),
    )
    assert WorkerAddress.parse(str(worker)) == worker == WorkerAddress("[fd00::5]", 9000, 9001)


def test_a_room_named_with_and_without_brackets_is_one_room_to_the_receiver():
    """The receiver keys rooms by endpoint: ``[::1]`` and ``::1`` name the same room, so the
    second item naming it is refused as a duplicate (it once counted as another endpoint's)."""
    receiver = PrefillReceiver(
        ReceiverConfig(
            width=16,
            dtype="float32",
            pool_bytes=1 << 20,
            slot_bytes=1 << 12,
            transports=("loopback",),
        )
    )
    try:
        items = [
            MultimodalDataItem(
                Modality.IMAGE,
                offsets=[[0, 15]],
                encode_handshake={"bootstrap_room": 5, "bootstrap_host": host, "bootstrap_port": 1},
            )
            for host in ("::1", "[::1]")
        ]
        job = receiver.start("v6-twice", MultimodalInputs(items))
        assert job.wait(5) is JobState.FAILED
        assert "duplicate room 5" in job.reasons[1] and "duplicate" not in job.reasons[0]
    finally:
        receiver.close()


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
@pytest.mark.processes
def test_a_worker_on_ipv6_loopback_delivers(tmp_path, no_new_segments):
    from transformers import AutoImageProcessor

    model = build_vision_only("qwen2_5_vl", str(tmp_path / "tower"), out_width=256)
    with LocalCluster(model, log_dir=str(tmp_path)) as cluster:
        worker = cluster.start_encode_worker("worker-v6", transports="shm", host="::1")
        prefill = cluster.start_prefill("prefill", transports="shm")
        cluster.wait_ready()
        assert worker.url.startswith("http://[::1]:")
        address = WorkerAddress.parse(
            f"[::1]:{worker.worker.bootstrap_port}:{worker.worker.intake_port}"
        )
        assert address == worker.worker and address.name == f"[::1]:{worker.worker.bootstrap_port}"

        async def run():
            workers = WorkerSet([address], check_timeout_s=2)
            await workers.refresh()
            assert workers.status() == {address.name: "ready"}
            dispatcher = Dispatcher(workers, AutoImageProcessor.from_pretrained(model))
            try:
                items = await dispatcher.dispatch(
                    "v6", [synthetic_image(112, 84, 7), synthetic_image(84, 84, 8)]
                )
                assert [item.error for item in items] == [None, None]
                assert {item.encode_handshake.endpoint for item in items} == {address.rooms}
                body = prefill_body("v6", items, verify=True)
                # the same endpoint, its host spelled with brackets: one endpoint to the receiver
                body["items"][1]["encode_handshake"]["bootstrap_host"] = "[::1]"
                async with aiohttp.ClientSession() as session:
                    async with session.post(prefill.url + "/v1/prefill", json=body) as response:
                        return await response.json()
            finally:
                await dispatcher.close()
                await workers.close()

        report = asyncio.run(run())
        assert report["state"] == "DONE"
        assert [
            (item["state"], item["transport"], item["verified"]) for item in report["items"]
        ] == [("DONE", "shm", True)] * 2
        codes = cluster.stop()
    assert codes == {"worker-v6": 0, "prefill": 0}
