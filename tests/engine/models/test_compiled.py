"""Compiled steps compute what the eager compact decoder computes, padded or not, and fall back to it."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.model_runner import ModelRunner
from specgate.engine.models import compiled as compiled_module
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import SpecParams
from tests.engine.models.test_llama import runner, steps
from tests.engine.spec_decode.test_speculative_engine import plain_and_speculative
from tests.engine.test_engine import GREEDY, prompts, run_to_completion, tokens

# Two sizes for the module's shared runner, one for every other engine here (each graph compiles for
# seconds): the shared steps run 4 rows exactly in the 4-graph, 6 rows padded into the 8-graph (the
# smallest that holds them, not merely one that does) and a prefill above both eagerly, so the
# per-bucket graphs, bucket choice, padding and the eager fallback are all exercised in one place.
SIZES = (4, 8)


@pytest.fixture(scope="module", autouse=True)
def _keep_every_graph() -> Iterator[None]:
    """Keep each compiled graph whatever this machine's timing says (a loaded machine can make the tiny
    model's graphs no faster than eager); the comparison itself is tested on its own below."""
    timings = itertools.count()  # the warm-up times the compiled step first, then the eager one
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiled_module, "_median_ms", lambda fn: (fn(), float(next(timings)))[1])
        yield


@pytest.fixture(scope="module")
def compiled_runner(tiny_llama_dir: Path) -> ModelRunner:
    r = runner(tiny_llama_dir, "compact", compile_sizes=SIZES)
    assert r.compiled is not None
    return r


@pytest.mark.slow
def test_graphs_cover_their_sizes_and_pad_between_them(compiled_runner: ModelRunner) -> None:
    compiled = compiled_runner.compiled
    assert compiled is not None
    assert set(compiled.graphs) == set(SIZES)
    assert compiled.bucket(1) == compiled.bucket(3) == compiled.bucket(4) == 4
    assert compiled.bucket(5) == compiled.bucket(8) == 8 and compiled.bucket(9) is None


@pytest.mark.slow
def test_compiled_logits_and_features_match_eager(compiled_runner: ModelRunner, tiny_llama_dir: Path) -> None:
    """Mixed steps: prefill chunks (eager), a decode beside a 5-token verification (6 rows, padded to 8),
    3 + 1 rows (the 4-graph, unpadded)."""
    eager = runner(tiny_llama_dir, "compact")
    assert compiled_runner.compiled is not None
    used = []
    run = compiled_runner.compiled.run

    def spy(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        out = run(*args)  # type: ignore[arg-type]
        used.append(out is not None)
        return out

    compiled_runner.compiled.run = spy  # type: ignore[method-assign]
    try:
        for items in steps():
            logits_c, feats_c = compiled_runner.execute_with_hidden(items, True)
            logits_e, feats_e = eager.execute_with_hidden(items, True)
            assert logits_c.shape == logits_e.shape
            assert torch.allclose(logits_c, logits_e, atol=1e-4, rtol=1e-4)
            assert feats_c is not None and feats_e is not None
            for fc, fe in zip(feats_c, feats_e, strict=True):
                assert fc.shape == fe.shape
                assert torch.allclose(fc, fe, atol=1e-4, rtol=1e-4)
    finally:
        compiled_runner.compiled.run = run  # type: ignore[method-assign]
    assert used == [False, True, True]  # the prefill step has more rows than the largest graph


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_greedy_output_compiled_equals_eager_plain_and_speculative(
    quantization: str, make_engine: Callable[..., Engine]
) -> None:
    """fp32: compiled plain decoding equals eager plain decoding token for token, and compiled
    speculative decoding (verifications of 3 rows padded to 4) equals both; three requests at once
    put 1-3 decodes and verifications in one step (padded to 4, or eager above it)."""
    eager = make_engine(quantization=quantization)
    compiled = make_engine(quantization=quantization, compile_sizes=(4,))
    assert eager.runner.compiled is None and compiled.runner.compiled is not None
    outs: dict[str, dict[str, list[int]]] = {}
    for arm, engine, method in (
        ("eager", eager, "off"),
        ("compiled", compiled, "off"),
        ("ngram", compiled, "ngram"),
    ):
        spec = SpecParams(method=method, controller="static", num_speculative_tokens=2)
        for i, p in enumerate(prompts([5, 11, 30], seed=4)):
            p = p + p[:6]  # a repeat, so the n-gram proposer finds drafts
            params = SamplingParams(max_tokens=20, **GREEDY)
            engine.add_request(f"{arm}{i}", p, params, spec=spec, prefix_salt=None)
        outs[arm] = {rid[-1]: tokens(o) for rid, o in run_to_completion(engine).items()}
    assert outs["compiled"] == outs["eager"]
    assert outs["ngram"] == outs["eager"]


@pytest.mark.slow
def test_every_proposer_stays_lossless_on_compiled_steps(
    make_engine: Callable[..., Engine], tiny_draft_dir: Path, tiny_eagle_dir: Path
) -> None:
    """fp32, one compiled engine: plain and speculative requests share batches (steps of up to 16
    rows padded to 16); each proposer's greedy output equals plain decoding's."""
    options = {"draft_model": {"model": str(tiny_draft_dir)}, "eagle": {"head": str(tiny_eagle_dir)}}
    engine = make_engine(
        num_blocks=1024, max_num_batched_tokens=48, proposer_options=options, compile_sizes=(16,)
    )
    assert engine.runner.compiled is not None and engine.runner.compiled.graphs
    for method in ("ngram", "suffix", "draft_model", "eagle"):
        spec = SpecParams(method=method, controller="static", num_speculative_tokens=3)
        outs, n = plain_and_speculative(engine, spec)  # asserts identity per prompt
        assert sum(outs[f"spec{i}"][-1].stats.spec.num_draft_tokens for i in range(n)) > 0, method


@pytest.mark.slow
def test_draft_trees_run_in_padded_compiled_steps(make_engine: Callable[..., Engine]) -> None:
    """Trees whose accepted tokens all sit off the first path, verified by compiled graphs (steps of
    up to 16 rows, tree masks inside the attention op): output equals plain decoding."""
    from tests.engine.spec_decode.test_tree_engine import OracleTrees, plain_outputs

    ps = prompts([7, 12], seed=8)
    expected = plain_outputs(make_engine(), ps, 24)
    engine = make_engine(num_blocks=1024, max_num_batched_tokens=48, compile_sizes=(16,))
    compiled = engine.runner.compiled
    assert compiled is not None and compiled.graphs
    ran = [0]
    run = compiled.run

    def counted(*args: object) -> object:
        out = run(*args)  # type: ignore[arg-type]
        ran[0] += out is not None
        return out

    compiled.run = counted  # type: ignore[method-assign]
    engine.speculation.proposers["ngram"] = OracleTrees(expected, engine.runner.vocab_size)
    spec = SpecParams(method="ngram", controller="static", num_speculative_tokens=3, max_tree_nodes=7)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=24, **GREEDY), spec)
    outs = run_to_completion(engine)
    for i in range(len(ps)):
        assert tokens(outs[f"r{i}"]) == expected[f"r{i}"]
        assert outs[f"r{i}"][-1].stats.spec.num_tree_drafts > 0
    assert ran[0] > 0, (list(compiled.graphs), ran)


@pytest.mark.slow
def test_a_graph_no_faster_than_eager_is_dropped(
    monkeypatch: pytest.MonkeyPatch, make_engine: Callable[..., Engine]
) -> None:
    timings = itertools.count(100, -1)  # each compiled step timed slower than the eager one after it
    monkeypatch.setattr(compiled_module, "_median_ms", lambda fn: (fn(), float(next(timings)))[1])
    engine = make_engine(compile_sizes=(1,))
    assert engine.runner.compiled is not None and engine.runner.compiled.graphs == {}
    assert engine.runner.compiled.bucket(1) is None  # every step runs eagerly
    engine.add_request("r", prompts([7])[0], SamplingParams(max_tokens=5, **GREEDY))
    assert len(tokens(run_to_completion(engine)["r"])) == 5


def test_a_failed_compile_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, make_engine: Callable[..., Engine]
) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("no C++ compiler found\nsecond line")

    monkeypatch.setattr(compiled_module.torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="specgate.engine.model_runner"):
        engine = make_engine(compile_sizes=(1,))
    assert engine.runner.compiled is None
    assert "running it eagerly: no C++ compiler found" in caplog.text
    engine.add_request("r", prompts([7])[0], SamplingParams(max_tokens=5, **GREEDY))
    assert len(tokens(run_to_completion(engine)["r"])) == 5


def test_compile_is_ignored_where_it_cannot_hold(
    caplog: pytest.LogCaptureFixture, make_engine: Callable[..., Engine]
) -> None:
    with caplog.at_level(logging.WARNING, logger="specgate.engine.model_runner"):
        hf = make_engine(compile_sizes=(1,), model_impl="hf")
        det = make_engine(compile_sizes=(1,), deterministic=True)
    assert hf.runner.compiled is None and det.runner.compiled is None
    assert "compact decoder only" in caplog.text and "deterministic" in caplog.text


@pytest.mark.parametrize("sizes", [(0,), (1, 300), (-4,)])
def test_compile_sizes_are_validated(sizes: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="compile_sizes"):
        EngineConfig(compile_sizes=sizes, device="cpu")


def test_compile_sizes_are_sorted_and_deduplicated() -> None:
    assert EngineConfig(compile_sizes=(8, 1, 4, 1), device="cpu").compile_sizes == (1, 4, 8)
