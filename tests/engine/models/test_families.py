"""Every family the compact decoder covers, from a GGUF file on the native kernels: Qwen3 (QK-norm,
a head size apart from hidden / heads), Gemma 3 (QK-norm, sandwich norms, GeGLU, scaled embeddings,
its own attention scale, interleaved sliding-window and global layers with two rotary bases),
Phi-3 (fused qkv and gate/up tensors, partial rotary, a sliding window), Mistral (a sliding window)
and Llama 3 (rotary scaling from the file's `rope_freqs`). Each: logits equal to the Hugging Face
module's with the file's dequantized weights, greedy speculative output token-identical to plain,
the one-call decoder equal to the per-layer path, and sliding windows that do not depend on the
batch, the chunking or the prefix cache. Windows are a few tokens wide so the prompts cross them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specgate.engine.engine import Engine
from specgate.engine.kernels import extension
from specgate.engine.models.family import family_of, unsupported
from specgate.engine.models.llama import CompactCausalLM
from specgate.engine.models.quantized import GGUFLinear
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import SpecParams
from tests.conftest import _save_tiny, tiny_config_kwargs
from tests.engine.gguf_fixture import GREEDY, MIXED, write_gguf
from tests.engine.gguf_fixture import dequantized_reference as _dequantized_reference
from tests.engine.gguf_fixture import gguf_engine as _engine
from tests.engine.gguf_fixture import quantize_inputs as _quantize_inputs
from tests.engine.gguf_fixture import run_greedy as _run
from tests.engine.gguf_fixture import step_logits as _step_logits

pytestmark = pytest.mark.skipif(
    not extension.load(), reason=f"GGUF kernels unavailable: {extension.unavailable_reason()}"
)

TYPES = {**MIXED, "attn_qkv.weight": T.Q5_K}  # Phi-3 files fuse q, k, v
FAMILIES = ["qwen3", "gemma3", "phi3", "mistral", "llama3"]
HIDDEN = 256


def _llama3_scaling() -> dict[str, Any]:
    # Scaled so that this tiny model's frequencies straddle the bands Llama 3 treats differently.
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }


def _hf_model(family: str) -> tuple[torch.nn.Module, Any]:
    """A random-weight model of the family, and the configuration a real GGUF file's loader yields."""
    kw = {
        **tiny_config_kwargs(),
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 3,
    }
    if family == "qwen3":  # heads of 128: q is 512 wide on a hidden size of 256
        config = Qwen3Config(**kw, head_dim=128)
        return Qwen3ForCausalLM(config), None
    if family == "gemma3":
        config = Gemma3TextConfig(
            **kw,
            head_dim=64,
            query_pre_attn_scalar=48,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
            },
        )
        model = Gemma3ForCausalLM(config)
        with torch.no_grad():  # Gemma's norms start at zero (a multiplier of 1): make them count
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
        return model, None
    if family == "phi3":
        config = Phi3Config(
            **kw,
            sliding_window=7,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
        return Phi3ForCausalLM(config), None
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(**kw, sliding_window=5)), None
    assert family == "llama3"
    model = LlamaForCausalLM(LlamaConfig(**kw, rope_parameters=_llama3_scaling()))
    plain = LlamaConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    return model, plain  # a real file's config has no scaling: its rope_freqs tensor carries it


def _rope_freqs(model: torch.nn.Module) -> np.ndarray | None:
    """llama.cpp's per-frequency factors of a Llama 3 model: plain frequency / scaled frequency."""
    if model.config.model_type != "llama":
        return None
    rotary = model.model.rotary_emb
    d = model.config.hidden_size // model.config.num_attention_heads
    base = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    return (base / rotary.inv_freq.float()).numpy()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    tmp = tmp_path_factory.mktemp("families")
    out = {}
    for seed, family in enumerate(FAMILIES):
        torch.manual_seed(100 + seed)
        model, meta = _hf_model(family)
        hf = _save_tiny(tmp / f"hf-{family}", model)
        gguf = write_gguf(
            hf, tmp / f"{family}.gguf", tmp / "cache", TYPES, rope_freqs=_rope_freqs(model), meta_config=meta
        )
        out[family] = (gguf, hf)
    out["cache"] = (tmp / "cache", tmp / "cache")
    return out


def _prompts(seed: int, lengths: tuple[int, ...] = (9, 14, 17)) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 95, (4,), generator=rng).tolist() * 5)[:n] for n in lengths]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_native_model_computes_the_files_model(files: dict[str, tuple[Path, Path]], family: str) -> None:
    """Next-token logits on the kernels against Hugging Face's module with the file's dequantized
    weights (its own sliding-window masks, QK-norms, GeGLU, rotary tables), prompts longer than
    every window: the same numbers, to float and int8-tie rounding."""
    engine = _engine(files, family)
    model = engine.runner.model
    assert engine.runner.native is not None and model.fused and model._decoder is not None
    assert isinstance(model.lm_head, GGUFLinear)
    reference = _dequantized_reference(*files[family])
    _quantize_inputs(reference)
    captured = _step_logits(engine)
    errors = []
    for prompt in ([5, 17, 33, 2, 9, 41, 8, 8, 12, 64, 1, 30], [70, 3, 3, 41, 8], list(range(1, 20))):
        captured.clear()
        _run(engine, [prompt], 1)
        with torch.no_grad():
            want = reference(torch.tensor([prompt])).logits[0, -1]
        got = captured[0][-1]
        errors.append(float((got - want).abs().max() / want.abs().max()))
        assert int(got.argmax()) == int(want.argmax())
    # An int8 rounding tie moved by float rounding (see test_gguf_model.py) costs up to a few 1e-2 here:
    # QK-norm and sandwich norms rescale what a one-code step changes. A kernel error shows in all three.
    assert max(errors) < 6e-2 and min(errors) < 1e-4, errors


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("impl", ["compact", "hf"])
def test_a_hugging_face_checkpoint_computes_the_modules_logits(
    files: dict[str, tuple[Path, Path]], family: str, impl: str
) -> None:
    """From a Hugging Face checkpoint, over a step that crosses the windows, against the module
    itself: the compact decoder (dense, no kernels: the GPU and safetensors path), and the family's
    own modules over the paged pool, which masks their windows (model_impl hf)."""
    engine = _engine(files, family, model=str(files[family][1]), quantization="none", model_impl=impl)
    assert engine.runner.compact == (impl == "compact")
    if impl == "compact":
        assert isinstance(engine.runner.model, CompactCausalLM)
    reference = AutoModelForCausalLM.from_pretrained(
        files[family][1], dtype=torch.float32, attn_implementation="sdpa"
    )
    captured = _step_logits(engine)
    prompt = list(range(3, 24))
    _run(engine, [prompt], 1)
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0, -1]
    assert float((captured[0][-1] - want).abs().max() / want.abs().max()) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_greedy_output_is_token_identical_to_plain(
    files: dict[str, tuple[Path, Path]], family: str, method: str
) -> None:
    plain, spec = _engine(files, family), _engine(files, family, proposer_options={"ngram": {"min_n": 1}})
    prompts = _prompts(11)
    want = _run(plain, prompts, 24)
    chain = SpecParams(method=method, controller="static", num_speculative_tokens=4)
    assert _run(spec, prompts, 24, chain) == want
    if method == "ngram":
        tree = SpecParams(method="ngram", controller="static", num_speculative_tokens=4, max_tree_nodes=10)
        assert (
            _run(_engine(files, family, proposer_options={"ngram": {"min_n": 1}}), prompts, 24, tree) == want
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_one_call_decoder_is_the_per_layer_path_bit_for_bit(
    files: dict[str, tuple[Path, Path]], family: str
) -> None:
    def logits_of_every_step(one_call: bool) -> list[torch.Tensor]:
        engine = _engine(files, family, max_num_batched_tokens=24)
        model = engine.runner.model
        if not one_call:
            model._decoder = None
        captured = _step_logits(engine)
        params = SpecParams(method="ngram", controller="static", num_speculative_tokens=3)
        for i, p in enumerate(_prompts(7, (5, 19, 11))):
            engine.add_request(f"s{i}", p, SamplingParams(max_tokens=12, **GREEDY), params)
            engine.add_request(f"p{i}", p, SamplingParams(max_tokens=12, **GREEDY))
        while engine.has_unfinished():
            engine.step()
        return captured

    one_call, per_layer = logits_of_every_step(True), logits_of_every_step(False)
    assert len(one_call) == len(per_layer) > 5
    for a, b in zip(one_call, per_layer, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sliding_windows_do_not_depend_on_the_batch_chunks_or_cache(
    files: dict[str, tuple[Path, Path]], family: str
) -> None:
    """A prompt far longer than the window: its next-token logits are the same floats alone or
    batched with other sequences, prefilled whole or in chunks of 5, or mostly from the prefix cache."""
    rng = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 95, (60,), generator=rng).tolist()

    def first_logits(engine: Engine, others: int = 0, warm: bool = False) -> torch.Tensor:
        if warm:
            _run(engine, [prompt], 1)
        captured = _step_logits(engine)
        prompts = [prompt] + [
            torch.randint(0, 95, (9 + 7 * i,), generator=rng).tolist() for i in range(others)
        ]
        for i, p in enumerate(prompts):
            engine.add_request(f"q{i}", p, SamplingParams(max_tokens=1, **GREEDY))
        rows: list[torch.Tensor] = []
        while engine.has_unfinished():
            engine.step()
        rows = [c for c in captured]
        return rows[-1] if others == 0 else rows

    alone = first_logits(_engine(files, family, max_num_batched_tokens=128, prefix_caching=False))[-1]
    chunked = first_logits(_engine(files, family, max_num_batched_tokens=5, prefix_caching=False))[-1]
    cached = first_logits(_engine(files, family, max_num_batched_tokens=128, prefix_caching=True), warm=True)[
        -1
    ]
    assert torch.equal(alone, chunked) and torch.equal(alone, cached)
    # Batched: decode steps of several sequences share attention calls; the long one's tokens match.
    batched = _run(_engine(files, family), [prompt, prompt[:20], prompt[5:40]], 12)
    single = _run(_engine(files, family), [prompt], 12)
    assert batched["r0"] == single["r0"]


def test_the_family_is_read_from_the_configuration() -> None:
    g = family_of(
        Gemma3TextConfig(**tiny_config_kwargs(), head_dim=16, sliding_window=6, query_pre_attn_scalar=48)
    )
    assert g.qk_norm and g.sandwich_norms and g.activation == "gelu_tanh" and g.norm_offset == 1.0
    assert g.embed_scale == pytest.approx(math.sqrt(64)) and g.scale == pytest.approx(48**-0.5)
    assert g.windows[:6] == (6, 6, 6, 6, 6, 0)[: len(g.windows)]
    q = family_of(Qwen3Config(**tiny_config_kwargs(), head_dim=32))
    assert q.qk_norm and not q.sandwich_norms and q.head_dim == 32 and not q.sliding
    p = family_of(
        Phi3Config(
            **tiny_config_kwargs(),
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        )
    )
    assert p.rotary_dim == p.head_dim // 2


def test_what_the_decoder_does_not_cover_is_named() -> None:
    from transformers import Gemma2Config

    assert "softcapped" in (unsupported(Gemma2Config(**tiny_config_kwargs())) or "") or "gemma2" in (
        unsupported(Gemma2Config(**tiny_config_kwargs())) or ""
    )
    longrope = Phi3Config(
        **tiny_config_kwargs(),
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 256,
        },
    )
    assert "longrope" in (unsupported(longrope) or "")
    assert unsupported(Qwen3Config(**tiny_config_kwargs())) is None
