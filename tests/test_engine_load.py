"""vLLM's engine load as ``--placement cost`` counts it (``gateway.engine_load``): read from a real
aiohttp server on loopback serving canned vLLM ``/metrics`` bodies (engines summed; missing
gauges, garbage, NaN, negative and huge values, an oversized body and an unreachable server fall
back to the gateway's own count), and vLLM's route predicted slower as the load grows."""

import asyncio
import contextlib
import logging

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from epdserve.gateway.engine_load import (
    ENGINE_GAUGES,
    GATEWAY,
    MAX_ENGINE_REQUESTS,
    MAX_METRICS_BYTES,
    VLLM_METRICS,
    EngineLoad,
    EngineLoadUnreadable,
    engine_requests,
)
from epdserve.gateway.metrics import GatewayMetrics
from epdserve.gateway.placement import PlacementCosts, Route
from epdserve.testing.cluster import HOST, free_port
from tests.profiles import examples

# vLLM 0.32's gauges as its /metrics writes them, two data-parallel engines
TWO_ENGINES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 99.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 7.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 7.0
"""


@contextlib.asynccontextmanager
async def vllm_metrics(bodies: dict[str, bytes | int]):
    """A loopback server answering ``/metrics`` with ``bodies[path]`` (bytes, or a status); the
    path served is chosen by the test through ``served["path"]``."""
    served = {"path": "/ok"}

    async def metrics(request: web.Request) -> web.Response:
        body = bodies[served["path"]]
        if isinstance(body, int):
            return web.Response(status=body)
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, HOST, port).start()
    try:
        yield f"http://{HOST}:{port}", served
    finally:
        await runner.cleanup()


def exported(metrics: GatewayMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_the_engines_gauges_are_summed_and_garbage_falls_back_to_the_gateways_count(caplog):
    bodies = {
        "/ok": TWO_ENGINES.encode(),
        "/no-waiting": b'vllm:num_requests_running{engine="0"} 3.0\n',
        "/garbage": b"\x00\xff{{{ not prometheus at all\nvllm:num_requests_running{ 1\n",
        "/nan": TWO_ENGINES.replace('"1",model_name="m"} 1.0', '"1",model_name="m"} NaN').encode(),
        "/negative": TWO_ENGINES.replace("} 4.0", "} -4.0").encode(),
        "/huge-value": TWO_ENGINES.replace("} 4.0", "} 1e300").encode(),
        "/huge-body": TWO_ENGINES.encode() + b"# " + b"x" * MAX_METRICS_BYTES + b"\n",
        "/not-found": 404,
    }

    async def run():
        metrics = GatewayMetrics("m")
        async with vllm_metrics(bodies) as (url, served):
            load = EngineLoad(url, metrics)
            assert load.source == GATEWAY and load.requests == 0  # not read yet
            timeout = aiohttp.ClientTimeout(total=2.0)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                await load.read(session)
                assert (load.requests, load.source) == (10, VLLM_METRICS)
                text = exported(metrics)
                assert 'epd_gateway_engine_load_requests{model_name="m"} 10.0' in text
                assert 'source="vllm_metrics"} 1.0' in text and 'source="gateway"} 0.0' in text
                load.admitted = 12  # the gateway has more for vLLM than vLLM said
                assert load.requests == 12 and load.others() == 11
                load.admitted = 2
                for path in bodies:
                    if path == "/ok":
                        continue
                    served["path"] = path
                    await load.read(session)
                    assert (load.requests, load.source) == (2, GATEWAY), path
                    served["path"] = "/ok"
                    await load.read(session)
                    assert (load.requests, load.source) == (10, VLLM_METRICS), path
                served["path"] = "/nan"
                await load.read(session)
                await load.read(session)  # the same problem again: not logged again
            text = exported(metrics)
            assert 'source="vllm_metrics"} 0.0' in text and 'source="gateway"} 1.0' in text
            assert 'epd_gateway_engine_load_requests{model_name="m"} 2.0' in text
        async with aiohttp.ClientSession() as session:  # the server gone: unreachable
            await load.read(session)
        assert (load.requests, load.source) == (2, GATEWAY)

    with caplog.at_level(logging.WARNING, logger="epdserve.gateway.engine_load"):
        asyncio.run(run())
    warned = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    # once per problem as it changes (the unreachable server included), never twice in a row
    assert sum("NaN" in message or "nan" in message for message in warned) == 2
    assert any("unreachable" in message for message in warned)
    assert all(a != b for a, b in zip(warned, warned[1:]))


def test_vllms_route_is_predicted_slower_as_the_engines_load_grows():
    costs = PlacementCosts()
    costs.observe(Route.VLLM, 1000, 1.0, engine_load=1)  # measured with one other request
    costs.observe(Route.ENCODE_WORKER, 1000, 1.5)
    idle, measured, loaded = (costs.decide(1000, 0, engine_load=n) for n in (0, 1, 5))
    assert (idle.vllm_s, measured.vllm_s, loaded.vllm_s) == (0.5, 1.0, 3.0)
    assert idle.route is measured.route is Route.VLLM and loaded.route is Route.ENCODE_WORKER
    assert loaded.engine_load == 5
    assert loaded.encode_worker_s == idle.encode_worker_s == 1.5  # the workers' route: as measured
    # until measured, vLLM's prior grows with the load as well
    assert PlacementCosts().cost_s(Route.VLLM, 1000, 3) == 4 * PlacementCosts().cost_s(
        Route.VLLM, 1000
    )


def test_the_load_read_from_vllm_moves_the_prediction():
    async def run():
        metrics = GatewayMetrics("m")
        busy = TWO_ENGINES.encode()
        idle = TWO_ENGINES.replace("3.0", "0.0").replace("2.0", "0.0").replace("4.0", "0.0")
        idle = idle.replace('"1",model_name="m"} 1.0', '"1",model_name="m"} 0.0').encode()
        costs = PlacementCosts()
        costs.observe(Route.VLLM, 1000, 0.2)
        costs.observe(Route.ENCODE_WORKER, 1000, 0.5)
        async with vllm_metrics({"/busy": busy, "/idle": idle}) as (url, served):
            load = EngineLoad(url, metrics)
            async with aiohttp.ClientSession() as session:
                predicted = {}
                for path in ("/idle", "/busy"):
                    served["path"] = path
                    await load.read(session)
                    predicted[path] = costs.decide(1000, 0, load.requests)
        assert predicted["/idle"].engine_load == 0 and predicted["/idle"].route is Route.VLLM
        assert predicted["/busy"].engine_load == 10
        assert (
            predicted["/busy"].vllm_s == 0.2 * 11
            and predicted["/busy"].route is Route.ENCODE_WORKER
        )

    asyncio.run(run())


@settings(max_examples=examples(300), deadline=None)
@given(
    tails=st.lists(
        st.text(alphabet='{}=",\\ \n#0123456789.eE+-naNIf:_', max_size=30), min_size=2, max_size=2
    )
)
def test_whatever_vllm_hands_back_is_a_count_or_unreadable(tails):
    text = "\n".join(name + tail for name, tail in zip(ENGINE_GAUGES, tails))
    try:
        counted = engine_requests(text)
    except EngineLoadUnreadable:
        return
    assert 0 <= counted <= MAX_ENGINE_REQUESTS


def test_gauges_over_a_count_of_requests_are_not_trusted():
    many = MAX_ENGINE_REQUESTS // 2 + 1
    text = "".join(f'{name}{{engine="0"}} {many}\n' for name in ENGINE_GAUGES)
    with pytest.raises(EngineLoadUnreadable, match="not a count"):
        engine_requests(text)
