"""The engine's structured outputs: each constrained sequence's grammar state at its start, from its
request's grammar compiled for the engine's tokenizer (compiled grammars are kept by their text)."""

from __future__ import annotations

from collections.abc import Set
from typing import Any

from specgate.engine.errors import RequestError
from specgate.engine.structured_output.constraint import Constraint, ConstraintError
from specgate.engine.structured_output.grammar import Grammar, GrammarCompiler, GrammarError


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Set[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        # None without a tokenizer: such an engine refuses constrained requests.
        self.compiler = (
            GrammarCompiler(tokenizer, vocab_size, self.eos_token_ids) if tokenizer is not None else None
        )

    def constraint(self, grammar: Grammar | None) -> Constraint | None:
        """A sequence's grammar state at its start; None without a grammar. RequestError if the
        grammar cannot be followed."""
        if grammar is None:
            return None
        if self.compiler is None:
            raise RequestError("this engine has no tokenizer, so it cannot follow a grammar")
        try:
            constraint = Constraint(self.compiler.matcher(grammar), self.vocab_size, self.eos_token_ids)
            constraint.allowed_after([])  # a grammar that admits no output fails here, not mid-stream
            return constraint
        except (GrammarError, ConstraintError) as exc:
            raise RequestError(f"the grammar cannot be compiled: {exc}") from exc
