"""The compact models' linear layers: dense (prepacked for oneDNN where it pays), int8 or int4.

Every layer maps [..., in_features] to [..., out_features] in the model's dtype; the quantized ones
keep their weights quantized and run torch's weight-only CPU kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specgate.engine.cpu_linear import PackedLinear
from specgate.engine.models.quant import int4_kernel_operands, quantize_int4, quantize_int8


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    q: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        w = quantize_int8(weight)
        self.register_buffer("q", w.q)  # [out, in] int8
        self.register_buffer("scale", w.scale.to(dtype))  # [out]
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # the kernel takes [tokens, in]
        out: torch.Tensor = torch._weight_int8pack_mm(rows, self.q, self.scale)  # [tokens, out]
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


class Int4Linear(nn.Module):
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        w = quantize_int4(weight)
        self.group = w.group
        packed, scales_and_zeros = int4_kernel_operands(w, dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in / group, out, 2]
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # the kernel takes [tokens, in]
        out: torch.Tensor = torch._weight_int4pack_mm_for_cpu(
            rows, self.packed, self.group, self.scales_and_zeros
        )  # [tokens, out]
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, mode: str, dtype: torch.dtype, pack: bool
) -> nn.Module:
    """One linear layer for `weight` ([out, in], any float dtype) stored as `mode` (none, int8, int4).

    `pack`: dense weights go to oneDNN's blocked layout (CPU bf16 / fp16 decoding streams them faster).
    """
    if mode == "int8":
        return Int8Linear(weight, bias, dtype)
    if mode == "int4":
        return Int4Linear(weight, bias, dtype)
    if mode != "none":
        raise ValueError(f"unknown linear mode {mode!r}")
    dense = nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias is not None, dtype=dtype, device=weight.device
    )
    with torch.no_grad():
        dense.weight.copy_(weight)
        if bias is not None and dense.bias is not None:
            dense.bias.copy_(bias)
    if pack:
        return PackedLinear([dense])
    return DenseLinear(dense.weight.data, None if dense.bias is None else dense.bias.data)
