"""Incremental detokenization with stop strings.

Decoding each new token alone breaks multi-byte characters and leading spaces, and decoding the
whole output every step is quadratic. We decode a short window (`prefix_offset:`) and emit only
what the newest token added, once it no longer ends in an incomplete UTF-8 sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded ahead of the output so the first output token gets its leading space.
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        # Streamed text must never contain the start of a stop string that may still complete.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one output token; return the stop string it completed, if any.

        With check_stop=False (before min_tokens) stop strings are ignored and stay in the text.
        """
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        if not self._stop or not check_stop:
            return None
        # Only a stop string overlapping the new text can be new.
        search_from = max(0, len(self.text) - len(delta) - self._hold)
        best: tuple[int, str] | None = None
        for s in self._stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self._include_stop else self.text[:idx]
        return s

    def take(self, finished: bool) -> str:
        """Text not yet returned, minus a tail that could still grow into a stop string."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
