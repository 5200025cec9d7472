"""What a Qwen-VL tower's forward derives from a batch's patch grids (``grid_thw``), computed on
the CPU and passed to the forward, which then takes them as they are (on a GPU, its
``.tolist()`` and ``.item()`` calls on a device ``grid_thw`` would each wait for the GPU to drain).

Each item's part depends on its ``(t, h, w)`` alone: it is computed once per grid by transformers'
own helpers (``transformers.vision_utils``) and kept (``GridInputs``, bounded in bytes), and a
batch's inputs are assembled from its items' parts with a few array operations (as vLLM caches
them per grid). The assembled inputs equal what the helpers compute over the whole batch
(``tests/test_grid_inputs.py``):

* ``position_ids`` (the rotary positions), ``cu_seqlens`` (each frame a sequence) and
  ``max_seqlen``, for every family;
* Qwen2.5-VL's attention windows: ``window_index`` (each item's merged tokens in window order,
  offset by the merged tokens before it), ``cu_window_seqlens`` (non-empty windows only) and
  ``max_window_seqlen``;
* Qwen3-VL's learned position table resampled to each grid: ``interp_indices`` and
  ``interp_weights``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from transformers.vision_utils import (
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)

# Parts kept, in bytes: a grid's part is ~20 bytes per patch (~70 with a position table), so a
# 448x448 image's is ~20 KiB and the largest image's (65,536 patches) ~4.5 MiB.
MAX_CACHE_BYTES = 64 << 20

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class _Part:
    """One ``(t, h, w)`` grid's share of a batch's inputs, as numpy arrays."""

    frames: int
    frame_patches: int  # h * w: one sequence of the full-attention layers per frame
    positions: np.ndarray  # [t*h*w, 2] int64
    window_index: np.ndarray | None = None  # [t*h*w / merge²] int64, within the item
    window_lengths: np.ndarray | None = None  # patches of each non-empty window, int64
    interp_indices: np.ndarray | None = None  # [t*h*w, taps] int64
    interp_weights: np.ndarray | None = None  # [t*h*w, taps] float32

    @property
    def nbytes(self) -> int:
        arrays = (
            self.positions,
            self.window_index,
            self.window_lengths,
            self.interp_indices,
            self.interp_weights,
        )
        return sum(array.nbytes for array in arrays if array is not None)


class GridInputs:
    """A tower's grid-derived forward inputs for a batch of items, assembled from per-grid parts
    kept in an LRU of at most ``max_bytes``. Thread-safe (the tower thread and the idle probe
    call it)."""

    def __init__(
        self,
        tower: torch.nn.Module,
        windows: bool = False,
        position_table: bool = False,
        max_bytes: int = MAX_CACHE_BYTES,
    ):
        self.merge = int(tower.spatial_merge_size)
        self.windows = windows
        self.position_table = position_table
        if windows:
            self.window_size = int(tower.window_size)
            self.patch_size = int(tower.patch_size)
        if position_table:
            self.table_side = int(tower.num_grid_per_side)
            self.interpolation = (tower.interpolation_mode, tower.interpolation_align_corners)
        self.max_bytes = max_bytes
        self._parts: OrderedDict[Grid, _Part] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __call__(self, grid_thw: torch.Tensor) -> dict:
        """The forward's keyword arguments for a batch of ``grid_thw`` (a CPU ``[n, 3]``
        tensor): CPU tensors and Python ints."""
        parts = [self.part(grid) for grid in map(tuple, grid_thw.tolist())]
        frame_patches = np.array([part.frame_patches for part in parts], dtype=np.int64)
        sequences = np.repeat(frame_patches, [part.frames for part in parts])
        out = {
            "position_ids": torch.from_numpy(np.concatenate([part.positions for part in parts])),
            "cu_seqlens": _cumulative(sequences),
            "max_seqlen": int(frame_patches.max()),
        }
        if self.windows:
            merged = np.array([part.window_index.size for part in parts], dtype=np.int64)
            before = np.cumsum(merged) - merged  # merged tokens of the items before each
            index = np.concatenate([part.window_index for part in parts])
            index += np.repeat(before, merged)
            lengths = np.concatenate([part.window_lengths for part in parts])
            out |= {
                "window_index": torch.from_numpy(index),
                "cu_window_seqlens": _cumulative(lengths),
                "max_window_seqlen": int(lengths.max()),
            }
        if self.position_table:
            out |= {
                "interp_indices": torch.from_numpy(
                    np.concatenate([part.interp_indices for part in parts])
                ),
                "interp_weights": torch.from_numpy(
                    np.concatenate([part.interp_weights for part in parts])
                ),
            }
        return out

    def part(self, grid: Grid) -> _Part:
        """The part of one ``(t, h, w)`` grid, kept or computed."""
        with self._lock:
            part = self._parts.get(grid)
            if part is not None:
                self._parts.move_to_end(grid)
                return part
        part = self._compute(grid)
        with self._lock:
            if grid not in self._parts:
                self._parts[grid] = part
                self._bytes += part.nbytes
                while self._bytes > self.max_bytes and len(self._parts) > 1:
                    _, dropped = self._parts.popitem(last=False)
                    self._bytes -= dropped.nbytes
        return part

    def _compute(self, grid: Grid) -> _Part:
        t, h, w = (int(v) for v in grid)
        if t < 1 or h < self.merge or w < self.merge or h % self.merge or w % self.merge:
            raise ValueError(f"grid {grid} is not a patch grid of merge size {self.merge}")
        one = torch.tensor([[t, h, w]])
        fields = {
            "frames": t,
            "frame_patches": h * w,
            "positions": get_vision_position_ids(one, self.merge).numpy(),
        }
        if self.windows:
            index, cu_windows = get_vision_window_index(
                one, self.merge, self.window_size, self.patch_size
            )
            fields["window_index"] = index.numpy()
            fields["window_lengths"] = np.diff(cu_windows.numpy().astype(np.int64))
        if self.position_table:
            mode, align_corners = self.interpolation
            indices, weights = get_vision_interpolation_indices_and_weights(
                one,
                num_grid_per_side=self.table_side,
                mode=mode,
                align_corners=align_corners,
                spatial_merge_size=self.merge,
            )
            fields["interp_indices"] = indices.numpy()
            fields["interp_weights"] = weights.numpy()
        return _Part(**fields)


def _cumulative(lengths: np.ndarray) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32 (transformers' ``cu_seqlens``)."""
    out = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return torch.from_numpy(out)
