"""One request's grammar state: the matcher at its committed output, and what the engine asks of it.

The target of a constrained request is the masked law: at each position the model's distribution
with grammar-invalid tokens removed, then the request's usual processing. Speculation stays
lossless with respect to it when every logit row (plain, drafted, verified) is masked for its own
prefix, drafts are cut at their first grammar-invalid token (no later row has a grammar state),
and the committed state advances only on emitted tokens. This object gives each of those:

- `allowed_after(extra)`: the mask for the position after the committed output plus `extra`
  (drafted tokens), by moving a temporary path along the matcher and rolling it back;
- `valid_prefix` / `valid_nodes`: how much of a chain or tree draft the grammar accepts;
- `forced(limit)`: the tokens the grammar allows as the only continuation (canonical tokenization),
  a draft that costs no proposer time and is verified like any other;
- `advance(tokens)`: commit emitted tokens.

A matcher that enters an error state never leaves it, so nothing is consumed on the temporary path
before it is validated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from llguidance import LLMatcher

# Masks allowing at most this many tokens have each one checked against the matcher (microseconds).
FEW = 8


class ConstraintError(RuntimeError):
    """The grammar's matcher failed (a resource limit, an internal error): the request ends."""


class Constraint:
    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        if matcher.is_error():
            raise ConstraintError(matcher.get_error())
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._eos = frozenset(eos_token_ids)
        self._path: list[int] = []  # tokens consumed past the committed output, rolled back before commit

    # ---- the temporary path ----------------------------------------------------------------

    def _goto(self, extra: Sequence[int]) -> bool:
        """Put the matcher after committed + `extra`; False (matcher left at the longest valid
        prefix) when the grammar refuses one of `extra`."""
        common = 0
        path = self._path
        limit = min(len(path), len(extra))
        while common < limit and path[common] == extra[common]:
            common += 1
        if common < len(path):
            self._rollback(len(path) - common)
        rest = [int(t) for t in extra[common:]]
        if not rest:
            return True
        n = self._matcher.validate_tokens(rest)
        if n and not self._matcher.consume_tokens(rest[:n]):
            raise ConstraintError(self._matcher.get_error() or "the grammar refused a validated token")
        self._path.extend(rest[:n])
        return n == len(rest)

    def _rollback(self, n: int) -> None:
        if n and not self._matcher.rollback(n):
            raise ConstraintError(self._matcher.get_error() or "the grammar could not roll back")
        del self._path[len(self._path) - n :]

    def _home(self) -> None:
        self._rollback(len(self._path))

    def _mask(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar allows next, at the matcher's current state."""
        # One byte per token (0: refused) turns into a bool mask in one pass; unpacking the 32-bit
        # bitmask costs about twice as much on a 150k vocabulary.
        raw = bytearray(self._matcher.compute_logit_bias())
        if self._matcher.is_error():  # failed before or while computing this mask
            raise ConstraintError(self._matcher.get_error())
        mask = torch.frombuffer(raw, dtype=torch.uint8)[: self.vocab_size] != 0  # [<= vocab_size]
        if mask.shape[0] < self.vocab_size:  # tokens past the grammar's vocabulary: never allowed
            mask = torch.cat([mask, mask.new_zeros(self.vocab_size - mask.shape[0])])
        allowed = mask.nonzero().flatten()
        if len(allowed) <= FEW:
            # Where the grammar forces its next bytes, llguidance can allow a token (a tokenizer's
            # added token spelling those bytes) that consuming it then refuses: check the few.
            for t in allowed.tolist():
                if t not in self._eos and self._matcher.validate_tokens([t]) != 1:
                    mask[t] = False
        if not bool(mask.any()):
            raise ConstraintError("the grammar allows no token here: its output cannot be completed")
        return mask

    # ---- what the engine asks ----------------------------------------------------------------

    def allowed_after(self, extra: Sequence[int] = ()) -> torch.Tensor | None:
        """[vocab_size] bool mask of the position after committed + `extra`; None when the grammar
        refuses `extra` (that position has no grammar state: a draft is cut before it)."""
        if not self._goto(extra):
            return None
        return self._mask()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a chain the grammar accepts, from the committed output."""
        self._home()
        return int(self._matcher.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def valid_nodes(self, tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
        """The nodes of a draft tree (parents before children) whose whole path the grammar accepts."""
        keep: list[int] = []
        ok: list[bool] = []
        paths: list[list[int]] = []
        for i, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
            base = paths[parent] if parent >= 0 else []
            good = (parent < 0 or ok[parent]) and self._goto(base)
            good = good and self._matcher.validate_tokens([int(token)]) == 1
            ok.append(good)
            paths.append([*base, int(token)])
            if good:
                keep.append(i)
        return keep

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (empty when it allows a choice)."""
        if limit <= 0:
            return []
        self._home()
        out: list[int] = []
        for t in self._matcher.compute_ff_tokens()[:limit]:
            if int(t) in self._eos:  # the end is the engine's to decide (`stopped`), never drafted
                break
            out.append(int(t))
        # Forced tokens are tokenized from the forced bytes; keep those the matcher accepts.
        return out[: self._matcher.validate_tokens(out)] if out else out

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit emitted tokens. Raises ConstraintError for a token the grammar refuses (only a bug
        upstream could emit one: every row that emits was masked)."""
        self._home()
        ids = [int(t) for t in tokens]
        if ids and not self._matcher.consume_tokens(ids):
            raise ConstraintError(self._matcher.get_error() or f"the grammar refused tokens {ids}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (but end of sequence)."""
        self._home()
        return bool(self._matcher.is_stopped())
