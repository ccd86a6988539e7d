"""Llama-family GGUF files served from their own blocks: the compact decoder on the native kernels
decodes what Hugging Face's model decodes with the file's dequantized weights, greedy speculative
output is token-identical to plain output for every proposer (float32). (Without the kernels the
file takes the dequantized path: tests/engine/test_default_model.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specgate.engine.engine import Engine
from specgate.engine.kernels import extension
from specgate.engine.models.quantized import GGUFEmbedding, GGUFLinear
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


def _gguf_model(
    tmp: Path,
    arch: str,
    seed: int,
    types: dict[str, T],
    hidden: int = 256,
    noise: float = 0.0,
    base: Path | None = None,
) -> tuple[Path, Path]:
    kw = {**tiny_config_kwargs(), "hidden_size": hidden, "intermediate_size": 2 * hidden}
    torch.manual_seed(seed)
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kw, use_sliding_window=False))
    hf = _save_tiny(tmp / f"hf-{arch}-{seed}", model)
    return write_gguf(hf, tmp / f"{arch}-{seed}.gguf", tmp / "cache", types), hf


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    tmp = tmp_path_factory.mktemp("gguf")
    llama = _gguf_model(tmp, "llama", 0, MIXED)
    out = {
        "llama": llama,
        "qwen2": _gguf_model(tmp, "qwen2", 1, MIXED),
        # 288 columns: superblocks and a tail of one block of 32 in every blocks-of-32 matrix.
        "tails": _gguf_model(tmp, "llama", 2, {"weight": T.Q4_1}, hidden=288),
        # The target with noise: a draft model that is often, not always, right.
        "draft": _gguf_model(tmp, "llama", 3, {"weight": T.Q8_0}, noise=0.1, base=llama[1]),
    }
    out["cache"] = (tmp / "cache", tmp / "cache")
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2", "tails"])
def test_the_native_model_computes_the_files_model(files: dict[str, tuple[Path, Path]], name: str) -> None:
    """Next-token logits of the compact decoder on the kernels, against Hugging Face's model with
    the file's weights dequantized by gguf-py and each linear layer's input quantized as the
    kernels quantize it: the same numbers, to float rounding. (Without that quantization the two
    differ by about a percent per layer on these random models, as llama.cpp's int8 activations do.)"""
    engine = _engine(files, name)
    model = engine.runner.model
    assert engine.runner.native is not None and engine.config.dtype == "float32"
    assert isinstance(model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
    assert model.fused  # every projection on the kernels: norms, SwiGLU and residuals inside them
    reference = _dequantized_reference(*files[name])
    _quantize_inputs(reference)
    captured: list[torch.Tensor] = []
    run = engine.runner.execute_with_hidden

    def capture(items, hidden):  # type: ignore[no-untyped-def]
        out = run(items, hidden)
        captured.append(out[0])
        return out

    engine.runner.execute_with_hidden = capture  # type: ignore[method-assign]
    errors = []
    for prompt in ([5, 17, 33, 2, 9], [70, 3, 3, 41, 8, 8, 12, 64, 1], [1, 2, 3, 4, 5, 6, 7]):
        captured.clear()
        _run(engine, [prompt], 1)
        with torch.no_grad():
            want = reference(torch.tensor([prompt])).logits[0, -1]
        got = captured[0][-1]
        errors.append(float((got - want).abs().max() / want.abs().max()))
        assert int(got.argmax()) == int(want.argmax())
    # Float rounding (attention's order of sums, the norm's) can move an activation across an int8
    # rounding tie: one code a step off, a few 1e-3 in the logits. Any error of the kernels' own
    # (a scale, a lane, a tail) shows in every prompt, far above either bound.
    assert max(errors) < 2e-2 and min(errors) < 1e-5, errors


def test_the_weights_stay_at_the_files_bytes(files: dict[str, tuple[Path, Path]]) -> None:
    engine = _engine(files, "llama")
    tensors = GGUFReader(files["llama"][0]).tensors
    matrices = sum(
        t.n_bytes for t in tensors if t.tensor_type.name != "F32" and t.name != "token_embd.weight"
    )
    assert engine.runner.weight_bytes is not None
    # Repacking keeps the bytes (K-quants' decoded sub-scales: 4 more bytes per 256 weights).
    assert matrices <= engine.runner.weight_bytes <= matrices * 1.03


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_speculative_greedy_output_is_token_identical_to_plain(
    files: dict[str, tuple[Path, Path]], method: str
) -> None:
    options = {"draft_model": {"model": str(files["draft"][0]), "convert_cache_dir": str(files["cache"][0])}}
    plain = _engine(files, "llama")
    spec = _engine(files, "llama", proposer_options=options if method == "draft_model" else {})
    rng = torch.Generator().manual_seed(5)
    # Repetitive prompts, so n-gram and suffix drafts are often right and verification goes deep.
    prompts = [(torch.randint(0, 95, (4,), generator=rng).tolist() * 4)[:n] for n in (9, 13, 16)]
    params = SpecParams(method=method, controller="static", num_speculative_tokens=4)
    want = _run(plain, prompts, 24)
    got = _run(spec, prompts, 24, params)
    assert got == want
    if method == "draft_model":
        stats = spec.proposer("draft_model")
        assert stats.runner.native is not None  # the draft is served by the kernels too


@pytest.mark.parametrize(
    "params",
    [
        # Trees: verification rows that see their ancestors only (a tree mask in native attention).
        SpecParams(method="ngram", controller="static", num_speculative_tokens=4, max_tree_nodes=12),
        # Deeper than a shared attention group holds: the verification is a chunk of its own.
        SpecParams(
            method="ngram", controller="static", k_max=24, num_speculative_tokens=20, max_tree_nodes=0
        ),
    ],
    ids=["tree", "deep-chain"],
)
def test_trees_and_deep_verifications_are_token_identical_to_plain(
    files: dict[str, tuple[Path, Path]], params: SpecParams
) -> None:
    # Matching single tokens too gives the n-gram proposer several continuations to branch into.
    plain, spec = _engine(files, "llama"), _engine(files, "llama", proposer_options={"ngram": {"min_n": 1}})
    rng = torch.Generator().manual_seed(6)
    # Phrases that recur with different continuations (a b c ... a b d ...): n-gram trees branch.
    prompts = []
    for n in (14, 20):
        a, b, c, d, e = torch.randint(0, 95, (5,), generator=rng).tolist()
        prompts.append(([a, b, c, e, a, b, d, e] * 4)[:n])
    want = _run(plain, prompts, 32)
    finals: dict[str, Any] = {}
    got = _run(spec, prompts, 32, params, finals)
    assert got == want
    steps = [f.stats.spec for f in finals.values()]
    if params.max_tree_nodes > params.num_speculative_tokens:
        assert sum(s.num_tree_drafts for s in steps) > 0
    else:
        assert max(step.drafted for s in steps for step in s.steps) > 16


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_one_call_decoder_is_the_per_layer_path_bit_for_bit(
    files: dict[str, tuple[Path, Path]], name: str
) -> None:
    """Every step (prefill chunks, decodes, verifications) runs the whole stack in one native call
    (engine/kernels/decoder.h); the per-layer loop (bfloat16 activations take it) gives every logit
    of every step as the same float."""

    def logits_of_every_step(one_call: bool) -> list[torch.Tensor]:
        engine = _engine(files, name, max_num_batched_tokens=24)
        model = engine.runner.model
        assert model._decoder is not None
        if not one_call:
            model._decoder = None
        captured = _step_logits(engine)
        rng = torch.Generator().manual_seed(7)
        prompts = [(torch.randint(0, 95, (4,), generator=rng).tolist() * 5)[:n] for n in (5, 19, 11)]
        params = SpecParams(method="ngram", controller="static", num_speculative_tokens=3)
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, SamplingParams(max_tokens=12, **GREEDY), params)
            engine.add_request(f"p{i}", p, SamplingParams(max_tokens=12, **GREEDY))
        while engine.has_unfinished():
            engine.step()
        return captured

    one_call, per_layer = logits_of_every_step(True), logits_of_every_step(False)
    assert len(one_call) == len(per_layer) > 5
    for a, b in zip(one_call, per_layer, strict=True):
        assert torch.equal(a, b)


def test_a_tokens_logits_do_not_depend_on_chunking_or_cache_hits(files: dict[str, tuple[Path, Path]]) -> None:
    """Each query reads its own keys in position order and each product row is computed alone, so
    the next-token logits of a prompt are the same floats whether it was prefilled whole, in
    chunks of 5, or mostly taken from the prefix cache: greedy output never depends on the route."""
    rng = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 95, (90,), generator=rng).tolist()  # longer than any attention group

    def first_logits(engine: Engine, warm: bool = False) -> tuple[torch.Tensor, int]:
        """The prompt's next-token logits and how many of its tokens came from the cache."""
        if warm:  # publish the prompt's blocks, then ask again
            _run(engine, [prompt], 1)
        captured = _step_logits(engine)
        finals: dict[str, Any] = {}
        _run(engine, [prompt], 1, finals=finals)
        return captured[-1][-1], finals["r0"].stats.num_cached_tokens

    whole, _ = first_logits(_engine(files, "llama", max_num_batched_tokens=128, prefix_caching=False))
    chunked, _ = first_logits(_engine(files, "llama", max_num_batched_tokens=5, prefix_caching=False))
    engine = _engine(files, "llama", max_num_batched_tokens=128, prefix_caching=True)
    cached, hits = first_logits(engine, warm=True)
    assert hits >= 80
    assert torch.equal(whole, chunked) and torch.equal(whole, cached)
