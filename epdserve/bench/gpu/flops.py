"""A tower forward's matrix-product FLOPs for a batch of grids, from its config alone, and the
cards' peak rates: what makes "achieved TFLOP/s" and "% of peak" of a measured rate.

Counted as ``torch.utils.flop_counter`` counts them (``tests/test_gpu_check.py`` holds the two
equal on the small towers): 2 per multiply-add of the patch embedding, of every linear layer of
every block (all the batch's patches) and of the mergers (a row per ``merge²`` patches), and
``4 * width * sum(length²)`` for the attention of each block over its sequences (every frame, or
Qwen2.5-VL's windows in its windowed blocks). Element-wise work (norms, rotary, activations) is
not counted: it costs memory traffic, not FLOPs.
"""

from __future__ import annotations

import torch

from epdserve.vision.grid_inputs import GridInputs

# Dense bf16 tensor-core peak (TFLOP/s) by the name CUDA gives the card, most specific first
# (NVIDIA's datasheets, without sparsity).
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4),
    ("H800", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
)


def peak_tflops(gpu_name: str | None) -> float | None:
    """The card's dense bf16 peak, or None for a card not in the table (or no card)."""
    if not gpu_name:
        return None
    return next((peak for name, peak in PEAK_BF16_TFLOPS if name in gpu_name), None)


def forward_flops(model: torch.nn.Module, grid_thw: torch.Tensor, windows: bool) -> int:
    """Matrix-product FLOPs of ``model``'s forward (a Qwen-VL tower) over a batch of
    ``grid_thw``; ``windows``: the family attends within windows (Qwen2.5-VL) outside its
    full-attention blocks."""
    inputs = GridInputs(model, windows=windows)(grid_thw.cpu())
    patches = int(inputs["cu_seqlens"][-1])
    merged = patches // model.spatial_merge_size**2
    embed = model.patch_embed.proj.weight
    width = embed.shape[0]
    flops = 2 * patches * embed[0].numel() * width

    def squares(cu: torch.Tensor) -> int:
        lengths = (cu[1:] - cu[:-1]).to(torch.int64)
        return int((lengths * lengths).sum())

    full = squares(inputs["cu_seqlens"])
    windowed = squares(inputs["cu_window_seqlens"]) if windows else full
    full_blocks = set(getattr(model, "fullatt_block_indexes", None) or ()) if windows else None
    for index, block in enumerate(model.blocks):
        flops += 2 * patches * _linear_macs(block)
        sequences = full if full_blocks is None or index in full_blocks else windowed
        flops += 4 * width * sequences
    mergers = [model.merger, *getattr(model, "deepstack_merger_list", ())]
    flops += sum(2 * merged * _linear_macs(merger) for merger in mergers)
    return flops


def _linear_macs(module: torch.nn.Module) -> int:
    """Multiply-adds per input row of the module's linear layers."""
    return sum(
        layer.in_features * layer.out_features
        for layer in module.modules()
        if isinstance(layer, torch.nn.Linear)
    )
