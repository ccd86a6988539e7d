"""The compact models' linear layers: dense (prepacked for oneDNN where it pays), int8 or int4.

Every layer maps [..., in_features] to [..., out_features] in the model's dtype.

The weight-only kernels pay where a step reads each weight for a few rows (decoding, verifying a
draft): there the weight bytes are the cost, and int4 reads a quarter of bf16's. For many rows
(prefill chunks, large batches) the same kernels are compute-bound and about twice as slow as
oneDNN's bf16 GEMM, so a quantized layer also keeps the dense form of its quantized weight and
uses it above `max_rows` rows. Both forms hold the same weight values, so which one ran changes
results by kernel rounding only. Memory is spent (dense plus quantized), not saved.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from specgate.engine.cpu_linear import PackedLinear
from specgate.engine.models.quant import (
    dequantize_int4,
    dequantize_int8,
    int4_kernel_operands,
    quantize_int4,
    quantize_int8,
)

# Rows up to which the weight-only kernel runs: plain decodes and verifications of up to 7 drafts.
MAX_KERNEL_ROWS = 8


def kernel_rows(dtype: torch.dtype, pack: bool) -> int:
    """Rows up to which a weight-only layer uses its kernel. The dense copy pays for many rows only
    where dense GEMMs are fast: fp32, or bf16 / fp16 on oneDNN (`pack`). Without native bf16, torch
    emulates bf16 GEMMs and the dense copy is several times slower than the kernel at any row count
    (a 961-token prefill of the default model took 15.0 s that way against 12.5 s on the kernel)."""
    return MAX_KERNEL_ROWS if pack or dtype == torch.float32 else sys.maxsize


class WeightOnlyLinear(nn.Module):
    """A quantized weight run by a weight-only kernel for few rows, by its dense form for many."""

    bias: torch.Tensor | None

    def __init__(self, dense: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype, pack: bool) -> None:
        super().__init__()
        self.dense = dense  # the dequantized weight, bias included
        self.max_rows = kernel_rows(dtype, pack)
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    @property
    def in_features(self) -> int:
        return int(getattr(self.dense, "in_features"))  # noqa: B009 (nn.Module's attribute typing)

    @property
    def out_features(self) -> int:
        return int(getattr(self.dense, "out_features"))  # noqa: B009

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> [tokens, out]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # the kernels take [tokens, in]
        if rows.shape[0] > self.max_rows:
            out: torch.Tensor = self.dense(rows)
        else:
            out = self.kernel(rows)
            if self.bias is not None:
                out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])


class Int8Linear(WeightOnlyLinear):
    q: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, pack: bool
    ) -> None:
        w = quantize_int8(weight)
        super().__init__(_dense(dequantize_int8(w), bias, dtype, pack), bias, dtype, pack)
        self.register_buffer("q", w.q)  # [out, in] int8
        self.register_buffer("scale", w.scale.to(dtype))  # [out]

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.q, self.scale)


class Int4Linear(WeightOnlyLinear):
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, pack: bool
    ) -> None:
        w = quantize_int4(weight)
        super().__init__(_dense(dequantize_int4(w), bias, dtype, pack), bias, dtype, pack)
        self.group = w.group
        packed, scales_and_zeros = int4_kernel_operands(w, dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in / group, out, 2]

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)


def _dense(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, pack: bool) -> nn.Module:
    """A dense layer holding `weight` ([out, in]) in `dtype`; prepacked for oneDNN if `pack`."""
    dense = nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias is not None, dtype=dtype, device=weight.device
    )
    with torch.no_grad():
        dense.weight.copy_(weight)
        if bias is not None and dense.bias is not None:
            dense.bias.copy_(bias)
    dense.requires_grad_(False)
    return PackedLinear([dense]) if pack else dense


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, mode: str, dtype: torch.dtype, pack: bool
) -> nn.Module:
    """One linear layer for `weight` ([out, in], any float dtype) stored as `mode` (none, int8, int4).

    `pack`: dense weights go to oneDNN's blocked layout (CPU bf16 / fp16 decoding streams them faster).
    """
    if mode == "int8":
        return Int8Linear(weight, bias, dtype, pack)
    if mode == "int4":
        return Int4Linear(weight, bias, dtype, pack)
    if mode != "none":
        raise ValueError(f"unknown linear mode {mode!r}")
    return _dense(weight, bias, dtype, pack)
