"""When a sequence may stop and when it must: the rules behind `min_tokens`, stop tokens, EOS, stop
strings, `max_tokens` and the context limit.

Two places apply them. Sampling: before `min_tokens` is reached, EOS and the stop tokens must not be
drawn, so every sampling row (a plain decode's, a verification row's, a draft's) carries them as
suppressed tokens; drafts and verification rows that share this suppression keep speculation
lossless. After each emitted token: whether the sequence ends here, and why.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from collections.abc import Set

from specgate.engine.sampler import SamplingRow
from specgate.engine.sequence import Sequence


def sampling_row(seq: Sequence, extra: Seq[int], eos_token_ids: Set[int]) -> SamplingRow:
    """The row that samples the position after `seq`'s tokens followed by `extra` (drafted ones)."""
    p = seq.params
    suppress: tuple[int, ...] = ()
    if seq.num_output_tokens + len(extra) < p.min_tokens:
        suppress = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_token_ids))
    history = [*seq.token_ids, *extra] if extra else seq.token_ids
    allowed = seq.constraint.allowed_after(extra) if seq.constraint is not None else None
    return SamplingRow(p, history, seq.num_prompt_tokens, seq.generator, suppress, allowed)


def may_stop(seq: Sequence) -> bool:
    """Whether the sequence has emitted enough tokens (min_tokens) for a stop condition to count."""
    return seq.num_output_tokens >= seq.params.min_tokens


def stop_after(
    seq: Sequence, token: int, stop_string: str | None, max_model_len: int, eos_token_ids: Set[int]
) -> tuple[str, str | int | None] | None:
    """(finish_reason, stop_reason) if `seq` ends with `token`, its newest token; else None.
    `stop_string`: the stop string the detokenizer found in the text so far, if any."""
    p = seq.params
    if may_stop(seq):
        if token in p.stop_token_ids:
            return "stop", token
        if token in eos_token_ids and not p.ignore_eos:
            return "stop", None
        if stop_string is not None:
            return "stop", stop_string
    if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length", None
    return None
