"""The contract between a reserved slot and the bytes committed into it.

The receiver reserves an ``EmbeddingLayout`` (rows x width x dtype). The sender checks its rows
against that layout before writing (a one-sided write cannot be truncated safely) and then
commits: the slot generation it wrote, the layout it wrote, and a checksum. The receiver publishes
the slot's bytes only if the generation is the lease's current one, the layout matches and the
checksum matches; a commit without a checksum is refused unless the receiver opted out of
requiring one (``require_checksum=False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from epdserve.data_plane.dtypes import WIRE_DTYPES, dtype_from_wire, dtype_to_wire
from epdserve.data_plane.pool import Lease, SlotPool
from epdserve.wire.json_fields import json_int
from epdserve.wire.offers import MAX_ROWS, MAX_WIDTH


class ContractError(ValueError):
    """Rows, width, dtype, generation or checksum disagree with the reservation."""


@dataclass(frozen=True)
class EmbeddingLayout:
    rows: int
    width: int
    dtype: str  # wire name, see data_plane.dtypes

    def __post_init__(self) -> None:
        if not (0 < self.rows <= MAX_ROWS and 0 < self.width <= MAX_WIDTH):
            raise ContractError(
                f"rows {self.rows} and width {self.width} must be in (0, {MAX_ROWS}] x (0, "
                f"{MAX_WIDTH}]"
            )
        dtype_from_wire(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_wire(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * self.torch_dtype.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> EmbeddingLayout:
        if tensor.dim() != 2:
            raise ContractError(
                f"embeddings must be 2-D [rows, width], got shape {tuple(tensor.shape)}"
            )
        return cls(int(tensor.shape[0]), int(tensor.shape[1]), dtype_to_wire(tensor.dtype))


def checksum(tensor: torch.Tensor) -> int:
    """xxh3-64 of a tensor's bytes (it costs about as much CPU as a copy, so it is optional)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return checksum_bytes(flat.numpy())


def checksum_bytes(data) -> int:
    """``checksum`` of a buffer's bytes (a flat numpy array, ``bytes``)."""
    return xxhash.xxh3_64_intdigest(data)


class Commit(BaseModel):
    """What a sender says after its write completed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    generation: json_int(ge=0, lt=1 << 63)
    rows: json_int(gt=0, le=MAX_ROWS)
    width: json_int(gt=0, le=MAX_WIDTH)
    dtype: str = Field(pattern="^(" + "|".join(WIRE_DTYPES) + ")$")
    checksum: json_int(ge=0, lt=1 << 64) | None = None

    @property
    def layout(self) -> EmbeddingLayout:
        return EmbeddingLayout(self.rows, self.width, self.dtype)


class Committed(Protocol):
    """What a commit says, whichever validated message carries it: a ``Commit``, or a room's
    commit body (``wire.rooms.CommitBody``), read as it is."""

    @property
    def generation(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def checksum(self) -> int | None: ...


def make_commit(rows: torch.Tensor, generation: int, with_checksum: bool = True) -> Commit:
    layout = EmbeddingLayout.of(rows)
    return Commit(
        generation=generation,
        rows=layout.rows,
        width=layout.width,
        dtype=layout.dtype,
        checksum=checksum(rows) if with_checksum else None,
    )


def accept_commit(
    pool: SlotPool,
    lease: Lease,
    reserved: EmbeddingLayout,
    commit: Committed,
    verify_checksum: bool = True,
    require_checksum: bool = True,
) -> torch.Tensor:
    """Check a commit against the live lease and return the slot as a ``[rows, width]`` view
    (with ``verify_checksum=False`` the caller checks the bytes it publishes: ``verify_rows``)."""
    if commit.generation != lease.generation or not pool.is_current(lease):
        raise ContractError(
            f"commit for generation {commit.generation} but the slot holds {lease.generation}"
            + ("" if pool.is_current(lease) else " (lease no longer live)")
        )
    if (commit.rows, commit.width, commit.dtype) != (reserved.rows, reserved.width, reserved.dtype):
        raise ContractError(
            f"committed [{commit.rows}, {commit.width}] {commit.dtype} but reserved "
            f"[{reserved.rows}, {reserved.width}] {reserved.dtype}"
        )
    if reserved.nbytes != lease.nbytes:
        raise ContractError(
            f"reserved layout needs {reserved.nbytes} bytes but the lease holds {lease.nbytes}"
        )
    rows = pool.view(lease).view(reserved.torch_dtype).view(reserved.rows, reserved.width)
    if verify_checksum:
        verify_rows(rows, commit, require_checksum)
    return rows


def verify_rows(rows: torch.Tensor, commit: Committed, required: bool = True) -> None:
    """Raise unless ``rows`` hash to the commit's checksum. A commit without a checksum passes only
    when ``required`` is False (then nothing but its generation and layout vouch for the bytes)."""
    if commit.checksum is None:
        if required:
            raise ContractError(
                "the commit carries no checksum and this receiver requires one "
                "(the sender runs without checksums; see require_checksum)"
            )
        return
    if checksum(rows) != commit.checksum:
        raise ContractError("checksum mismatch: the slot's bytes are not what the sender committed")
