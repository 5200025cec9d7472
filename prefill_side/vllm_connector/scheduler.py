"""The connector's scheduler half (the EngineCore process): one zero-copy ``PrefillReceiver``; a
request with rooms (its items read by ``request_items``) is deferred until its items settle, what
arrived is offered to vLLM and turned into loads for the worker half, slots are held while a load
or the request needs them."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from epdserve.data_plane.shm import namespace_id
from epdserve.multimodal.items import MultimodalInputs
from epdserve.wire.ec_params import DeliveryReport, Identifier, ItemDelivery
from epdserve.wire.fingerprint import EngineDescription
from epdserve.wire.states import ItemState, JobState
from prefill_side.vllm_connector.loads import Load
from prefill_side.vllm_connector.request_items import (
    RequestRefused,
    RoomsKey,
    carries_media,
    request_items,
)
from prefill_side.vllm_connector.settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from prefill_side.job import ReceiveJob

log = logging.getLogger(__name__)


def kv_connector_transfer_engine():
    """(TransferEngine, its host) of vLLM's MooncakeConnector in this process: the KV connector's
    worker side, which runs here when vLLM runs its model in the engine core process (one GPU,
    the default `uni` executor)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        raise ValueError(
            "EPDConnector: mooncake_engine='kv_connector', but no KV connector runs in this "
            "process (kv_transfer_config must name MooncakeConnector, and the model must run in "
            "vLLM's engine core process: one GPU, not the multiprocess executor)"
        )
    group = get_kv_transfer_group()
    worker = getattr(group, "connector_worker", None)
    engine = getattr(worker, "engine", None)
    if engine is None or not hasattr(engine, "transfer_submit_write"):
        raise ValueError(
            "EPDConnector: mooncake_engine='kv_connector' needs vLLM's MooncakeConnector as the KV "
            f"connector; this process runs {type(group).__name__}"
        )
    return engine, worker.hostname


@dataclass
class Received:
    """One receive job, from the first sight of a request with its rooms to the end of every
    request it serves: requests that name the same rooms (vLLM's ``n`` > 1 children carry their
    parent's) share it, so each room is registered once and its rows delivered once."""

    rooms: RoomsKey
    job: ReceiveJob
    slots: dict[Identifier, int]  # identifier -> its item's index in the job
    holders: set[str]  # the requests it serves that vLLM has not finished
    arrived: dict[Identifier, torch.Tensor] = field(
        default_factory=dict
    )  # rows in the pool, once settled
    settled: bool = False
    pins: int = 0  # loads naming this job's slots not yet reported copied


class SchedulerSide:
    """The scheduler half's state. Every method runs on vLLM's scheduler thread; the receive jobs
    progress on the receiver's own loop thread and are only polled here."""

    def __init__(
        self,
        settings: ConnectorSettings,
        width: int,
        dtype: str,
        engine: EngineDescription,
        loading_ranks: int = 1,
    ):
        """``engine``: the model this engine runs (rooms registered with its fingerprint, rows of
        another refused; served on ``http_port``). ``loading_ranks``: the model-runner ranks that
        load each item's rows (the first pipeline stage's tensor-parallel ranks); a slot is held
        until each of them reported its load done."""
        from epdserve.data_plane.mooncake import MooncakeConfig
        from epdserve.data_plane.transport import build_transports
        from epdserve.process_settings.secrets import handshake_token
        from prefill_side import PrefillReceiver, ReceiverConfig

        config = ReceiverConfig(
            **settings.receiver_settings(),
            width=width,
            dtype=dtype,
            handshake_token=handshake_token(settings.handshake_token_file),
            zero_copy=True,
            model_fingerprint=engine.fingerprint.compact,
        )
        if settings.mooncake_engine == "kv_connector" and "mooncake" in settings.transports:
            from epdserve.data_plane.mooncake import MooncakeTransport

            transfer_engine, host = kv_connector_transfer_engine()
            configs = {"mooncake": MooncakeConfig(hostname=host)}
            # build_transports finds it
            MooncakeTransport.adopt(transfer_engine, configs["mooncake"])
        else:
            configs = settings.transport_configs(settings.mooncake_host)
        self.receiver = PrefillReceiver(
            config, build_transports(config.transports, configs, optional=True)
        )
        if self.receiver.pool.region.shm is None:
            self.receiver.close()
            raise ValueError(
                "EPDConnector needs its receive pool in /dev/shm (the model runner maps it): "
                f"no room there for {settings.pool_bytes} bytes"
            )
        self.segment = self.receiver.pool.region.shm.name
        self.namespace = namespace_id()
        self.loading_ranks = loading_ranks
        self.engine = engine
        self.http = None
        if settings.http_port is not None:
            from epdserve.metrics import exposition_registry
            from prefill_side.vllm_connector.http import ConnectorHttp

            try:
                self.http = ConnectorHttp(
                    settings.http_host,
                    settings.http_port,
                    exposition_registry(self.receiver.registry, engine.served_model_name),
                    engine,
                )
            except OSError as exc:
                self.receiver.close()
                raise ValueError(
                    f"EPDConnector: cannot serve on {settings.http_host} port "
                    f"{settings.http_port} (http_port): {exc}"
                ) from None
        self.width, self.dtype = width, dtype
        self.requests: dict[str, Received] = {}  # request id -> the receive it takes rows from
        self.by_rooms: dict[RoomsKey, Received] = {}  # a receive by the rooms it registered
        self.judged: set[str] = set()  # requests whose settled receive was judged (fallback)
        self.unavailable: dict[str, str] = {}  # request id -> why it cannot get its embeddings
        # the request the scheduler is placing now: ensure_cache_available(request) runs right
        # before has_cache_item for that request's items (vllm/v1/core/sched/scheduler.py)
        self.current: Request | None = None
        self.promised: dict[tuple[str, Identifier], Received] = {}  # has_cache_item said True
        self.pending: list[Load] = []  # for the next build_connector_meta
        # load id -> the job whose slot it reads, and the ranks yet to report it loaded
        self.in_flight: dict[int, tuple[Received, int]] = {}
        self._ids = itertools.count(1)

    def close(self) -> None:
        for received in self.by_rooms.values():
            received.job.cancel("the engine is shutting down")
            received.job.release()
        self.requests.clear()
        self.by_rooms.clear()
        if self.http is not None:
            self.http.close()
        self.receiver.close()

    def ensure(self, request: Request) -> bool:
        self.current = request
        if request.request_id in self.unavailable:
            return False  # failed; vLLM finishes it after this step (take_unavailable)
        received = self.requests.get(request.request_id)
        if received is None:
            if request.ec_transfer_params is None:
                return True  # not ours: vLLM's own tower (or its own cache)
            received = self._start(request)
            if received is None:
                return False
        if request.request_id not in self.judged:
            if not received.settled:
                if received.job.poll() is JobState.PENDING:
                    return False
                self._settle(received)
            self._judge(request, received)
        return request.request_id not in self.unavailable

    def _start(self, request: Request) -> Received | None:
        try:
            wanted = request_items(request)
        except RequestRefused as exc:
            self._fail(request.request_id, str(exc))
            return None
        received = self.by_rooms.get(wanted.rooms)
        if received is None:
            received = Received(
                wanted.rooms,
                self.receiver.start(request.request_id, MultimodalInputs(wanted.items)),
                wanted.slots,
                set(),
            )
            self.by_rooms[wanted.rooms] = received
        received.holders.add(request.request_id)
        self.requests[request.request_id] = received
        return received

    def _settle(self, received: Received) -> None:
        """The job ended: what arrived is offered from now on."""
        received.settled = True
        for key, index in received.slots.items():
            if received.job.outcomes[index].state == ItemState.DONE:
                received.arrived[key] = received.job.inputs.mm_items[index].encoded

    def _judge(self, request: Request, received: Received) -> None:
        """For one request of a settled receive: fall back, or fail it, for what did not arrive."""
        self.judged.add(request.request_id)
        failed = []
        for key, index in received.slots.items():
            outcome = received.job.outcomes[index]
            if outcome.state == ItemState.DONE:
                continue
            feature = next(f for f in request.mm_features if f.identifier == key)
            if carries_media(feature):
                log.warning(
                    "request %s: item %s falls back to vLLM's own encoder: %s",
                    request.request_id,
                    key,
                    outcome.reason,
                )
            else:
                failed.append(f"item {key}: {outcome.reason}")
        if failed:
            self._fail(
                request.request_id,
                "; ".join(failed) + " (and the request carries no image to encode locally)",
            )

    def _fail(self, request_id: str, reason: str) -> None:
        log.warning("request %s fails: %s", request_id, reason)
        self.unavailable[request_id] = reason

    def has(self, identifier: Identifier) -> bool:
        request = self.current
        if request is None:
            return False
        key = (request.request_id, identifier)
        self.promised.pop(key, None)
        expected = next(
            (
                request.get_num_encoder_embeds(i)
                for i, f in enumerate(request.mm_features)
                if f.identifier == identifier
            ),
            None,
        )
        if expected is None:
            log.warning(
                "has_cache_item(%s) while placing request %s, which has no such item: left to vLLM",
                identifier,
                request.request_id,
            )
            return False
        own = self.requests.get(request.request_id)
        sources = [own] if own is not None else []
        sources += [r for r in self.requests.values() if r is not own]
        for source in sources:
            rows = source.arrived.get(identifier)
            if rows is None:
                continue
            if rows.shape[0] != expected:  # never hand vLLM a wrong count: its engine would die
                log.warning(
                    "request %s: %s arrived with %d rows but vLLM placed %d: left to vLLM",
                    request.request_id,
                    identifier,
                    rows.shape[0],
                    expected,
                )
                continue
            self.promised[key] = source
            return True
        return False

    def alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        source = self.promised.pop((request.request_id, identifier), None)
        if source is None:
            return  # vLLM encodes this one itself
        rows = source.arrived[identifier]
        load = Load(
            next(self._ids),
            identifier,
            self.segment,
            self.namespace,
            rows.data_ptr() - self.receiver.pool.region.address,
            rows.shape[0],
            rows.shape[1],
            self.dtype,
            request.get_num_encoder_embeds(index),
        )
        source.pins += 1
        self.in_flight[load.load_id] = (source, self.loading_ranks)
        self.pending.append(load)

    def take_loads(self) -> list[Load]:
        loads, self.pending = self.pending, []
        self.current = None
        return loads

    def loaded(self, load_ids: list[int]) -> None:
        for load_id in load_ids:
            if load_id not in self.in_flight:  # more reports than ranks counted: a bug, not fatal
                log.warning("load %d reported done more often than it has loading ranks", load_id)
                continue
            source, left = self.in_flight.pop(load_id)
            if left > 1:
                self.in_flight[load_id] = (source, left - 1)
                continue
            source.pins -= 1
            self._release_if_done(source)

    def take_unavailable(self) -> set[str]:
        failed = set(self.unavailable)
        self.unavailable.clear()
        return failed

    def finished(self, request_id: str) -> DeliveryReport | None:
        """Release what the request holds; how its items were delivered (None: it had no rooms)."""
        received = self.requests.pop(request_id, None)
        self.unavailable.pop(request_id, None)
        self.judged.discard(request_id)
        if received is None:
            return None
        received.holders.discard(request_id)
        if not received.holders and not received.settled:
            received.job.cancel("the request finished before its embeddings arrived")
        report = DeliveryReport(
            items={
                key: ItemDelivery(
                    state=outcome.state,
                    transport=outcome.transport,
                    reason=outcome.reason,
                    receive_s=outcome.seconds,
                    encoder=outcome.encoder,
                )
                for key, outcome in (
                    (key, received.job.outcomes[index]) for key, index in received.slots.items()
                )
            }
        )
        self._release_if_done(received)
        return report

    def _release_if_done(self, received: Received) -> None:
        if not received.holders and received.pins == 0:
            if self.by_rooms.get(received.rooms) is received:
                del self.by_rooms[received.rooms]
            # the slots go back to the pool (late arrivals too, once they land)
            received.job.release()
