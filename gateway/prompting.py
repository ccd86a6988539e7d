"""Turning chat messages into prompt token ids with the model's own chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use the completions API")
    encoded = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) or hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]
