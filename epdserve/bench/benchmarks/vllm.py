"""`epd-bench vllm`: the same vLLM model, images and request mix through every way of getting an
image's embedding into vLLM's encoder cache, side by side, in interleaved rounds.

Paths (each a real vLLM OpenAI server on this machine, built from `vision.vlm_checkpoints`):

* ``epd-shm`` / ``epd-mooncake``: this project's connector (`EPDConnector`); an encode worker
  process offering only SHM, or only Mooncake (TCP), writes each image's rows into the engine's
  receive pool. The gateway step (hash, room, intake) runs here, then the chat request goes with
  the image's grid alone.
* ``epd-shm-staged``: as ``epd-shm`` (the same worker and server), but the chat request goes once
  the worker holds the image's rows (``dispatcher.staged``, as ``epd-gateway`` sends it: vLLM waits
  for a write, not an encode).
* ``example``: vLLM's `ECExampleConnector`: an encoder-only vLLM producer writes each embedding
  to a shared directory (safetensors), the consumer reads it.
* ``mooncake-ec``: vLLM's `ECMooncakeConnector` (producer pushes into the consumer over Mooncake
  TCP, ``ec_buffer_device: cpu``), the producer and consumer requests sent as its proxy does.
* ``cpu-ec``: vLLM's `ECCPUConnector`.
* ``colocated``: vLLM's own tower on the image (the EPD engine, requests without rooms).
* ``epd-shm-tp2`` / ``colocated-tp2``: ``epd-shm`` and ``colocated`` on an engine of
  tensor-parallel size 2 (one process per rank; ``VLLM_CPU_OMP_THREADS_BIND`` gives each a core),
  against size 1 (not in the default ``--paths``: on a 2-core machine its ranks take both cores).

A path whose servers cannot start or whose first request fails is reported as unavailable with
the reason (the server's last log lines), and the rest run on.

Per request: one image of the configured size, a fresh one each time (distinct content, so no
cache anywhere serves a repeat), ``max_tokens`` 1. TTFT: from the request's start at the gateway
(before hashing / the producer call) to the response. Throughput: requests per second at
``--concurrency`` clients. Delivery per item: from the moment the embedding exists at its
producer to the moment the consumer's model runner has it in vLLM's encoder cache (wall clock,
one machine): for vLLM's connectors from the producer's ``save_caches`` call to the consumer's
``start_load_caches`` having written the entry; for the EPD connector from the end of the encode
worker's tower batch (the dispatcher's intake acknowledgement + the worker's reported queue and
encode time) to the same point. CPU per image: CPU seconds of the consumer server's processes
(API server, engine core) per request, EPD against colocated on the very same server; producers'
CPU separately. Rounds are interleaved (path order reversed every other round); figures are
medians over rounds. Writes JSON (every batch) and a PNG plot.
"""

from __future__ import annotations

import json
import os
import time

from epdserve.bench.benchmarks.results import write_json
from epdserve.bench.benchmarks.vllm_bench import run
from epdserve.bench.benchmarks.vllm_report import _print, plot
from epdserve.testing.vllm_servers import TRACE_ENV

# re-exported: bench.demo, bench.gateway and the tests import these from here
from epdserve.testing.vllm_servers import Server as Server
from epdserve.testing.vllm_servers import _wait_healthy as _wait_healthy
from epdserve.testing.vllm_servers import cpu_seconds as cpu_seconds
from epdserve.testing.vllm_servers import descendants as descendants


def _trace(event: str, identifier: str, **fields) -> None:
    """One event of this process's connector, appended as a JSON line (one write: atomic)."""
    path = os.environ.get(TRACE_ENV)
    if path:
        line = json.dumps(
            {"event": event, "id": identifier, "t": time.time(), "pid": os.getpid(), **fields}
        )
        with open(path, "a") as f:
            f.write(line + "\n")


def _traced_loads(load):
    """``start_load_caches`` that traces each identifier it put into the encoder cache."""

    def start_load_caches(self, encoder_cache, **kwargs):
        before = set(encoder_cache)
        load(self, encoder_cache, **kwargs)
        for identifier in set(encoder_cache) - before:
            _trace("in_cache", identifier)

    return start_load_caches


def _traced_saves(save):
    """``save_caches`` that traces the moment a producer has the embedding (before it stores it)."""

    def save_caches(self, encoder_cache, mm_hash, **kwargs):
        _trace("encoded", mm_hash)
        save(self, encoder_cache, mm_hash, **kwargs)

    return save_caches


# ---- the timed connectors the servers load (ec_connector_module_path: this module) ----------
# Defined lazily: importing vLLM is seconds, and `epd-bench` imports this module for its parser.


def __getattr__(name: str):
    if name == "TimedEPDConnector":
        from prefill_side.vllm_connector import EPDConnector

        class TimedEPDConnector(EPDConnector):
            """Also traces, per item received, the encode worker's split from its commit."""

            start_load_caches = _traced_loads(EPDConnector.start_load_caches)

            def __init__(self, vllm_config, role):
                super().__init__(vllm_config, role)
                self.traced: set[str] = set()  # request ids whose items were traced

            def ensure_cache_available(self, request, num_computed_tokens):
                ready = super().ensure_cache_available(request, num_computed_tokens)
                received = self._scheduler.requests.get(request.request_id)
                if ready and received is not None and request.request_id not in self.traced:
                    self.traced.add(request.request_id)
                    for identifier, index in received.slots.items():
                        outcome = received.job.outcomes[index]
                        if outcome.encoder is not None:
                            _trace("received", identifier, **outcome.encoder.model_dump())
                return ready

        return TimedEPDConnector
    if name == "TimedExampleConnector":
        from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

        return type(
            "TimedExampleConnector",
            (ECExampleConnector,),
            {
                "start_load_caches": _traced_loads(ECExampleConnector.start_load_caches),
                "save_caches": _traced_saves(ECExampleConnector.save_caches),
            },
        )
    if name == "TimedMooncakeConnector":
        from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector import (
            ECMooncakeConnector,
        )

        return type(
            "TimedMooncakeConnector",
            (ECMooncakeConnector,),
            {
                "start_load_caches": _traced_loads(ECMooncakeConnector.start_load_caches),
                "save_caches": _traced_saves(ECMooncakeConnector.save_caches),
            },
        )
    raise AttributeError(name)


def main(args) -> int:
    args.sizes = [int(s) for s in args.sizes.split(",")]
    report = run(args)
    _print(report)
    write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    return 0 if all(goal["lowest"] for goal in report["goal"].values()) else 1
