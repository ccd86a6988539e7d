"""The compact decoder computes what the Hugging Face modules compute, and is chosen only where it can."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from specgate.engine.batch_layout import ForwardItem
from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.model_runner import ModelRunner
from specgate.engine.models.linear import Int4Linear, Int8Linear
from specgate.engine.models.llama import CompactCausalLM
from specgate.engine.sampling_params import SamplingParams
from tests.conftest import _save_tiny
from tests.engine.test_engine import GREEDY, prompts, run_to_completion, tokens


def runner(model: Path, impl: str, **kw: object) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            model=str(model),
            dtype="float32",
            device="cpu",
            block_size=4,
            num_blocks=64,
            model_impl=impl,
            **kw,
        )
    )


def steps() -> list[list[ForwardItem]]:
    """Prefill two sequences (one long chunk, one short), then decode one while verifying 4 on the other."""
    a, b = prompts([21, 9], seed=5)
    ta, tb = list(range(0, 32)), list(range(32, 48))
    return [
        [ForwardItem(a, 0, ta, 1), ForwardItem(b, 0, tb, 1)],
        [ForwardItem([7], 21, ta, 1), ForwardItem([1, 2, 3, 4, 5], 9, tb, 5)],
        [ForwardItem([8, 9, 10], 22, ta, 3), ForwardItem([6], 14, tb, 1)],
    ]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compact_logits_and_features_match_hugging_face(
    family: str, tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> None:
    model = tiny_llama_dir if family == "llama" else tiny_qwen2_dir
    compact, hf = runner(model, "compact"), runner(model, "hf")
    assert compact.compact and isinstance(compact.model, CompactCausalLM) and not hf.compact
    for items in steps():
        logits_c, feats_c = compact.execute_with_hidden(items, True)
        logits_h, feats_h = hf.execute_with_hidden(items, True)
        assert logits_c.shape == logits_h.shape == (sum(it.num_logits for it in items), 96)
        assert torch.allclose(logits_c, logits_h, atol=1e-4, rtol=1e-4)
        assert feats_c is not None and feats_h is not None
        for fc, fh in zip(feats_c, feats_h, strict=True):
            assert torch.allclose(fc, fh, atol=1e-5, rtol=1e-4)


def test_greedy_output_is_the_same_on_both_paths(make_engine: Callable[..., Engine]) -> None:
    outs = {}
    for impl in ("compact", "hf"):
        engine = make_engine(model_impl=impl)
        for i, p in enumerate(prompts([5, 17, 40], seed=2)):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=24, **GREEDY))
        outs[impl] = {rid: tokens(o) for rid, o in run_to_completion(engine).items()}
    assert outs["compact"] == outs["hf"]


def test_other_architectures_keep_the_hugging_face_path(tmp_path: Path) -> None:
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=128))
    path = _save_tiny(tmp_path / "gpt2", gpt2)
    auto = runner(path, "auto")
    assert not auto.compact
    logits = auto.execute([ForwardItem([1, 2, 3], 0, [0], 1)])
    assert logits.shape == (1, 96) and torch.isfinite(logits).all()
    with pytest.raises(
        ValueError, match=r"compact runs the Llama, .*gpt2.* not one the compact decoder covers"
    ):
        runner(path, "compact")
    with pytest.raises(ValueError, match="needs the compact decoder"):
        runner(path, "auto", quantization="int8")


@pytest.mark.parametrize(("mode", "kind"), [("int8", Int8Linear), ("int4", Int4Linear)])
def test_quantization_modes_replace_the_linears(mode: str, kind: type, tiny_llama_dir: Path) -> None:
    r = runner(tiny_llama_dir, "auto", quantization=mode)
    model = r.model
    assert isinstance(model, CompactCausalLM)
    layer = model.layers[0]
    assert all(isinstance(m, kind) for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    # int8 everywhere; int4 keeps the LM head dense (see plan.py).
    assert isinstance(model.lm_head, Int8Linear) == (mode == "int8")
    assert isinstance(model.embed_tokens.weight, torch.Tensor)  # embeddings stay dense: a lookup


def test_config_refuses_quantization_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="q4")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        EngineConfig(quantization="int4", dtype="float16", device="cpu")
    with pytest.raises(ValueError, match="model_impl"):
        EngineConfig(model_impl="vllm")
