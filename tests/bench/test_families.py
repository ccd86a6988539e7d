"""`specgate bench families`: the family table it writes files from, the vocabularies it builds, and
its report (each family measured as `bench serve --peer llama-server` measures one file)."""

from __future__ import annotations

import itertools
from typing import Any

from specgate.bench import families
from specgate.bench.interleaved import LLAMA


def test_every_family_has_a_vocabulary_builder_and_consistent_shapes() -> None:
    assert set(families.FAMILIES) == set(families.VOCABS) == {"qwen3", "gemma3", "phi3", "mistral", "llama3"}
    for fam in families.FAMILIES.values():
        assert fam.heads % fam.kv_heads == 0 and fam.vocab > 30000
        names = [name for name, _ in families.tensor_shapes(fam)]
        assert names[0] == "token_embd.weight" and len(names) == len(set(names))
        assert ("output.weight" in names) != fam.tied
    assert families.FAMILIES["mistral"].model_name == "mistral"  # what transformers' loader keys on


def test_llama3_rope_factors_keep_high_frequencies_and_divide_low_ones() -> None:
    factors = families.llama3_rope_factors(500000.0, 64)
    assert len(factors) == 32 and factors[0] == 1.0 and factors[-1] == 32.0
    assert all(a <= b for a, b in itertools.pairwise(factors))


def report(
    family: str, tpot: dict[str, float], ratio: float, rates: dict[str, list[float]]
) -> dict[str, Any]:
    one = {
        "in_flight": 1,
        "arms": {name: {"tpot_p50_ms": t} for name, t in tpot.items()},
        "pairs": [
            {
                "arm": "plain",
                "reference": LLAMA,
                "all": {"ratio": ratio, "low": ratio - 0.1, "high": ratio + 0.1},
            }
        ],
    }
    many = {
        "in_flight": 16,
        "arms": {name: {"tok_s": r} for name, r in rates.items()},
        "ratios": {LLAMA: {"plain": sum(rates["plain"]) / sum(rates[LLAMA])}},
    }
    path = ["served on the native GGUF kernels (Q4_K, Q6_K)"]
    return {"family": family, "code": 0, "path": path, "specgate_ready_s": 12.34, "points": [one, many]}


def test_one_row_per_family_from_its_peer_report() -> None:
    rows = [
        report("qwen3", {LLAMA: 16.8, "plain": 11.9}, 1.41, {LLAMA: [100.0, 96.0], "plain": [200.0, 192.0]}),
        {
            "family": "phi3",
            "code": 1,
            "path": [],
            "points": [{"in_flight": 1, "error": "llama-server exited"}],
        },
    ]
    lines = families.markdown(rows)
    assert lines[0].startswith("| family | specgate path | specgate ready s |")
    assert (
        lines[2]
        == "| qwen3 | native | 12.3 | 16.8 | 11.9 | 1.41x [1.31, 1.51] | 100.0, 96.0 | 200.0, 192.0 | 2.00x |"
    )
    assert lines[3] == "| phi3 | ? | - | - | - | - | - | - | - |"
