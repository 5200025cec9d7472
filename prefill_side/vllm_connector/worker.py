"""The connector's worker half (the model runner's process): map the receive pool's segment, check
each load against what vLLM expects, copy its rows into vLLM's encoder cache, report the loads
done."""

from __future__ import annotations

import torch

from data_plane.dtypes import dtype_from_wire, dtype_to_wire
from data_plane.shm import ShmSegment
from prefill_side.vllm_connector.loads import ConnectorContractError, Load, LoadedMetadata


class WorkerSide:
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
