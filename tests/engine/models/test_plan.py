"""Which precision each linear is served at, by `quantization` and the GGUF source's own types."""

from __future__ import annotations

import pytest

from specgate.engine.loader import ModelNotFoundError, default_model_source
from specgate.engine.models.plan import gguf_name, gguf_tensor_types, gguf_type_mode, mode_plan

NAMES = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.7.self_attn.o_proj.weight",
    "model.layers.7.mlp.down_proj.weight",
    "lm_head.weight",
]


def test_uniform_modes() -> None:
    assert [mode_plan("none", None)(n) for n in NAMES] == ["none"] * 4
    assert [mode_plan("int8", None)(n) for n in NAMES] == ["int8"] * 4
    # int4 keeps the LM head dense, as 4-bit GGUF files keep their output matrix finer.
    assert [mode_plan("int4", None)(n) for n in NAMES] == ["int4", "int4", "int4", "none"]
    with pytest.raises(ValueError, match="quantization must be"):
        mode_plan("int3", None)


def test_auto_without_a_gguf_source_is_dense() -> None:
    assert [mode_plan("auto", None)(n) for n in NAMES] == ["none"] * 4


def test_auto_follows_each_tensors_gguf_type() -> None:
    types = {
        "token_embd.weight": "Q8_0",
        "blk.0.attn_q.weight": "Q4_K",
        "blk.7.attn_output.weight": "Q6_K",
        "blk.7.ffn_down.weight": "F16",
    }
    plan = mode_plan("auto", types)
    assert [plan(n) for n in NAMES] == ["int4", "none", "none", "none"]
    assert plan("model.layers.9.mlp.up_proj.weight") == "none"  # not in the file: left dense
    types["output.weight"] = "Q4_0"  # an untied output matrix is its own tensor
    assert mode_plan("auto", types)("lm_head.weight") == "int4"


def test_gguf_names() -> None:
    names = frozenset({"token_embd.weight"})
    assert gguf_name("model.layers.12.mlp.gate_proj.weight", names) == "blk.12.ffn_gate.weight"
    assert gguf_name("model.layers.3.self_attn.v_proj.weight", names) == "blk.3.attn_v.weight"
    assert gguf_name("lm_head.weight", names) == "token_embd.weight"
    assert gguf_name("model.norm.weight", names) is None
    assert [gguf_type_mode(t) for t in ("F32", "BF16", "Q8_0", "Q5_K", "Q4_1", "Q2_K", "IQ4_XS")] == [
        "none",
        "none",
        "none",
        "none",
        "int4",
        "int4",
        "int4",
    ]


@pytest.mark.slow
def test_the_default_model_is_served_as_its_gguf_stores_it() -> None:
    try:
        source = default_model_source()
    except ModelNotFoundError:
        pytest.skip("the default model is not installed")
    assert source.gguf_file is not None
    types = gguf_tensor_types(source.directory / source.gguf_file)
    plan = mode_plan("auto", types)
    assert plan("lm_head.weight") == "none"  # tied to token_embd, Q8_0: bf16 holds it closely
    for layer in (0, 29):
        for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            assert plan(f"model.layers.{layer}.{name}.weight") == "int4"  # Q4_1
