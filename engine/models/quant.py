"""Weight-only quantization for CPU decoding: int8 per output row, int4 in groups of 32.

Decoding reads every weight once per step, so fewer weight bytes is a faster step. torch ships CPU
kernels that take quantized weights and floating-point activations (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`); these functions make their operands and the exact dense weights
they stand for (the reference the tests compare against).

int4 is asymmetric, like GGUF's Q4_1: per group of 32 inputs a scale and a minimum, the weight is
`q * scale + min` for q in 0..15. Quantizing a dequantized Q4_1 tensor this way finds the same grid
(its minimum is the q = 0 value and its maximum the q = 15 one), so a Q4_1 GGUF keeps its own weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_GROUP = 32


@dataclass(slots=True)
class Int8Weight:
    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] float32: w = q * scale


@dataclass(slots=True)
class Int4Weight:
    q: torch.Tensor  # [out, in] int32 values in 0..15
    scale: torch.Tensor  # [out, in / group] float32
    minimum: torch.Tensor  # [out, in / group] float32: w = q * scale + minimum
    group: int = INT4_GROUP


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric int8 with one scale per output row (the layout `_weight_int8pack_mm` takes)."""
    w = weight.detach().float()  # [out, in]
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def dequantize_int8(w: Int8Weight) -> torch.Tensor:
    return w.q.float() * w.scale[:, None]  # [out, in]


def int4_supported(weight_shape: torch.Size | tuple[int, ...], group: int = INT4_GROUP) -> bool:
    out_features, in_features = weight_shape
    # The CPU packing works on pairs of nibbles along the input dimension, whole groups only.
    return in_features % group == 0 and in_features % 2 == 0 and out_features > 0


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> Int4Weight:
    """Asymmetric int4 per group of `group` inputs, on the min / max grid of each group."""
    if not int4_supported(weight.shape, group):
        raise ValueError(f"int4 needs in_features divisible by {group}; got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    w = weight.detach().float().view(out_features, in_features // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, groups]
    scale = (hi - lo) / 15
    # A constant group has no spread: any positive scale represents it exactly with q = 0.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return Int4Weight(q.view(out_features, in_features), scale, lo, group)


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    out_features, in_features = w.q.shape
    q = w.q.view(out_features, in_features // w.group, w.group).float()
    return (q * w.scale[..., None] + w.minimum[..., None]).view(out_features, in_features)


def int4_kernel_operands(w: Int4Weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scales_and_zeros [groups, out, 2]) for `_weight_int4pack_mm_for_cpu`, whose
    convention is w = (q - 8) * scale + zero, so zero = minimum + 8 * scale."""
    packed = torch._convert_weight_to_int4pack_for_cpu(w.q.contiguous(), 1)
    zero = w.minimum + 8 * w.scale
    scales_and_zeros = torch.stack([w.scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
    return packed, scales_and_zeros.to(dtype)
