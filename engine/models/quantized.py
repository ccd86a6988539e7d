"""Layers whose weights stay in their GGUF blocks: matrix products and embedding lookups by the
native kernels (engine/kernels), at the file's own bytes per weight.

A `QuantizedMatrix` is one weight matrix as the kernels take it: its rows repacked once at load
(`repack`: the same fields, in panels of 16 rows laid out for the kernels' dot products), the ggml
type and the shape.
`GGUFLinear` runs one or more matrices that read the same input (a layer's q / k / v, or its gate
and up projections) in one kernel call, outputs side by side, whatever their types; `GGUFEmbedding`
dequantizes the rows of the tokens it is asked for. Both map [..., in] to [..., out] in the dtype
of their input (float32 or bfloat16), and compute each row the same way whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specgate.engine.kernels import extension

# ggml type ids the kernels read natively.
NATIVE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


@dataclass(slots=True)
class QuantizedMatrix:
    packed: torch.Tensor  # uint8 [ceil(rows / 16), packed bytes per panel of 16 rows]
    type_id: int
    rows: int  # out_features
    cols: int  # in_features
    source_type: str  # the type the file stored (Q8_0 for a type the kernels convert to it)

    def __post_init__(self) -> None:
        panels = -(-self.rows // 16)
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2 or self.packed.shape[0] != panels:
            raise ValueError("packed must be uint8 [ceil(rows / 16), bytes]")
        if self.type_id not in NATIVE_TYPES.values():
            raise ValueError(f"ggml type {self.type_id} is not read natively")

    @property
    def nbytes(self) -> int:
        return int(self.packed.numel())

    @classmethod
    def from_blocks(
        cls, blocks: torch.Tensor, type_name: str, cols: int, source_type: str = ""
    ) -> QuantizedMatrix:
        """From a GGUF tensor's raw blocks (uint8 [rows, blocks per row * block bytes])."""
        type_id = NATIVE_TYPES[type_name]
        packed = extension.ops().repack(blocks.contiguous(), type_id, cols)
        return cls(packed, type_id, int(blocks.shape[0]), cols, source_type or type_name)


class GGUFLinear(nn.Module):
    """Matrices with the same input as one layer: [..., in] -> [..., sum of out]."""

    def __init__(self, parts: list[QuantizedMatrix], biases: list[torch.Tensor | None]) -> None:
        super().__init__()
        if not parts or len({p.cols for p in parts}) != 1 or len(biases) != len(parts):
            raise ValueError("GGUFLinear needs matrices of one input size, and a bias (or None) each")
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        self.parts = parts
        for i, p in enumerate(parts):
            self.register_buffer(f"packed{i}", p.packed, persistent=False)
        empty = torch.empty(0)
        self._biases = [empty if b is None else b.detach().float().contiguous() for b in biases]
        self._weights = [p.packed for p in parts]
        self._types = [p.type_id for p in parts]
        self._outs = [p.rows for p in parts]
        self._ops = extension.ops()

    def forward(
        self,
        x: torch.Tensor,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        gated: int = 0,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """W x, with what the decoder does around it done in the same call: `norm`, RMSNorm(x) * norm
        first; `gated` (1: SiLU, 2: tanh GELU; True is SiLU), x is [..., 2 * in] and act(its first
        half) * its second half goes in; `residual` ([..., out]) is added to the result."""
        rows = x.reshape(-1, x.shape[-1])  # [tokens, in] (gated: [tokens, 2 * in])
        res = None if residual is None else residual.reshape(-1, self.out_features)
        out: torch.Tensor = self._ops.qmatmul(
            rows,
            self._weights,
            self._types,
            self._outs,
            self.in_features,
            self._biases,
            norm,
            eps,
            int(gated),
            res,
        )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kinds = "+".join(p.source_type for p in self.parts)
        return f"in={self.in_features}, out={self.out_features}, {kinds}"


class GGUFEmbedding(nn.Module):
    """A GGUF-quantized embedding table: the rows of the ids asked for, dequantized."""

    def __init__(self, matrix: QuantizedMatrix, dtype: torch.dtype) -> None:
        super().__init__()
        self.matrix = matrix
        self.register_buffer("packed", matrix.packed, persistent=False)
        self.num_embeddings, self.embedding_dim = matrix.rows, matrix.cols
        self.dtype = dtype
        self._ops = extension.ops()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows: torch.Tensor = self._ops.dequantize_rows(
            self.matrix.packed, self.matrix.type_id, self.matrix.cols, self.matrix.rows, ids.reshape(-1)
        )
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)


class SideBySide(nn.Module):
    """Layers with the same input, outputs concatenated (a fused projection whose parts the file
    stores in different forms: some quantized, some float)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self._calls = [p.forward for p in parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([call(x) for call in self._calls], dim=-1)
