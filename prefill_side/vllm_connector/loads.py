"""What the scheduler side hands the worker side, and back: one ``Load`` per item to copy into
vLLM's encoder cache (``LoadMetadata``), the load ids copied (``LoadedMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)

from epdserve.data_plane.dtypes import dtype_from_wire
from epdserve.wire.ec_params import Identifier


class ConnectorContractError(RuntimeError):
    """A load names rows that are not what vLLM expects for the item: never handed to vLLM."""


@dataclass(frozen=True)
class Load:
    """One item's rows for the worker side to copy into ``encoder_cache[identifier]``."""

    load_id: int
    identifier: Identifier
    segment: str  # the receive pool's /dev/shm segment
    namespace: str  # the /dev/shm it lies in (data_plane.shm.namespace_id)
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
    """Worker -> scheduler: the load ids copied into the encoder cache in this step; vLLM
    aggregates every rank's, so a load appears once per rank that loaded it."""

    load_ids: list[int] = field(default_factory=list)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> LoadedMetadata:
        assert isinstance(other, LoadedMetadata)
        return LoadedMetadata(self.load_ids + other.load_ids)
