"""Speculation inside the continuous batch: lossless for every proposer, in fp32."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaForCausalLM

from specgate.engine.engine import Engine
from specgate.engine.errors import RequestError
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.cost_model import CostModel
from specgate.engine.vocab import SpecParams
from tests.engine.test_engine import GREEDY, prompts, run_to_completion, tokens


class FixedCosts(CostModel):
    """Costs as on a real model (an extra verified token adds 3% to a step, drafting is free),
    independent of this machine's timing."""

    def observe_forward(self, num_tokens: int, seconds: float, context: float = 0.0) -> None:
        pass

    def observe_draft(self, method: str, steps: int, seconds: float) -> None:
        pass


def proposer_options(method: str, tiny_draft_dir: Path, tiny_eagle_dir: Path) -> dict:
    return {
        "draft_model": {"draft_model": {"model": str(tiny_draft_dir)}},
        "eagle": {"eagle": {"head": str(tiny_eagle_dir)}},
    }.get(method, {})


def spec_engine(
    make_engine: Callable[..., Engine],
    method: str,
    tiny_draft_dir: Path,
    tiny_eagle_dir: Path,
    **config: object,
) -> Engine:
    options = proposer_options(method, tiny_draft_dir, tiny_eagle_dir)
    return make_engine(num_blocks=1024, max_num_batched_tokens=48, proposer_options=options, **config)


def plain_and_speculative(engine: Engine, spec: SpecParams, **sampling: object) -> tuple[dict, int]:
    """Each repetitive prompt decoded greedily twice in one batch, plainly and with `spec`; asserts the
    two outputs are token-identical and returns (outputs by request id, number of prompts)."""
    engine.cost_model = FixedCosts()  # on a tiny model drafting costs as much as verifying: pretend not
    ps = repetitive_prompts()
    params = {"max_tokens": 40, **GREEDY, **sampling}
    for i, p in enumerate(ps):
        engine.add_request(f"plain{i}", p, SamplingParams(**params))  # type: ignore[arg-type]
        engine.add_request(f"spec{i}", p, SamplingParams(**params), spec)  # type: ignore[arg-type]
    outs = run_to_completion(engine)
    for i in range(len(ps)):
        assert tokens(outs[f"spec{i}"]) == tokens(outs[f"plain{i}"]), f"spec{i} diverged"
    return outs, len(ps)


def repetitive_prompts() -> list[list[int]]:
    # Prompts that repeat themselves give n-gram and suffix proposers something to find.
    return [p + p[: len(p) // 2] + p for p in prompts([6, 15, 30], seed=3)]


@pytest.mark.parametrize(
    ("method", "controller"),
    [
        ("ngram", "static"),
        ("ngram", "heuristic"),
        ("ngram", "goodput"),
        ("suffix", "static"),
        ("suffix", "goodput"),
        ("draft_model", "static"),
        ("draft_model", "goodput"),
        ("eagle", "static"),
        ("eagle", "goodput"),
    ],
)
def test_greedy_speculation_is_token_identical_in_mixed_batches(
    method: str,
    controller: str,
    make_engine: Callable[..., Engine],
    tiny_draft_dir: Path,
    tiny_eagle_dir: Path,
) -> None:
    # The draft is a different model with the same tokenizer, so drafts are sometimes rejected.
    engine = spec_engine(make_engine, method, tiny_draft_dir, tiny_eagle_dir)
    spec = SpecParams(method=method, controller=controller, num_speculative_tokens=3, k_max=5)
    outs, n = plain_and_speculative(engine, spec)
    drafted = accepted = 0
    for i in range(n):
        assert outs[f"plain{i}"][-1].stats.spec is None
        stats = outs[f"spec{i}"][-1].stats.spec
        assert stats is not None and stats.method == method
        drafted += stats.num_draft_tokens
        accepted += stats.num_accepted_tokens
        assert sum(step.drafted for step in stats.steps) == stats.num_draft_tokens
        assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    assert drafted > 0  # speculation really ran
    if method == "draft_model" and controller == "static":
        assert 0 < accepted < drafted  # some drafts kept, some rejected and rolled back
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle"])
def test_greedy_speculation_is_token_identical_on_quantized_weights(
    method: str,
    quantization: str,
    make_engine: Callable[..., Engine],
    tiny_draft_dir: Path,
    tiny_eagle_dir: Path,
) -> None:
    # Plain and speculative decoding on the same quantized weights (fp32 activations): verifying
    # k + 1 rows through the int8 / int4 kernels must pick what k + 1 single-row steps pick.
    engine = spec_engine(make_engine, method, tiny_draft_dir, tiny_eagle_dir, quantization=quantization)
    outs, n = plain_and_speculative(engine, SpecParams(method=method, controller="static"))
    assert sum(outs[f"spec{i}"][-1].stats.spec.num_draft_tokens for i in range(n)) > 0


@pytest.mark.parametrize(("method", "tree_nodes"), [("ngram", 0), ("suffix", 6), ("eagle", 0), ("eagle", 6)])
def test_greedy_speculation_with_logit_bias_is_token_identical(
    method: str,
    tree_nodes: int,
    make_engine: Callable[..., Engine],
    tiny_draft_dir: Path,
    tiny_eagle_dir: Path,
) -> None:
    # The bias is part of the target distribution: drafts are verified against biased logits, so
    # speculation must reproduce plain decoding under the same bias, which itself must differ
    # from unbiased decoding (else the bias was ignored).
    engine = spec_engine(make_engine, method, tiny_draft_dir, tiny_eagle_dir)
    unbiased, n = plain_and_speculative(engine, SpecParams(method=method, controller="static"))
    favourite = max(range(96), key=lambda t: sum(tokens(unbiased[f"plain{i}"]).count(t) for i in range(n)))
    bias = {favourite: -100.0, 7: 4.0, 11: 2.5}
    spec = SpecParams(method=method, controller="static", num_speculative_tokens=3, max_tree_nodes=tree_nodes)
    outs, _ = plain_and_speculative(engine, spec, logit_bias=bias)
    for i in range(n):
        assert favourite not in tokens(outs[f"plain{i}"])
        assert tokens(outs[f"plain{i}"]) != tokens(unbiased[f"plain{i}"])
    assert sum(outs[f"spec{i}"][-1].stats.spec.num_draft_tokens for i in range(n)) > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_dynamic_k_speculates_deep_once_output_repeats(
    method: str, make_engine: Callable[..., Engine], tiny_fixed_point_dir: Path
) -> None:
    engine = make_engine(model=str(tiny_fixed_point_dir))
    engine.cost_model = FixedCosts()  # timing-independent: each extra token adds 3% to a step
    p = prompts([6], seed=3)[0]
    engine.add_request("plain", p, SamplingParams(max_tokens=60, **GREEDY))
    engine.add_request("spec", p, SamplingParams(max_tokens=60, **GREEDY), SpecParams(method=method, k_max=8))
    outs = run_to_completion(engine)
    assert tokens(outs["spec"]) == tokens(outs["plain"])
    stats = outs["spec"][-1].stats.spec
    assert stats is not None
    assert stats.mean_acceptance_length > 3.0
    assert max(s.drafted for s in stats.steps) >= 6  # the goodput controller raised k on high acceptance


def test_the_target_as_its_own_draft_accepts_everything(
    make_engine: Callable[..., Engine], tiny_llama_dir: Path
) -> None:
    engine = make_engine(proposer_options={"draft_model": {"model": str(tiny_llama_dir)}})
    spec = SpecParams(method="draft_model", controller="static", num_speculative_tokens=4, max_tree_nodes=0)
    engine.add_request("a", prompts([9])[0], SamplingParams(max_tokens=41, **GREEDY), spec)
    stats = run_to_completion(engine)["a"][-1].stats.spec
    assert stats is not None
    assert stats.num_draft_tokens == stats.num_accepted_tokens == 32
    assert stats.mean_acceptance_length == 5.0 and stats.draft_acceptance_rate == 1.0
    assert stats.num_accepted_tokens_per_pos == [8, 8, 8, 8]


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
@pytest.mark.slow
def test_sampled_speculation_matches_the_target_distribution(
    method: str,
    make_engine: Callable[..., Engine],
    tiny_llama_dir: Path,
    tiny_draft_dir: Path,
    tiny_eagle_dir: Path,
) -> None:
    """The second output token is drawn through verification (accepted or recovered); its law
    must be the target's marginal, computed exactly from the target model."""
    options = {"draft_model": {"model": str(tiny_draft_dir)}, "eagle": {"head": str(tiny_eagle_dir)}}
    engine = make_engine(num_blocks=2048, max_num_seqs=128, proposer_options={method: options[method]})
    prompt = prompts([7], seed=11)[0]
    params = dict(max_tokens=3, temperature=0.8, top_p=0.95, ignore_eos=True)
    spec = SpecParams(method=method, controller="static", num_speculative_tokens=2)
    n = 1500
    counts = torch.zeros(96)
    drafted = 0
    for start in range(0, n, 125):
        for i in range(start, start + 125):
            engine.add_request(f"r{i}", prompt, SamplingParams(seed=i, **params), spec)
        for out in run_to_completion(engine).values():
            counts[tokens(out)[1]] += 1
            drafted += out[-1].stats.spec.num_draft_tokens
    assert drafted > 0

    from specgate.engine.sampler import SamplingRow, process_logits

    ref_model = LlamaForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    sp = SamplingParams(**params)
    with torch.no_grad():
        first = ref_model(torch.tensor([prompt])).logits[0, -1:]
        p1 = process_logits(first, [SamplingRow(sp, prompt, len(prompt), None)]).softmax(-1)[0]
        batch = torch.tensor([[*prompt, t] for t in range(96)])
        second = ref_model(batch).logits[:, -1]
        rows = [SamplingRow(sp, [*prompt, t], len(prompt), None) for t in range(96)]
        p2 = process_logits(second, rows).softmax(-1)  # [first token, vocab]
    marginal = (p1.unsqueeze(1) * p2).sum(0)  # [vocab]
    expected = marginal * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


def test_unknown_method_is_a_request_error(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    with pytest.raises(RequestError, match="unknown speculation method"):
        engine.add_request("x", [1, 2, 3], SamplingParams(), SpecParams(method="telepathy"))
    with pytest.raises(RequestError, match="draft model"):
        engine.add_request("y", [1, 2, 3], SamplingParams(), SpecParams(method="draft_model"))


def test_draft_model_with_another_tokenizer_is_refused(
    make_engine: Callable[..., Engine], tmp_path: Path
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tests.conftest import tiny_config_kwargs

    LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs())).save_pretrained(tmp_path)
    vocab = {chr(ord("a") + i): i for i in range(26)} | {"<eos>": 26}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="different tokenizer"):
        make_engine(proposer_options={"draft_model": {"model": str(tmp_path)}})
