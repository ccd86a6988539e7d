"""`specgate bench quality`: greedy agreement, and the held-out texts it scores perplexity on."""

from __future__ import annotations

from specgate.bench import quality


def test_agreement_is_the_share_before_the_first_difference() -> None:
    share, equal = quality.agreement(
        [[1, 2, 3, 4], [1, 2], [5, 6, 7, 8]], [[1, 2, 9, 4], [1, 2], [0, 6, 7, 8]]
    )
    assert share == (0.5 + 1.0 + 0.0) / 3 and equal == 1


def test_held_out_texts_are_solutions_and_worked_answers() -> None:
    texts = quality.held_out_texts()
    assert len(texts) == 24 and "def " in texts[0] and "####" in texts[-1]
    assert set(quality.MODES) >= {"reference", "native", "bf16", "int8", "int4", "plan"}
