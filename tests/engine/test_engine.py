"""End-to-end engine behaviour on tiny fp32 models: continuous batching must not change greedy output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from specgate.engine.engine import Engine
from specgate.engine.errors import ContextLengthExceededError, DuplicateRequestError, RequestError
from specgate.engine.outputs import RequestOutput
from specgate.engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # the engine side runs with ignore_eos
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, pad_token_id=0)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, len(prompt) :].tolist()


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 95, (n,), generator=g).tolist() for n in lengths]


def run_to_completion(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not engine.has_unfinished()
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_continuous_batch_is_token_identical_to_hf_generate(
    arch: str, make_engine: Callable[..., Engine], tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> None:
    model_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[arch]
    # A small token budget forces chunked prefill through both attention paths (short and long).
    engine = make_engine(model=str(model_dir), max_num_batched_tokens=40)
    ps = prompts([3, 17, 41, 90, 7, 55], seed=1)
    lengths = [24, 9, 30, 20, 16, 12]
    outs: dict[str, list[RequestOutput]] = {}

    def collect() -> None:
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)

    for i in range(2):
        engine.add_request(f"r{i}", ps[i], SamplingParams(max_tokens=lengths[i], **GREEDY))
    for _ in range(3):
        collect()
    for i in range(2, 5):
        engine.add_request(f"r{i}", ps[i], SamplingParams(max_tokens=lengths[i], **GREEDY))
    collect()
    engine.add_request("r5", ps[5], SamplingParams(max_tokens=lengths[5], **GREEDY))
    collect()
    assert engine.abort("r4")
    while engine.has_unfinished():
        collect()

    assert outs["r4"][-1].finish_reason == "abort" and outs["r4"][-1].finished
    for i in (0, 1, 2, 3, 5):
        got = tokens(outs[f"r{i}"])
        assert got == hf_greedy(model_dir, ps[i], lengths[i]), f"r{i} diverged"
        assert outs[f"r{i}"][-1].finish_reason == "length"
        assert sum(o.finished for o in outs[f"r{i}"]) == 1
    assert engine.block_manager.num_used_blocks == 0


def test_kv_exhaustion_preempts_and_recomputes_without_changing_output(
    make_engine: Callable[..., Engine], tiny_llama_dir: Path
) -> None:
    # 12 blocks of 4 tokens: three requests of up to 40 tokens cannot all stay resident.
    engine = make_engine(num_blocks=12, max_num_batched_tokens=64)
    ps = prompts([10, 12, 8], seed=2)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=25, **GREEDY))
    outs = run_to_completion(engine)
    assert sum(o[-1].stats.num_preemptions for o in outs.values()) > 0
    for i, p in enumerate(ps):
        assert tokens(outs[f"r{i}"]) == hf_greedy(tiny_llama_dir, p, 25)
    assert engine.block_manager.num_used_blocks == 0


def test_requests_wait_when_max_num_seqs_is_reached(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_num_seqs=2)
    for i, p in enumerate(prompts([5, 6, 7, 8])):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=4, **GREEDY))
    first = engine.step()
    assert {o.request_id for o in first} == {"r0", "r1"}
    assert engine.load().num_running == 2 and engine.load().num_waiting == 2
    outs = run_to_completion(engine)
    assert len(tokens(outs["r0"])) == len(tokens(outs["r1"])) == 3
    assert len(tokens(outs["r2"])) == len(tokens(outs["r3"])) == 4


def test_abort_frees_every_block(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    for i, p in enumerate(prompts([30, 40, 50])):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, **GREEDY))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    for i in range(3):
        assert engine.abort(f"r{i}")
    assert not engine.abort("r0")  # already gone
    assert engine.block_manager.num_used_blocks == 0
    final = engine.step()
    assert {o.request_id for o in final} == {"r0", "r1", "r2"}
    assert all(o.finished and o.finish_reason == "abort" for o in final)
    assert not engine.has_unfinished()


def test_max_tokens_and_context_limit(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_model_len=64)
    engine.add_request("a", prompts([10])[0], SamplingParams(max_tokens=7, **GREEDY))
    outs = run_to_completion(engine)["a"]
    assert len(tokens(outs)) == 7 and outs[-1].finish_reason == "length"
    assert outs[-1].stats.num_output_tokens == 7
    with pytest.raises(ContextLengthExceededError):
        engine.add_request("b", prompts([60])[0], SamplingParams(max_tokens=5))
    with pytest.raises(RequestError):
        engine.add_request("c", [1, 2, 500], SamplingParams())
    with pytest.raises(RequestError):
        engine.add_request("d", [], SamplingParams())
    engine.add_request("e", [1, 2], SamplingParams())
    with pytest.raises(DuplicateRequestError):
        engine.add_request("e", [1, 2], SamplingParams())


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(
    make_engine: Callable[..., Engine],
) -> None:
    p = prompts([12])[0]
    params = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)

    alone = make_engine()
    alone.add_request("x", p, params)
    ref = tokens(run_to_completion(alone)["x"])

    crowded = make_engine(max_num_batched_tokens=16)
    for i, q in enumerate(prompts([5, 33, 20], seed=9)):
        crowded.add_request(f"o{i}", q, SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True))
    crowded.step()
    crowded.add_request("x", p, params)
    got = tokens(run_to_completion(crowded)["x"])
    assert got == ref

    other_seed = make_engine()
    other_seed.add_request("x", p, SamplingParams(max_tokens=30, temperature=1.0, seed=99, ignore_eos=True))
    assert tokens(run_to_completion(other_seed)["x"]) != ref


def test_stop_token_ids_and_eos(make_engine: Callable[..., Engine], tiny_llama_dir: Path) -> None:
    p = prompts([9], seed=3)[0]
    ref = hf_greedy(tiny_llama_dir, p, 20)
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    engine = make_engine()
    engine.add_request("s", p, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_tok]))
    outs = run_to_completion(engine)["s"]
    assert tokens(outs) == ref[: first + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop_tok


def test_stop_string_cuts_text_exactly(make_engine: Callable[..., Engine], tiny_llama_dir: Path) -> None:
    engine = make_engine()
    tok = engine.tokenizer
    p = prompts([9], seed=4)[0]
    full_text = tok.decode(hf_greedy(tiny_llama_dir, p, 30))
    stop = full_text[12:15]
    cut = full_text.index(stop)
    engine.add_request("s", p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))
    outs = run_to_completion(engine)["s"]
    assert "".join(o.new_text for o in outs) == full_text[:cut]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop

    engine.add_request(
        "t",
        p,
        SamplingParams(
            max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
        ),
    )
    outs = run_to_completion(engine)["t"]
    assert "".join(o.new_text for o in outs) == full_text[: cut + len(stop)]


def test_logprobs_are_the_model_log_softmax(make_engine: Callable[..., Engine], tiny_llama_dir: Path) -> None:
    engine = make_engine()
    p = prompts([11], seed=5)[0]
    engine.add_request("l", p, SamplingParams(max_tokens=4, logprobs=3, **GREEDY))
    outs = run_to_completion(engine)["l"]
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    assert len(lps) == 4
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    seq = p + tokens(outs)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
    for i, lp in enumerate(lps):
        row = ref[len(p) - 1 + i]
        assert lp.token_id == seq[len(p) + i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_engines_track_float32_logits(make_engine: Callable[..., Engine], dtype: str) -> None:
    from specgate.engine.batch_layout import ForwardItem

    prompt = prompts([30], seed=8)[0]
    ref = make_engine().runner.execute([ForwardItem(prompt, 0, list(range(8)), 4)])
    half = make_engine(dtype=dtype)
    assert next(half.runner.model.parameters()).dtype == getattr(torch, dtype)
    got = half.runner.execute([ForwardItem(prompt, 0, list(range(8)), 4)]).float()
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    half.add_request("h", prompt, SamplingParams(max_tokens=6, **GREEDY))
    assert len(tokens(run_to_completion(half)["h"])) == 6


@pytest.mark.parametrize("method", [None, "ngram", "draft_model"])
def test_fair_preemption_between_tenants_never_changes_greedy_output(
    method: str | None, make_engine: Callable[..., Engine], tiny_llama_dir: Path, tiny_draft_dir: Path
) -> None:
    from specgate.engine.vocab import SpecParams

    options = {"draft_model": {"model": str(tiny_draft_dir)}} if method == "draft_model" else {}
    engine = make_engine(max_num_seqs=3, proposer_options=options)
    spec = SpecParams(method=method, controller="static", num_speculative_tokens=3) if method else None
    ps = prompts([6, 9, 5, 7, 8], seed=3)
    for i in range(4):  # the hog takes every slot and has one waiting
        engine.add_request(f"hog{i}", ps[i], SamplingParams(max_tokens=20, **GREEDY), spec, tenant="hog")
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(3):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    engine.add_request("victim", ps[4], SamplingParams(max_tokens=20, **GREEDY), spec, tenant="victim")
    first = engine.step()
    for o in first:
        outs.setdefault(o.request_id, []).append(o)
    assert "victim" in {o.request_id for o in first}  # admitted at once, a hog request preempted
    for rid, o in run_to_completion(engine).items():
        outs.setdefault(rid, []).extend(o)
    assert sum(o[-1].stats.num_preemptions for o in outs.values()) >= 1
    for i, rid in enumerate(["hog0", "hog1", "hog2", "hog3", "victim"]):
        assert tokens(outs[rid]) == hf_greedy(tiny_llama_dir, ps[i], 20), f"{rid} diverged"
    assert engine.block_manager.num_used_blocks == 0


def test_warm_up_measures_the_step_cost_curve_and_changes_no_output(
    make_engine: Callable[..., Engine],
) -> None:
    from specgate.engine.engine import WARM_UP_SIZES
    from specgate.engine.step_cost import MIN_BUCKET_STEPS
    from specgate.engine.vocab import SpecParams

    cold, warm = make_engine(), make_engine(warm_up=True)
    assert cold.cost_model.curve() is None
    curve = warm.cost_model.curve()
    assert curve is not None and curve.tokens == list(WARM_UP_SIZES)  # every size, each timed enough
    assert curve.n_steps == MIN_BUCKET_STEPS * len(WARM_UP_SIZES)
    assert warm.block_manager.num_free_blocks == cold.block_manager.num_free_blocks
    # The scratch passes wrote keys and values into free blocks: requests that take them after
    # read only what they wrote themselves.
    spec = SpecParams(method="ngram", controller="static", num_speculative_tokens=3)
    ps = prompts([30, 12, 50], seed=3)
    answers = []
    for engine in (cold, warm):
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", p * 2, SamplingParams(max_tokens=20, **GREEDY), spec)
        outs = run_to_completion(engine)
        answers.append([tokens(outs[f"r{i}"]) for i in range(len(ps))])
    assert answers[0] == answers[1]
    with pytest.raises(RuntimeError, match="before any request"):
        warm.add_request("late", ps[0], SamplingParams(max_tokens=50, **GREEDY))
        warm.warm_up()
    small = make_engine(warm_up=True, max_num_batched_tokens=8)  # no pass over the token budget
    small_curve = small.cost_model.curve()
    assert small_curve is not None and small_curve.tokens[-1] == 8
