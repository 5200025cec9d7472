"""One attention call per layer for the Qwen-VL towers (``--vision-attention varlen``).

transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision attention calls its attention function once
per sequence (an image, a video frame or a Qwen2.5-VL window) in a Python loop, unless the
implementation's name says "flash": then it calls it once per layer with the packed batch and its
boundaries (``cu_seqlens``). ``VARLEN`` is registered in transformers' ``AttentionInterface`` under
such a name, so the model classes and checkpoints stay transformers' own:

* on CUDA in bf16 / fp16 (compute capability 8.0 on), PyTorch's
  ``torch.nn.attention.varlen.varlen_attn`` (Flash Attention, inside the CUDA wheel since torch
  2.10): one kernel over every sequence of the batch;
* elsewhere (the CPU, float32, an older GPU or torch): one ``scaled_dot_product_attention`` call
  over the sequences padded to the longest, a key-padding mask keeping each in its own (no mask
  when they are all as long).

Numerics: both compute what the reference computes, in another order of float operations: rows
differ from the reference path's by rounding (tests hold them to cosine >= 0.9999 on the CPU), and
an item in a batch is not bit-equal to the item alone (the padding, or Flash's tiling, follows the
batch). The reference path (``reference``) keeps the worker's bit-exact batch invariance on the
CPU; ``auto`` takes ``varlen`` only where the Flash kernel runs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from epdserve.process_settings import VisionAttention

# "flash" in the name is what makes transformers pass cu_seqlens (is_flash_attention_requested).
VARLEN = "epd_flash_varlen"
REFERENCE = "sdpa"  # transformers' own: one SDPA call per sequence
AttentionPath = Literal["varlen", "reference"]  # what a VisionAttention choice resolves to
FLASH_DTYPES = (torch.bfloat16, torch.float16)


def resolve(choice: VisionAttention, device: str, dtype: torch.dtype) -> AttentionPath:
    """The path ``choice`` means for a tower in ``dtype`` on ``device``: ``auto`` is ``varlen``
    where PyTorch's Flash varlen kernel runs (CUDA, compute capability 8.0 or later, bf16 or
    fp16), else ``reference``."""
    if choice == "auto":
        return "varlen" if flash_available(torch.device(device), dtype) else "reference"
    return choice


# Where the Flash kernel runs, as (device type, index, dtype): decided by ``use`` for each tower,
# outside any compiled region, and only read by ``varlen_attention`` (a set lookup Dynamo folds
# into a guard, where asking the device would break its graph).
_FLASH_RUNS: set[tuple[str, int | None, torch.dtype]] = set()


def use(model: torch.nn.Module, path: AttentionPath) -> None:
    """Set ``model``'s vision attention to ``path``. The config's setter, not
    ``set_attn_implementation``: that one would look for a Flash Attention package or hub kernel
    for any name containing "flash"."""
    if path == "varlen":
        AttentionInterface.register(VARLEN, varlen_attention)  # a dict entry: idempotent
        weight = next(model.parameters())
        if flash_available(weight.device, weight.dtype):
            _FLASH_RUNS.add((weight.device.type, weight.device.index, weight.dtype))
    model.config._attn_implementation = VARLEN if path == "varlen" else REFERENCE


def kernel(device: str, dtype: torch.dtype, path: AttentionPath) -> str:
    """What runs each layer's attention, in words (start-up log, benchmark reports)."""
    if path == "reference":
        return "sdpa per sequence (transformers' reference loop)"
    if flash_available(torch.device(device), dtype):
        return "flash varlen (torch.nn.attention.varlen), one call per layer"
    return "sdpa over padded sequences, one call per layer"


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` / ``key`` / ``value`` are
    ``[1, heads, tokens, head_dim]`` (the packed batch), ``cu_seq_lens_q`` its sequence
    boundaries (keys have the same); the answer is ``[1, tokens, heads, head_dim]``."""
    if cu_seq_lens_q is None:
        raise ValueError(f"{VARLEN} needs cu_seqlens: call it through the Qwen-VL vision towers")
    if max_length_q is None:  # a Python int when the tower precomputed it (no device sync)
        max_length_q = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    if (query.device.type, query.device.index, query.dtype) in _FLASH_RUNS:
        out = _flash(query, key, value, cu_seq_lens_q, int(max_length_q), scaling)
    else:
        out = _padded_sdpa(query, key, value, cu_seq_lens_q, int(max_length_q), scaling)
    return out.unsqueeze(0), None


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether PyTorch's Flash varlen kernel runs for ``dtype`` on ``device``."""
    return (
        device.type == "cuda"
        and dtype in FLASH_DTYPES
        and _varlen_attn() is not None
        and _capability(device.index) >= (8, 0)  # PyTorch's Flash kernels: Ampere on
    )


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _varlen_attn() -> tuple[Callable, bool] | None:
    """PyTorch's varlen_attn and whether it takes ``scale`` (2.11 on; 2.10 has only the
    default), or None before 2.10; kept in ``_VARLEN_ATTN`` for ``_flash`` (a global read, which
    Dynamo traces, where ``inspect`` would break its graph)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    found = varlen_attn, "scale" in inspect.signature(varlen_attn).parameters
    _VARLEN_ATTN[:] = [found]
    return found


_VARLEN_ATTN: list[tuple[Callable, bool]] = []  # _varlen_attn's answer, once found


def _flash(query, key, value, cu_seqlens, max_len, scaling):
    varlen_attn, takes_scale = _VARLEN_ATTN[0]
    # [1, H, N, D] -> [N, H, D]: the layout varlen_attn takes (its last dimension contiguous)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    cu = cu_seqlens.to(torch.int32)
    extra = {}
    if scaling is not None:
        if takes_scale:
            extra["scale"] = scaling
        elif abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
            raise ValueError(f"this torch's varlen_attn has no scale argument (asked {scaling})")
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)


def _padded_sdpa(query, key, value, cu_seqlens, max_len, scaling):
    """Every sequence padded to the longest, in one SDPA call; index arithmetic only (no
    boolean-mask indexing, which would wait for a GPU)."""
    tokens, device = query.shape[2], query.device
    cu = cu_seqlens.to(torch.int64)
    sequences = cu.numel() - 1
    positions = torch.arange(max_len, device=device)
    index = (cu[:-1, None] + positions).clamp_(max=tokens - 1)  # padding reads a real token

    def pack(t: torch.Tensor) -> torch.Tensor:  # [1, H, N, D] -> [B, H, L, D]
        return t[0][:, index].transpose(0, 1)

    every_one_full = sequences * max_len == tokens
    valid = positions < (cu[1:] - cu[:-1])[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        pack(query),
        pack(key),
        pack(value),
        attn_mask=None if every_one_full else valid[:, None, None, :],
        scale=scaling,
    )
    heads, dim = out.shape[1], out.shape[3]
    out = out.transpose(1, 2).reshape(sequences * max_len, heads, dim)
    if every_one_full:
        return out
    token = torch.arange(tokens, device=device)
    sequence = torch.searchsorted(cu[1:], token, right=True)  # the sequence each token is in
    return out[sequence * max_len + token - cu[sequence]]
