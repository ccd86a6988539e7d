"""A request's output grammar: what it is, how it is checked, and how it is compiled.

A `Grammar` says what the output must match: a JSON schema, a regular expression, a choice of
strings, or a Lark or GBNF grammar (llguidance's Lark dialect, which can embed JSON schemas with
`%json`). llguidance compiles it: it has no dependencies, rolls back, computes forced tokens, and
refuses (rather than ignores) the JSON-schema keywords it cannot enforce; bench/README.md has the
measurements behind that choice.

Torch-free: the gateway checks grammars with `check` in processes that never load the engine;
the engine compiles them with a `GrammarCompiler` (constraint.py beside it holds a request's live
state).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

KINDS = ("json_schema", "regex", "choice", "lark", "gbnf")
# A grammar's text, in characters: a generous OpenAPI document's worth. Larger ones are refused
# before any parsing (the gateway's limits on the whole body come first).
MAX_SOURCE_CHARS = 128 * 1024
MAX_CHOICES = 1024
# JSON nesting of a schema; deeper schemas are refused before the compiler recurses into them.
MAX_SCHEMA_DEPTH = 32
# JSON whitespace when the request does not allow more: one space after ',' and ':', as Python's
# json.dumps writes it. Models write this form naturally, and a fixed form lets the grammar force
# (and speculation draft for free) every separator; flexible whitespace lets a small model loop on
# newlines until max_tokens.
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "


# Keywords whose value is a schema, a list of schemas, or a map of names to schemas: where
# `closed_objects` looks for object schemas. Everything else (`const`, `enum`, `default`,
# `examples`, ...) is data and is never rewritten, even when it looks like a schema.
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object schema that lists `properties` and says nothing of others closed
    (`additionalProperties: false`): the reading of llama.cpp's converter, vLLM's xgrammar and
    OpenAI's strict mode. Plain JSON Schema (llguidance's reading) admits unlisted properties, which a
    small model fills with invented keys and loops inside their strings until max_tokens. A schema
    that says `additionalProperties` (true or a schema) or `unevaluatedProperties` keeps its word;
    `{"type": "object"}` without `properties` stays any object. The parts of an `allOf` are left open:
    closed, each would refuse the properties the others list. Returns a copy; the input is unchanged."""
    return _close(schema, in_all_of=False)


def _close(schema: Any, in_all_of: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = _close(out[key], False)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, False) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        parts = out["allOf"]
        out["allOf"] = [_close(s, len(parts) > 1) for s in parts]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s, False) for name, s in out[key].items()}
    if (
        isinstance(out.get("properties"), dict)
        and "additionalProperties" not in out
        and "unevaluatedProperties" not in out
        and not in_all_of
    ):
        out["additionalProperties"] = False
    return out


def _limits() -> LLParserLimits:
    # llguidance's defaults, stated so that a grammar checked in the gateway and compiled in the
    # engine meet the same bounds; the per-token fuel keeps a hostile grammar's mask cost bounded.
    return LLParserLimits(
        max_items_in_row=2000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
    )


def schema_depth(value: Any) -> int:
    """Nesting depth of a JSON value (iteratively: a hostile document must not exhaust the stack)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in node)
    return deepest


@dataclass(frozen=True, slots=True)
class Grammar:
    """What a request's output must match. `source` is the grammar's text: a JSON schema as JSON
    text, a regular expression, a JSON list of strings (choice), or Lark / GBNF text."""

    kind: str
    source: str
    # JSON only: the whitespace allowed between tokens; None: the fixed separators above.
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("a grammar needs a non-empty source")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise ValueError(f"a grammar may be at most {MAX_SOURCE_CHARS} characters long")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except RecursionError:  # text nested past the parser's stack: far past the limit below
                raise ValueError(
                    f"a JSON schema may be nested at most {MAX_SCHEMA_DEPTH} levels deep"
                ) from None
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            if schema_depth(schema) > MAX_SCHEMA_DEPTH:
                raise ValueError(f"a JSON schema may be nested at most {MAX_SCHEMA_DEPTH} levels deep")
        elif self.kind == "choice":
            choices = json.loads(self.source)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choice must be a non-empty list of strings")
            if len(choices) > MAX_CHOICES:
                raise ValueError(f"choice may hold at most {MAX_CHOICES} strings")
            if any(not c for c in choices):
                raise ValueError("choice strings must be non-empty")
        if self.whitespace_pattern is not None and self.kind != "json_schema":
            raise ValueError("whitespace_pattern applies to JSON schemas only")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any], whitespace_pattern: str | None = None) -> Grammar:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), whitespace_pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> Grammar:
        return cls("choice", json.dumps(list(choices)))

    def definition(self) -> str:
        """llguidance's grammar for this one (what its matcher is built from). Raises ValueError for
        a source its converter cannot read (a GBNF it cannot turn into Lark)."""
        if self.kind == "json_schema":
            # A schema's own `x-guidance` options come before these: it may not make llguidance
            # ignore keywords it cannot enforce (lenient) or read oneOf as anyOf (coerce_one_of).
            options: dict[str, Any] = {"whitespace_flexible": False, "lenient": False, "coerce_one_of": False}
            if self.whitespace_pattern is None:
                options.update(item_separator=ITEM_SEPARATOR, key_separator=KEY_SEPARATOR)
            else:
                options.update(whitespace_flexible=True, whitespace_pattern=self.whitespace_pattern)
            return LLMatcher.grammar_from_json_schema(self.source, overrides=options)  # type: ignore[arg-type]
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            # Each string literally, as one alternative: llguidance's Lark takes JSON string literals.
            alternatives = " | ".join(json.dumps(c) for c in json.loads(self.source))
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        if self.kind == "gbnf":
            return llguidance.grammar_from("gbnf", self.source)
        return LLMatcher.grammar_from_lark(self.source)


def check(grammar: Grammar, tokenizer: LLTokenizer | None = None) -> str | None:
    """Why the grammar cannot be enforced exactly (its first error or warning), or None. A warning
    counts as an error: it means llguidance would enforce less than the grammar says."""
    try:
        definition = grammar.definition()
    except ValueError as exc:
        return str(exc)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(definition, tokenizer, limits=_limits())
    if is_error or messages:
        return "; ".join(messages) or "the grammar is invalid"
    return None


class GrammarError(ValueError):
    """A grammar that cannot be compiled for this tokenizer."""


class GrammarCompiler:
    """Builds matchers for one tokenizer; compiled grammars are kept by their text (a bounded LRU) and
    each request gets a copy. Thread-safe: the engine core's loop and a caller's thread may both
    compile."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 64
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._cache: OrderedDict[tuple[str, str, str | None], LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> LLTokenizer:
        """llguidance's view of the tokenizer (built once, on first use: about a second for a 150k
        vocabulary)."""
        if self._tokenizer is None:
            from llguidance.hf import from_tokenizer

            self._tokenizer = from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        return self._tokenizer

    def matcher(self, grammar: Grammar) -> LLMatcher:
        """A fresh matcher for `grammar` at its start. Raises GrammarError for a grammar that does
        not compile."""
        key = (grammar.kind, grammar.source, grammar.whitespace_pattern)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
            tokenizer = self.tokenizer
        try:
            definition = grammar.definition()
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
        template = LLMatcher(tokenizer, definition, log_level=0, limits=_limits())
        if template.is_error():
            raise GrammarError(template.get_error())
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template.deep_copy()
