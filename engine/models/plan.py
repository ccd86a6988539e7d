"""Which precision each linear weight is served at, from the `quantization` setting.

- none: every linear dense in the serving dtype.
- int8: every linear int8 (one scale per output row).
- int4: the decoder layers' linears int4 (groups of 32); the LM head dense, as llama.cpp's 4-bit
  files keep their output matrix at higher precision (it is the largest and most sensitive matmul).
- auto: each tensor at the precision its GGUF source had: 4-bit and lower formats -> int4 (Q4_1 is
  reproduced exactly), float and 5- to 8-bit formats -> dense in the serving dtype. bf16 keeps a Q8_0
  or Q6_K weight to within bf16 rounding, closer than int8 with one scale per row could, and on CPU
  torch's int8 kernel streams a wide matrix (the LM head) slower than oneDNN's bf16 GEMV.
  A checkpoint that is not GGUF is served dense.
"""

from __future__ import annotations

import re
from pathlib import Path

from specgate.engine.models.llama import ModePlan

_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
_FINE_TYPES = frozenset({"Q8_0", "Q8_1", "Q8_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K"})
# Hugging Face projection names -> GGUF tensor names, as llama.cpp's converter writes them.
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(\w+\.\w+)\.weight")


def gguf_type_mode(type_name: str) -> str:
    return "none" if type_name in _FLOAT_TYPES or type_name in _FINE_TYPES else "int4"


def gguf_name(hf_name: str, tensor_names: frozenset[str]) -> str | None:
    """The GGUF tensor an HF linear weight came from (Llama-style GGUF naming)."""
    if hf_name == "lm_head.weight":
        return "output.weight" if "output.weight" in tensor_names else "token_embd.weight"
    m = _LAYER.fullmatch(hf_name)
    if m is None or m.group(2) not in HF_TO_GGUF:
        return None
    return f"blk.{m.group(1)}.{HF_TO_GGUF[m.group(2)]}.weight"


def gguf_tensor_types(path: Path) -> dict[str, str]:
    """GGUF tensor name -> its ggml type name (only the header is read)."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def mode_plan(quantization: str, gguf_types: dict[str, str] | None) -> ModePlan:
    if quantization == "none":
        return lambda name: "none"
    if quantization == "int8":
        return lambda name: "int8"
    if quantization == "int4":
        return lambda name: "none" if name == "lm_head.weight" else "int4"
    if quantization != "auto":
        raise ValueError(f"quantization must be none, int8, int4 or auto; got {quantization!r}")
    if gguf_types is None:
        return lambda name: "none"
    types = gguf_types
    names = frozenset(types)

    def plan(name: str) -> str:
        source = gguf_name(name, names)
        return gguf_type_mode(types[source]) if source is not None and source in types else "none"

    return plan
