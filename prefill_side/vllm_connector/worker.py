"""The connector's worker half (one per model-runner rank that runs the vision input): map the
receive pool's segment, check each load against what vLLM expects, copy its rows into vLLM's
encoder cache, report the loads done.

With tensor parallelism every rank of the first pipeline stage needs every item's rows, and all
of them must hold the same rows, or none: vLLM's forward fails the whole engine on a rank whose
encoder cache misses an item. The ranks of that stage are a ``LoadingGroup``: each reads what it
can from the pool (a rank on another node than the pool, or one that failed to map it, cannot),
the ranks exchange which loads each read (one small collective per step that has loads), and a
load some rank could not read is broadcast to the group from the lowest rank that read it, over
the group's device communicator (NCCL on GPUs). The encode worker writes each item once, into the
one pool of the engine's scheduler; the rows cross the engine's own interconnect only to the
ranks that cannot map that pool. A load no rank could read fails on every rank alike."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from epdserve.data_plane.dtypes import dtype_from_wire, dtype_to_wire
from epdserve.data_plane.shm import ShmError, ShmSegment, namespace_id
from prefill_side.vllm_connector.loads import ConnectorContractError, Load, LoadedMetadata

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)


class PoolUnreadable(RuntimeError):
    """This rank cannot read the load's rows from the pool (another node, or the segment cannot
    be mapped here); a peer that can sends them."""


@dataclass(frozen=True)
class LoadingGroup:
    """The ranks that load the same rows (the first pipeline stage's tensor-parallel ranks): this
    rank's index among them, their global ranks, and their process groups (``cpu_group`` for the
    which-rank-read-what flags, ``device_group`` for the rows)."""

    index: int
    ranks: tuple[int, ...]
    cpu_group: ProcessGroup
    device_group: ProcessGroup

    @classmethod
    def of_vllm(cls) -> LoadingGroup:
        """vLLM's tensor-parallel group of this rank (initialised before connectors are)."""
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return cls(group.rank_in_group, tuple(group.ranks), group.cpu_group, group.device_group)

    @property
    def size(self) -> int:
        return len(self.ranks)


class WorkerSide:
    """The worker half of one rank: map the pool segment, check, copy into vLLM's encoder cache
    (agreeing with the other ranks of its ``LoadingGroup``), report."""

    def __init__(
        self,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        group: LoadingGroup | None = None,
    ):
        self.rows = RowReader(width, dtype, device)
        self.group = group if group is not None and group.size > 1 else None
        self.loaded: list[int] = []

    def load(self, loads: list[Load], encoder_cache: dict[str, torch.Tensor]) -> None:
        wanted = [load for load in loads if load.identifier not in encoder_cache]
        read: dict[int, torch.Tensor] = {}
        unreadable: dict[int, str] = {}
        for load in wanted:
            try:
                read[load.load_id] = self.rows.read(load)
            except PoolUnreadable as exc:
                unreadable[load.load_id] = str(exc)
        if self.group is not None:
            read = share_rows(self.group, wanted, read, self.rows)
        for load in wanted:
            rows = read.get(load.load_id)
            if rows is None:
                raise ConnectorContractError(
                    f"{load.identifier}: no rank of this engine could read its rows from the "
                    f"pool: {unreadable.get(load.load_id)} (the ranks that run the vision input "
                    "must include one on the node of the engine's scheduler)"
                )
            encoder_cache[load.identifier] = rows
        self.loaded.extend(load.load_id for load in loads)

    def take_loaded(self) -> LoadedMetadata | None:
        if not self.loaded:
            return None
        loaded, self.loaded = self.loaded, []
        return LoadedMetadata(loaded)

    def close(self) -> None:
        self.rows.close()


def model_device() -> torch.device:
    """The device vLLM runs this rank's model on."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device(current_platform.device_type, current_platform.current_device())
    return torch.device(current_platform.device_type)


class RowReader:
    """A load's rows from the pool into a tensor of their own on the model's device."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device):
        self.width, self.dtype, self.device = width, dtype, device
        self.segments: dict[str, ShmSegment] = {}

    def check(self, load: Load) -> None:
        """The load's rows are what vLLM expects (``ConnectorContractError`` otherwise: the same
        answer on every rank, made before anything is read)."""
        if load.rows != load.expected_rows:
            raise ConnectorContractError(
                f"{load.identifier}: {load.rows} rows received, vLLM placed {load.expected_rows}"
            )
        if (load.width, dtype_from_wire(load.dtype)) != (self.width, self.dtype):
            raise ConnectorContractError(
                f"{load.identifier}: rows of [*, {load.width}] {load.dtype}, the model "
                f"takes [*, {self.width}] {dtype_to_wire(self.dtype)}"
            )

    def read(self, load: Load) -> torch.Tensor:
        """The checked load's rows (``PoolUnreadable`` where this rank cannot map the pool)."""
        self.check(load)
        if load.namespace != namespace_id():
            raise PoolUnreadable(f"the pool {load.segment} is in another /dev/shm than this rank's")
        segment = self.segments.get(load.segment)
        if segment is None:
            try:
                segment = self.segments[load.segment] = ShmSegment.attach(load.segment)
            except (ShmError, ValueError, OSError) as exc:
                raise PoolUnreadable(f"cannot map the pool {load.segment}: {exc}") from None
        if load.offset < 0 or load.offset + load.nbytes > segment.size:
            # a rank-local finding (only ranks that mapped the pool see it): unreadable here, so
            # that every rank still meets in the exchange (share_rows) and fails the load alike
            raise PoolUnreadable(
                f"bytes [{load.offset}, {load.offset + load.nbytes}) lie outside the "
                f"{segment.size}-byte pool segment {load.segment}"
            )
        rows = (
            segment.tensor[load.offset : load.offset + load.nbytes]
            .view(self.dtype)
            .view(load.rows, load.width)
        )
        return self.empty(load).copy_(rows)

    def empty(self, load: Load) -> torch.Tensor:
        return torch.empty((load.rows, load.width), dtype=self.dtype, device=self.device)

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close()
        self.segments.clear()


def share_rows(
    group: LoadingGroup, loads: list[Load], read: dict[int, torch.Tensor], rows: RowReader
) -> dict[int, torch.Tensor]:
    """Every rank of ``group`` ends with the same loads read: which rank read which load is
    gathered (every rank calls this with the same ``loads``, in the same order), and a load read
    by some ranks only is broadcast from the lowest of them. Returns the loads read, shared ones
    included; a load no rank read is missing on every rank."""
    import torch.distributed as dist

    if not loads:
        return read
    mine = torch.tensor([load.load_id in read for load in loads], dtype=torch.int32)
    flags = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(flags, mine, group=group.cpu_group)
    by_rank = torch.stack(flags)  # [rank index, load]
    shared = dict(read)
    for column, load in enumerate(loads):
        readers = by_rank[:, column].nonzero().flatten().tolist()
        if not readers or len(readers) == group.size:
            continue
        source = readers[0]
        tensor = read[load.load_id] if group.index == source else rows.empty(load)
        dist.broadcast(tensor, src=group.ranks[source], group=group.device_group)
        if group.index != source:
            log.info("%s: rows received from rank %d of the loading group", load.identifier, source)
        shared[load.load_id] = tensor
    return shared
