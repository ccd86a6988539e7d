"""The weights of a Llama-family GGUF file, read for the compact decoder without dequantizing them.

Tensors are memory-mapped (gguf-py's reader) and each weight matrix is repacked once for the native
kernels (quantized.QuantizedMatrix); nothing is widened to float, so the model in memory is the
size of the file. Norms and biases are float32 in GGUF files. Types the kernels do not read
(Q2_K, Q3_K, the IQ types, ...) are dequantized and stored as Q8_0 (one byte and a sixteenth per
weight, within a fraction of a percent of the values); float matrices stay float.

llama.cpp's converter permutes the rows of a Llama-architecture file's query and key projections
(its rotary embedding pairs dimensions differently); they are put back in Hugging Face's order
here, as transformers' own GGUF loader does. Qwen2 files are stored in that order already.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specgate.engine.models.quantized import NATIVE_TYPES, QuantizedMatrix

logger = logging.getLogger(__name__)
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
PERMUTED_ARCHS = frozenset({"llama", "mistral"})


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's query / key permutation: HF row i is file row out[i]."""
    index = np.arange(rows)
    permuted = index.reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)  # file -> HF
    return np.argsort(permuted)


@dataclass(slots=True)
class GGUFWeights:
    path: Path
    architecture: str
    _tensors: dict[str, Any] = field(default_factory=dict)
    _fields: dict[str, Any] = field(default_factory=dict)  # the header's metadata, by key
    loaded_bytes: Counter[str] = field(default_factory=Counter)  # bytes in memory by source type

    @classmethod
    def open(cls, path: Path) -> GGUFWeights:
        from gguf import GGUFReader

        reader = GGUFReader(path)  # seconds for a large vocabulary: open a file once
        arch = _scalar(reader.fields, "general.architecture") or "llama"
        return cls(path, arch, {t.name: t for t in reader.tensors}, dict(reader.fields))

    def metadata(self, key: str) -> Any:
        """A scalar metadata value of the file (str, int, float or bool), or None where it has none."""
        return _scalar(self._fields, key)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def type_of(self, name: str) -> str:
        return str(self._tensors[name].tensor_type.name)

    def vector(self, name: str) -> torch.Tensor:
        """A 1-D float tensor (norm weights, biases) as float32."""
        t = self._tensors[name]
        return torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))

    def matrix(self, name: str, heads_permuted: int | None = None) -> QuantizedMatrix | torch.Tensor:
        """A weight matrix [out, in]: quantized (for the kernels) or, where the file keeps it in
        float, a float32 tensor. `heads_permuted`: undo llama.cpp's query / key row order for a
        matrix of that many heads (Llama-architecture files only)."""
        t = self._tensors[name]
        type_name = t.tensor_type.name
        cols, rows = int(t.shape[0]), int(t.shape[1])  # GGUF lists dimensions innermost first
        data = np.asarray(t.data)
        order = None
        if heads_permuted is not None and self.architecture in PERMUTED_ARCHS:
            order = unpermute_rows(rows, heads_permuted)
        if type_name in FLOAT_TYPES:
            dense = torch.from_numpy(np.array(data, dtype=np.float32).reshape(rows, cols))
            if order is not None:
                dense = dense[torch.from_numpy(order)]
            self.loaded_bytes[type_name] += dense.numel() * 2
            return dense
        blocks = data.reshape(rows, -1)
        if order is not None:
            blocks = blocks[order]
        if type_name in NATIVE_TYPES:
            # A copy: the mapped file is read-only, and torch wants memory it may write.
            m = QuantizedMatrix.from_blocks(torch.from_numpy(np.array(blocks)), type_name, cols)
        else:
            m = QuantizedMatrix.from_blocks(
                _as_q8_0(blocks, t.tensor_type, rows, cols), "Q8_0", cols, type_name
            )
        self.loaded_bytes[m.source_type] += m.nbytes
        return m


def _scalar(fields: dict[str, Any], key: str) -> Any:
    f = fields.get(key)
    if f is None or not f.data:
        return None
    value = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(value).decode()
    return value.tolist()[0] if hasattr(value, "tolist") else value


def apply_file_metadata(config: Any, w: GGUFWeights) -> str | None:
    """Correct the configuration transformers' GGUF loader made of the file `w` where the file says
    more than that loader reads (a Qwen3 head size apart from hidden / heads, a sliding window,
    linear rotary scaling); returns why the compact decoder cannot serve the file as it says, or
    None."""
    arch = w.architecture
    c = config.get_text_config()
    key_length = w.metadata(f"{arch}.attention.key_length")
    if key_length and int(key_length) != (
        getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    ):
        c.head_dim = int(key_length)
    window = w.metadata(f"{arch}.attention.sliding_window")
    if window and not getattr(c, "sliding_window", None) and getattr(c, "layer_types", None) is None:
        c.sliding_window = int(window)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rotated = w.metadata(f"{arch}.rope.dimension_count")
    params = getattr(c, "rope_parameters", None) or {}
    partial = float(
        params.get("partial_rotary_factor", None) or getattr(c, "partial_rotary_factor", None) or 1.0
    )
    if rotated and int(rotated) != int(head_dim * partial):
        return f"the file rotates {rotated} of {head_dim} dims per head, which its configuration does not say"
    scaling = w.metadata(f"{arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return None
    factor = float(w.metadata(f"{arch}.rope.scaling.factor") or 1.0)
    if scaling != "linear":
        return f"{scaling!r} rotary scaling in the file is not covered"
    if factor != 1.0:
        target = (
            params.get("full_attention", params) if isinstance(params.get("full_attention"), dict) else params
        )
        if target.get("rope_type", "default") == "default":
            target.update(rope_type="linear", factor=factor)
    return None


def _as_q8_0(blocks: np.ndarray, qtype: Any, rows: int, cols: int) -> torch.Tensor:
    """Blocks of a type the kernels do not read, as Q8_0 blocks of the same values (to within
    Q8_0's rounding: a 256th of each block's largest magnitude)."""
    from gguf import GGMLQuantizationType, quants

    if cols % 32:
        raise ValueError(f"a {qtype.name} matrix with {cols} columns cannot be stored as Q8_0")
    logger.info("%s weights are converted to Q8_0 for the native kernels", qtype.name)
    values = quants.dequantize(np.ascontiguousarray(blocks), qtype).reshape(rows, cols).astype(np.float32)
    q8 = quants.quantize(values, GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(q8.reshape(rows, -1)))
