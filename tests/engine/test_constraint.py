"""Constrained decoding in the engine: masks, forced drafts and speculation, lossless in fp32."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from specgate.engine.engine import Engine
from specgate.engine.errors import RequestError
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.structured_output.constraint import Constraint
from specgate.engine.structured_output.grammar import Grammar, GrammarCompiler
from specgate.engine.vocab import SpecParams
from tests.conftest import VOCAB_SIZE, build_tokenizer
from tests.engine.spec_decode.test_speculative_engine import FixedCosts, proposer_options
from tests.engine.test_engine import prompts, run_to_completion, tokens

GREEDY = {"temperature": 0.0}  # the grammar decides where output ends: EOS is not ignored
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "count": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "count", "tags"],
    "additionalProperties": False,
}


def compiler() -> GrammarCompiler:
    tok = build_tokenizer()
    return GrammarCompiler(tok, VOCAB_SIZE, [tok.eos_token_id])


def text_of(ids: list[int]) -> str:
    return build_tokenizer().decode(ids)


def test_masks_forced_tokens_and_draft_checks_follow_the_grammar() -> None:
    tok = build_tokenizer()
    c = Constraint(compiler().matcher(Grammar.json_schema(SCHEMA)), VOCAB_SIZE, [VOCAB_SIZE - 1])
    assert text_of(c.forced(32)) == '{"name": "'  # the separators are fixed, so all of it is forced
    good = tok.encode('{"name": "ab", "kind": "beta", "count": 7, "tags": ["x"]}', add_special_tokens=False)
    assert c.valid_prefix(good) == len(good)
    bad = tok.encode('{"name": 1}', add_special_tokens=False)
    assert c.valid_prefix(bad) == len('{"name": ')
    # The mask after a drafted prefix, and the committed state untouched by asking.
    allowed = c.allowed_after(tok.encode('{"name": "ab", "kind": "', add_special_tokens=False))
    assert allowed is not None
    assert {text_of([i]) for i in allowed.nonzero().flatten().tolist()} == {"a", "b", "g"}
    assert c.allowed_after(bad) is None
    first = c.allowed_after([])
    assert first is not None and text_of(first.nonzero().flatten().tolist()) == "{"
    # A tree: two children of the root, one valid; a valid grandchild under the valid one.
    brace, quote, x = (tok.convert_tokens_to_ids(t) for t in ("{", '"', "x"))
    assert c.valid_nodes([brace, x, quote, x], [-1, -1, 0, 2]) == [0, 2]
    c.advance(good)
    assert c.stopped
    eos = c.allowed_after([])
    assert eos is not None and eos.nonzero().flatten().tolist() == [tok.eos_token_id]


def test_grammar_sources_are_validated() -> None:
    with pytest.raises(ValueError, match="kind"):
        Grammar("xml", "<a/>")
    with pytest.raises(ValueError, match="nested"):
        deep: dict = {"type": "object"}
        for _ in range(40):
            deep = {"type": "array", "items": deep}
        Grammar.json_schema(deep)
    with pytest.raises(ValueError, match="choice"):
        Grammar("choice", json.dumps(["a", ""]))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, grammar=Grammar("regex", "a+"))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, max_tokens=4, grammar=Grammar("regex", "a+"))


def test_a_grammar_that_does_not_compile_is_a_request_error(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    with pytest.raises(RequestError, match="grammar"):
        engine.add_request("r", [1, 2, 3], SamplingParams(grammar=Grammar("lark", "start: undefined_rule")))
    assert engine.request_ids() == []


def reference_greedy(model_dir: Path, prompt: list[int], grammar: Grammar, n: int) -> list[int]:
    """Constrained greedy decoding written out plainly: the model's argmax among the tokens a fresh
    matcher allows, one token per forward pass, no drafts."""
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    c = Constraint(compiler().matcher(grammar), VOCAB_SIZE, [VOCAB_SIZE - 1])
    ids = list(prompt)
    out: list[int] = []
    eos = build_tokenizer().eos_token_id
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            allowed = c.allowed_after([])
            assert allowed is not None
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            out.append(token)
            if token == eos:
                break
            c.advance([token])
            if c.stopped:
                break
            ids.append(token)
    return out


GRAMMARS = {
    "json": Grammar.json_schema(SCHEMA),
    "regex": Grammar("regex", r"(ab|cd)+[0-9]{2,4}"),
    "choice": Grammar.choice(["positive", "negative", "neutral"]),
    "lark": Grammar("lark", 'start: "say " WORD ("," WORD)*\nWORD: /[a-z]{1,5}/'),
}


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_constrained_greedy_equals_the_plain_masked_argmax(
    kind: str, make_engine: Callable[..., Engine], tiny_llama_dir: Path
) -> None:
    """Forced drafts included (every constrained request gets them): the engine's output is the
    masked argmax decoded one token at a time."""
    grammar = GRAMMARS[kind]
    engine = make_engine()
    prompt = prompts([9], seed=5)[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=60, grammar=grammar, **GREEDY))
    out = run_to_completion(engine)["r"]
    assert tokens(out) == reference_greedy(tiny_llama_dir, prompt, grammar, 60)
    last = out[-1]
    if kind in ("json", "choice"):
        assert last.stats.num_forced_draft_tokens > 0
    if last.finish_reason == "stop" and kind == "json":
        doc = json.loads(text_of([t for t in tokens(out) if t != VOCAB_SIZE - 1]))
        assert set(doc) == {"name", "kind", "count", "tags"} and doc["kind"] in ("alpha", "beta", "gamma")
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    ("method", "tree_nodes"),
    [("ngram", 0), ("suffix", 0), ("suffix", 6), ("draft_model", 0), ("eagle", 0), ("eagle", 6)],
)
def test_constrained_speculation_is_token_identical_to_constrained_plain(
    method: str,
    tree_nodes: int,
    make_engine: Callable[..., Engine],
    tiny_draft_dir: Path,
    tiny_eagle_dir: Path,
) -> None:
    options = proposer_options(method, tiny_draft_dir, tiny_eagle_dir)
    engine = make_engine(num_blocks=1024, max_num_batched_tokens=64, proposer_options=options)
    engine.cost_model = FixedCosts()
    spec = SpecParams(method=method, controller="static", num_speculative_tokens=4, max_tree_nodes=tree_nodes)
    base = prompts([6, 14], seed=7)
    drafted = forced = 0
    for name, grammar in GRAMMARS.items():
        for i, p in enumerate(base):
            params = SamplingParams(max_tokens=48, grammar=grammar, **GREEDY)
            engine.add_request(f"plain-{name}-{i}", p + p, params)
            engine.add_request(f"spec-{name}-{i}", p + p, params, spec)
    outs = run_to_completion(engine)
    for name in GRAMMARS:
        for i in range(len(base)):
            spec_out = outs[f"spec-{name}-{i}"]
            assert tokens(spec_out) == tokens(outs[f"plain-{name}-{i}"]), f"{name} {i} diverged"
            stats = spec_out[-1].stats
            assert stats.spec is not None
            drafted += stats.spec.num_draft_tokens
            forced += stats.num_forced_draft_tokens
    assert drafted > forced > 0  # the proposer drafted besides the grammar
    assert engine.block_manager.num_used_blocks == 0


def test_max_tokens_cuts_a_json_answer_with_length(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=5, grammar=GRAMMARS["json"], **GREEDY))
    out = run_to_completion(engine)["r"]
    assert out[-1].finish_reason == "length"
    assert len(tokens(out)) == 5


def test_logprobs_of_a_constrained_request_are_the_masked_law(
    make_engine: Callable[..., Engine], tiny_llama_dir: Path
) -> None:
    engine = make_engine()
    prompt = prompts([8], seed=2)[0]
    grammar = GRAMMARS["regex"]
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, logprobs=3, grammar=grammar, **GREEDY))
    out = run_to_completion(engine)["r"]
    lps = [lp for o in out for lp in o.logprobs or []]
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="sdpa")
    c = Constraint(compiler().matcher(grammar), VOCAB_SIZE, [VOCAB_SIZE - 1])
    ids = list(prompt)
    with torch.no_grad():
        for lp in lps:
            allowed = c.allowed_after([])
            assert allowed is not None
            logits = model(torch.tensor([ids])).logits[0, -1].masked_fill(~allowed, float("-inf"))
            ref = torch.log_softmax(logits, -1)
            assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-4)
            assert all(allowed[t] for t, _ in lp.top if _ > float("-inf"))
            c.advance([lp.token_id])
            ids.append(lp.token_id)
