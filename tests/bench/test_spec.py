"""`specgate bench spec`: its arms, and one tiny run through every kind of arm."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from specgate.bench import spec


def test_each_method_gets_a_chain_and_a_tree_and_fixed_k_a_static_pair() -> None:
    arms = spec.arms(["ngram", "suffix"], tree_nodes=16, fixed=3)
    assert list(arms) == [
        "plain",
        "ngram chain",
        "ngram tree",
        "ngram chain-3",
        "ngram tree-3",
        "suffix chain",
        "suffix tree",
        "suffix chain-3",
        "suffix tree-3",
    ]
    assert arms["plain"] is None
    chain, tree, fixed = arms["ngram chain"], arms["ngram tree"], arms["ngram tree-3"]
    assert chain is not None and chain.max_tree_nodes == 0 and chain.controller == "goodput"
    assert tree is not None and tree.max_tree_nodes == 16 and tree.k_max == spec.K_MAX["ngram"]
    assert fixed is not None and fixed.controller == "static" and fixed.num_speculative_tokens == 3
    assert list(spec.arms(["eagle"], tree_nodes=0, fixed=0)) == ["plain", "eagle chain"]


def test_a_tally_is_the_bonus_token_plus_accepted_drafts_a_step() -> None:
    t = spec.Tally(tokens=30, seconds=2.0, drafts=10, accepted=15, nodes=40)
    t.add(spec.Tally(tokens=10, seconds=2.0, drafts=10, accepted=5, nodes=20))
    assert t.rate == 10.0 and t.mal == 2.0 and t.nodes == 60 and spec.Tally().mal == 1.0


@pytest.mark.slow
def test_a_tiny_run_reports_every_arm_equal_to_plain(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = argparse.ArgumentParser()
    spec.add_arguments(p)
    sizes = ["--per-class", "1", "--max-tokens", "8", "--reps", "1", "--concurrency", "1,2"]
    args = p.parse_args(
        [
            "--model",
            str(tiny_llama_dir),
            "--methods",
            "ngram,suffix",
            "--fixed",
            "2",
            "--categories",
            "qa",
            *sizes,
        ]
    )
    assert spec.run(args) == 0
    out = capsys.readouterr().out
    assert "| class | plain | ngram chain | ngram tree | ngram chain-2 | ngram tree-2 | suffix chain |" in out
    assert "concurrency 2:" in out and "outputs equal to plain (batch 1): ngram chain 1/1" in out
