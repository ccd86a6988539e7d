"""Structured-output fields as grammars: each spelling, the 400s, and forced tool calls' grammar."""

from __future__ import annotations

import json
from typing import Any

import pytest
from llguidance import LLMatcher

from specgate.engine.structured_output.constraint import Constraint
from specgate.engine.structured_output.grammar import (
    MAX_SOURCE_CHARS,
    Grammar,
    GrammarCompiler,
    check,
    closed_objects,
)
from specgate.gateway.backends.embedded.structured import checked, requested_grammar, wants_json
from specgate.gateway.backends.embedded.tools import forced_tool, tool_call_lark
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from tests.conftest import VOCAB_SIZE, build_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "b": {"type": "object", "properties": {"c": {"type": "string"}}},
    },
    "required": ["a"],
}
# What the request path enforces: objects that list properties admit no others (peers' reading).
CLOSED = closed_objects(SCHEMA)
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]
GOOD_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}</tool_call>'


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MESSAGES, **fields)  # type: ignore[arg-type]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="a", **fields)


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _constraint(grammar: Grammar) -> tuple[Constraint, Any]:
    """The grammar's state at the start of an answer, on the tests' tokenizer (one token a character)."""
    tok = build_tokenizer()
    compiler = GrammarCompiler(tok, VOCAB_SIZE, [VOCAB_SIZE - 1])
    return Constraint(compiler.matcher(grammar), VOCAB_SIZE, [VOCAB_SIZE - 1]), tok


def refused(req: ChatCompletionRequest | CompletionRequest) -> GatewayError:
    """The 400 that requested_grammar, then checked, give the request."""
    with pytest.raises(GatewayError) as info:
        grammar, param = requested_grammar(req)
        assert grammar is not None
        checked(grammar, param)
    assert info.value.status == 400 and info.value.param
    return info.value


@pytest.mark.parametrize("make", [chat, completion])
def test_no_constraint_and_text_ask_for_no_grammar(make: Any) -> None:
    assert requested_grammar(make()) == (None, "")
    assert requested_grammar(make(response_format={"type": "text"})) == (None, "")
    assert not wants_json(make(response_format={"type": "text"}))


@pytest.mark.parametrize("make", [chat, completion])
def test_response_format_json_object_and_json_schema(make: Any) -> None:
    assert requested_grammar(make(response_format={"type": "json_object"})) == (
        Grammar.json_schema({"type": "object"}),
        "response_format",
    )
    for strict in (True, False):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "strict": strict, "schema": SCHEMA}}
        assert requested_grammar(make(response_format=fmt)) == (
            Grammar.json_schema(CLOSED),
            "response_format",
        )


def test_response_format_json_schema_as_text_or_true() -> None:
    text = {"type": "json_schema", "json_schema": {"name": "x", "schema": json.dumps(SCHEMA)}}
    assert requested_grammar(chat(response_format=text))[0] == Grammar.json_schema(CLOSED)
    anything = {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}
    assert requested_grammar(chat(response_format=anything))[0] == Grammar.json_schema({})


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "frob": 1}},
            "response_format.json_schema.frob",
        ),
        ({"type": "json_schema", "json_schema": {"schema": "{nope"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
    ],
)
def test_malformed_response_format_is_a_400(fmt: dict[str, Any], param: str) -> None:
    assert refused(chat(response_format=fmt)).param == param


@pytest.mark.parametrize("make", [chat, completion])
def test_structured_outputs_each_key(make: Any) -> None:
    def asked(**so: Any) -> Grammar | None:
        grammar, param = requested_grammar(make(structured_outputs=so))
        assert param == "structured_outputs"
        return grammar

    assert asked(json=SCHEMA) == Grammar.json_schema(CLOSED)
    assert asked(json=json.dumps(SCHEMA)) == Grammar.json_schema(CLOSED)
    assert asked(json=True) == Grammar.json_schema({})
    assert asked(regex=r"[0-9]{3}") == Grammar("regex", r"[0-9]{3}")
    assert asked(choice=["yes", "no"]) == Grammar.choice(["yes", "no"])
    assert asked(json_object=True) == Grammar.json_schema({"type": "object"})
    assert asked(json_object=True, whitespace_pattern=r"[ ]?") == Grammar.json_schema(
        {"type": "object"}, r"[ ]?"
    )
    assert asked(json=SCHEMA, disable_any_whitespace=True) == Grammar.json_schema(CLOSED)


@pytest.mark.parametrize("source", ['root ::= "yes" | "no"', 'start: "yes" | "no"'], ids=["gbnf", "lark"])
def test_structured_outputs_grammar_takes_gbnf_and_lark(source: str) -> None:
    grammar, param = requested_grammar(chat(structured_outputs={"grammar": source}))
    assert grammar == Grammar("gbnf", source) and param == "structured_outputs"
    assert checked(grammar, param) is grammar
    c, tok = _constraint(grammar)
    for text, accepted in (("yes", 3), ("no", 2), ("nope", 2), ("maybe", 0)):
        assert c.valid_prefix(tok.encode(text, add_special_tokens=False)) == accepted


def test_structural_tag_is_a_lark_grammar_that_checks() -> None:
    tag = {
        "structures": [{"begin": "<fn=a>", "schema": SCHEMA, "end": "</fn>"}],
        "triggers": ["<fn="],
    }
    for value in (tag, json.dumps(tag)):
        grammar, param = requested_grammar(chat(structured_outputs={"structural_tag": value}))
        assert grammar is not None and grammar.kind == "lark" and param == "structured_outputs"
        assert "<fn=" in grammar.source and "</fn>" in grammar.source
        assert checked(grammar, param) is grammar


@pytest.mark.parametrize(
    "tag",
    [
        {"structures": [], "triggers": ["<f"]},
        {"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": []},
        {"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<g"]},
        {"structures": [{"begin": "<f>"}], "triggers": ["<f"]},
        {"structures": [{"begin": "<f>", "end": "</f>", "schema": CYCLE}], "triggers": ["<f"]},
    ],
)
def test_malformed_structural_tags_are_400s(tag: dict[str, Any]) -> None:
    assert refused(chat(structured_outputs={"structural_tag": tag})).param.startswith(
        "structured_outputs.structural_tag"
    )


@pytest.mark.parametrize("make", [chat, completion])
def test_guided_fields_are_aliases(make: Any) -> None:
    assert requested_grammar(make(guided_json=SCHEMA)) == (Grammar.json_schema(CLOSED), "guided_json")
    assert requested_grammar(make(guided_regex="a+")) == (Grammar("regex", "a+"), "guided_regex")
    assert requested_grammar(make(guided_choice=["x", "y"])) == (Grammar.choice(["x", "y"]), "guided_choice")
    gbnf = 'root ::= "a" "b"*'
    assert requested_grammar(make(guided_grammar=gbnf)) == (Grammar("gbnf", gbnf), "guided_grammar")
    assert requested_grammar(make(guided_json=SCHEMA, guided_whitespace_pattern=r"[ \n]*")) == (
        Grammar.json_schema(CLOSED, r"[ \n]*"),
        "guided_json",
    )


def test_whitespace_pattern_without_json_is_a_400() -> None:
    assert refused(chat(guided_whitespace_pattern=" ")).param == "guided_whitespace_pattern"
    assert refused(chat(guided_regex="a", guided_whitespace_pattern=" ")).param == "guided_whitespace_pattern"
    assert refused(chat(structured_outputs={"regex": "a", "whitespace_pattern": " "})).param == (
        "structured_outputs"
    )
    contradiction = {"json": SCHEMA, "whitespace_pattern": " ", "disable_any_whitespace": True}
    assert refused(chat(structured_outputs=contradiction)).param == "structured_outputs"


def test_disable_additional_properties_closes_every_object_that_does_not_say() -> None:
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "string"}}},
            "open": {"type": "object", "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"y": {"type": "integer"}}}},
        },
    }
    grammar, _ = requested_grammar(
        chat(structured_outputs={"json": schema, "disable_additional_properties": True})
    )
    assert grammar is not None
    closed = json.loads(grammar.source)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is left as sent
    assert refused(chat(structured_outputs={"regex": "a", "disable_additional_properties": True})).param == (
        "structured_outputs"
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        ({"structured_outputs": {"choice": ["a"]}, "guided_json": SCHEMA}, "guided_json"),
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
        ({"structured_outputs": {"json": SCHEMA, "json_object": True}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
        ({"guided_json": SCHEMA, "guided_grammar": 'root ::= "a"'}, "guided_json"),
    ],
)
def test_two_constraints_are_a_400_naming_a_param(fields: dict[str, Any], param: str) -> None:
    for make in (chat, completion):
        error = refused(make(**fields))
        assert error.param == param and error.code == "invalid_value"


def test_only_llguidance_backends_are_accepted() -> None:
    for backend in ("auto", "guidance", "llguidance"):
        assert requested_grammar(chat(guided_regex="a", guided_decoding_backend=backend))[1] == "guided_regex"
        assert requested_grammar(completion(guided_decoding_backend=backend)) == (None, "")
    for backend in ("xgrammar", "outlines"):
        error = refused(chat(guided_regex="a", guided_decoding_backend=backend))
        assert error.param == "guided_decoding_backend" and error.code == "unsupported_parameter"
        assert refused(completion(guided_decoding_backend=backend)).param == "guided_decoding_backend"


@pytest.mark.parametrize(
    "schema",
    [
        CYCLE,
        {"$ref": "#"},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#"}}},
        {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
        {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}, "required": ["x"]},
        {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    ],
    ids=["self", "root", "through-root", "through-allOf", "required-property", "non-empty-array"],
)
def test_a_pure_reference_cycle_is_a_400(schema: dict[str, Any]) -> None:
    for fields, param in (
        ({"guided_json": schema}, "guided_json"),
        ({"structured_outputs": {"json": schema}}, "structured_outputs.json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}, "response_format"),
    ):
        error = refused(chat(**fields))
        assert error.param.startswith(param) and "refers to itself" in error.message


def test_a_recursive_schema_with_a_way_out_is_accepted() -> None:
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    grammar, param = requested_grammar(chat(guided_json=tree))
    assert grammar is not None and checked(grammar, param) is grammar


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ],
)
def test_what_llguidance_cannot_enforce_is_an_invalid_grammar_400(
    schema: dict[str, Any], reason: str
) -> None:
    for fields, param in (
        ({"guided_json": schema}, "guided_json"),
        ({"structured_outputs": {"json": schema}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            "response_format",
        ),
    ):
        grammar, asked = requested_grammar(chat(**fields))
        assert grammar is not None and asked == param
        with pytest.raises(GatewayError) as info:
            checked(grammar, asked)
        assert info.value.status == 400 and info.value.code == "invalid_grammar"
        assert info.value.param == param and reason in info.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "(a"}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "this is not a grammar"}}, "structured_outputs"),
    ],
)
def test_bad_regexes_and_grammars_are_invalid_grammar_400s(fields: dict[str, Any], param: str) -> None:
    error = refused(completion(**fields))
    assert error.param == param and error.code == "invalid_grammar"


def test_a_schema_nested_40_deep_is_a_400() -> None:
    deep = nested(40)
    for fields in (
        {"guided_json": deep},
        {"structured_outputs": {"json": deep}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": deep}}},
    ):
        error = refused(chat(**fields))
        assert "nested" in error.message and error.code == "invalid_value"
    shallow, param = requested_grammar(chat(guided_json=nested(20)))
    assert shallow is not None and checked(shallow, param) is shallow


HUGE = {
    "type": "object",
    "properties": {f"p{i:05d}": {"type": "string", "description": "x" * 100} for i in range(1200)},
}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_json": HUGE}, "guided_json"),
        ({"structured_outputs": {"json": HUGE}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": HUGE}}}, "response_format"),
        (
            {
                "structured_outputs": {
                    "structural_tag": {
                        "structures": [{"begin": "<f>", "schema": HUGE, "end": "</f>"}],
                        "triggers": ["<f"],
                    }
                }
            },
            "structured_outputs",
        ),
    ],
    ids=["guided_json", "structured_outputs.json", "response_format", "structural_tag"],
)
def test_a_schema_object_over_the_size_limit_is_a_400(fields: dict[str, Any], param: str) -> None:
    """A schema sent as an object is not bounded by the request model: its JSON text over the
    grammar's limit must be a 400 naming the parameter, not a ValueError (a 500 over HTTP)."""
    assert len(json.dumps(HUGE)) > MAX_SOURCE_CHARS
    assert refused(chat(**fields)).param.startswith(param)


def test_a_schema_text_over_the_size_limit_is_refused_by_the_request_model() -> None:
    with pytest.raises(ValueError, match="guided_json"):
        chat(guided_json=json.dumps(HUGE))


def test_wants_json() -> None:
    assert wants_json(chat(response_format={"type": "json_object"}))
    assert wants_json(chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}))
    assert wants_json(completion(guided_json=SCHEMA))
    assert wants_json(completion(structured_outputs={"json": SCHEMA}))
    assert wants_json(chat(structured_outputs={"json_object": True}))
    assert not wants_json(chat())
    assert not wants_json(chat(guided_regex="a"))
    assert not wants_json(chat(structured_outputs={"choice": ["a"]}))
    assert not wants_json(chat(structured_outputs={"regex": "a", "json_object": False}))


# ---- forced tool calls ------------------------------------------------------------------------


def test_forced_tool_choices() -> None:
    functions = [t["function"] for t in TOOLS]
    assert forced_tool(TOOLS, "required") == functions
    assert forced_tool(TOOLS, {"type": "function", "function": {"name": "noop"}}) == [functions[1]]
    for choice in (None, "auto", "none"):
        assert forced_tool(TOOLS, choice) is None
    with pytest.raises(ValueError, match="not in tools"):
        forced_tool(TOOLS, {"type": "function", "function": {"name": "elsewhere"}})
    with pytest.raises(ValueError, match="needs tools"):
        forced_tool(None, "required")
    with pytest.raises(ValueError, match="not in tools"):
        forced_tool(None, {"type": "function", "function": {"name": "noop"}})
    for malformed in (
        {"type": "function"},
        {"type": "tool", "function": {"name": "noop"}},
        {"function": "noop"},
    ):
        with pytest.raises(ValueError, match="named tool_choice"):
            forced_tool(TOOLS, malformed)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("native", [False, True])
def test_tool_call_lark_validates_under_llguidance(parallel: bool, native: bool) -> None:
    functions = forced_tool(TOOLS, "required")
    assert functions is not None
    lark = tool_call_lark(functions, parallel=parallel, native=native)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_lark(lark))
    assert not is_error and messages == []
    assert check(Grammar("lark", lark)) is None


def test_tool_call_grammar_accepts_a_well_formed_call_and_refuses_a_wrong_argument_type() -> None:
    functions = forced_tool(TOOLS, "required")
    assert functions is not None
    c, tok = _constraint(Grammar("lark", tool_call_lark(functions, parallel=False, native=False)))

    def accepted(text: str) -> int:
        return c.valid_prefix(tok.encode(text, add_special_tokens=False))

    assert accepted(GOOD_CALL) == len(GOOD_CALL)  # one token per character
    noop = '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'  # no parameters: any object
    assert accepted(noop) == len(noop)
    wrong_type = GOOD_CALL.replace('"days": 3', '"days": "3"')
    assert accepted(wrong_type) == wrong_type.index('"3"')
    out_of_range = GOOD_CALL.replace('"days": 3', '"days": 8')
    assert accepted(out_of_range) == out_of_range.index("8")
    unknown = '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
    assert accepted(unknown) == len('<tool_call>{"name": "')
    spaced = GOOD_CALL.replace('"city": ', '"city":')  # the separators are fixed
    assert accepted(spaced) < len(spaced)
    # The frame up to the name is forced; one whole call completes the answer.
    assert tok.decode(c.forced(100)) == '<tool_call>{"name": "'
    c.advance(tok.encode(GOOD_CALL, add_special_tokens=False))
    assert c.stopped


def test_parallel_tool_calls_leave_room_for_another_call() -> None:
    functions = forced_tool(TOOLS, "required")
    assert functions is not None
    c, tok = _constraint(Grammar("lark", tool_call_lark(functions, parallel=True, native=False)))
    c.advance(tok.encode(GOOD_CALL, add_special_tokens=False))
    assert not c.stopped  # a newline and another call may follow (the tests' vocabulary has no newline)
    allowed = c.allowed_after([])
    assert allowed is not None and allowed.nonzero().flatten().tolist() == [VOCAB_SIZE - 1]


def test_a_named_tool_grammar_allows_only_that_function() -> None:
    functions = forced_tool(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert functions is not None
    c, tok = _constraint(Grammar("lark", tool_call_lark(functions, parallel=False, native=False)))
    assert tok.decode(c.forced(100)) == '<tool_call>{"name": "get_weather", "arguments": {"city": "'
    noop = '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
    assert c.valid_prefix(tok.encode(noop, add_special_tokens=False)) < len(noop)
    assert c.valid_prefix(tok.encode(GOOD_CALL, add_special_tokens=False)) == len(GOOD_CALL)


@pytest.mark.parametrize(
    "schema",
    [
        {"definitions": {"a": {"$ref": "#/definitions/b"}, "b": {"$ref": "#/definitions/a", "title": "b"}}},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "type": "object"},
        {"type": "array", "items": {"$ref": "#"}},
        {"type": "object", "properties": {"x": {"$ref": "#"}}},
    ],
    ids=["unused-cycle", "unused-cycle-object", "empty-array-ends-it", "optional-property-ends-it"],
)
def test_a_cycle_a_value_can_avoid_is_accepted(schema: dict[str, Any]) -> None:
    """Only a cycle every value must follow is refused: an unused definition, or recursion through an
    optional property or a possibly empty array, leaves finite values."""
    grammar, _ = requested_grammar(completion(guided_json=schema))
    assert grammar is not None
    checked(grammar, "guided_json")


def test_structured_outputs_keys_the_engine_does_not_know_are_400s() -> None:
    """They reach external backends as sent; the embedded engine names the first one it refuses."""
    error = refused_early(completion(structured_outputs={"regex": "a+", "newer_vllm_key": 1}))
    assert error.param == "structured_outputs.newer_vllm_key" and error.code == "unsupported_parameter"


def refused_early(req: ChatCompletionRequest | CompletionRequest) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        requested_grammar(req)
    assert info.value.status == 400
    return info.value


def test_tool_tags_one_token_each_are_named_by_id() -> None:
    """Qwen's tokenizer holds `<tool_call>` as one added token, which llguidance reads as a special
    token, not as its text: the grammars name it by id there, and by its text elsewhere."""
    from specgate.gateway.backends.embedded.tools import tag_markers, tool_tags_lark

    class OneToken:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return {"<tool_call>": [7], "</tool_call>": [8]}.get(text, [1, 2])

    assert tag_markers(OneToken()) == ("<[7]>", "<[8]>")
    assert tag_markers(build_tokenizer()) == ('"<tool_call>"', '"</tool_call>"')
    functions = [{"name": "f", "parameters": {"type": "object"}}]
    assert "<[7]>" in tool_call_lark(functions, True, True, ("<[7]>", "<[8]>"))
    assert tool_tags_lark(functions, True, ("<[7]>", "<[8]>")).count("<[8]>") == 1


@pytest.mark.parametrize("field", ["guided_json", "structural_tag"])
def test_schema_text_nested_past_the_parser_is_a_400(field: str) -> None:
    """JSON text inside a string escapes the body's nesting limit; parsing it must not be a 500."""
    deep = "[" * 50_000 + "]" * 50_000
    fields: dict[str, Any] = (
        {"guided_json": deep} if field == "guided_json" else {"structured_outputs": {"structural_tag": deep}}
    )
    error = refused_early(completion(**fields))
    assert error.code == "invalid_value" and "nested" in error.message


def test_a_grammar_of_schema_text_nested_past_the_parser_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="nested"):
        Grammar("json_schema", "[" * 50_000 + "]" * 50_000)


# ---- every spelling: enforced or refused (C2) ------------------------------------------------------

ONE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
ONE_CLOSED = {**ONE, "additionalProperties": False}
WRAPPED = {"name": "x", "schema": ONE}


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize(
    ("fields", "param", "expected"),
    [
        # OpenAI; LangChain method="json_schema"; pydantic-ai NativeOutput
        (
            {"response_format": {"type": "json_schema", "json_schema": {**WRAPPED, "strict": True}}},
            "response_format",
            Grammar.json_schema(ONE_CLOSED),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {**WRAPPED, "strict": False}}},
            "response_format",
            Grammar.json_schema(ONE_CLOSED),
        ),
        # OpenAI json mode; instructor JSON; LangChain method="json_mode"
        (
            {"response_format": {"type": "json_object"}},
            "response_format",
            Grammar.json_schema({"type": "object"}),
        ),
        # llama.cpp / Together / Fireworks; instructor JSON_SCHEMA
        (
            {"response_format": {"type": "json_object", "schema": ONE}},
            "response_format",
            Grammar.json_schema(ONE_CLOSED),
        ),
        (
            {"response_format": {"type": "json_object", "json_schema": WRAPPED}},
            "response_format",
            Grammar.json_schema(ONE_CLOSED),
        ),
        # llama.cpp's top-level fields
        ({"json_schema": ONE}, "json_schema", Grammar.json_schema(ONE_CLOSED)),
        ({"json_schema": json.dumps(ONE)}, "json_schema", Grammar.json_schema(ONE_CLOSED)),
        ({"grammar": 'root ::= "a" | "b"'}, "grammar", Grammar("gbnf", 'root ::= "a" | "b"')),
        # vLLM
        ({"structured_outputs": {"json": ONE}}, "structured_outputs", Grammar.json_schema(ONE_CLOSED)),
        ({"guided_json": ONE}, "guided_json", Grammar.json_schema(ONE_CLOSED)),
    ],
    ids=[
        "json_schema-strict",
        "json_schema-lax",
        "json_object",
        "json_object+schema",
        "json_object+json_schema",
        "llama-json_schema",
        "llama-json_schema-text",
        "llama-grammar",
        "so-json",
        "guided_json",
    ],
)
def test_every_json_spelling_asks_for_its_schema_closed(
    make: Any, fields: dict[str, Any], param: str, expected: Grammar
) -> None:
    grammar, asked = requested_grammar(make(**fields))
    assert (grammar, asked) == (expected, param)
    assert grammar is not None and checked(grammar, asked) is grammar
    assert wants_json(make(**fields)) == (expected.kind == "json_schema")


def test_response_format_structural_tag_is_vllms() -> None:
    tag = {"structures": [{"begin": "<f>", "schema": ONE, "end": "</f>"}], "triggers": ["<f"]}
    grammar, param = requested_grammar(chat(response_format={"type": "structural_tag", **tag}))
    assert param == "response_format" and grammar is not None and grammar.kind == "lark"
    same, _ = requested_grammar(chat(structured_outputs={"structural_tag": tag}))
    assert grammar == same
    checked(grammar, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "text", "schema": ONE}}, "response_format.schema"),
        ({"response_format": {"schema": ONE}}, "response_format.schema"),  # no type: text
        ({"response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
        (
            {"response_format": {"type": "json_schema", "json_schema": WRAPPED, "schema": ONE}},
            "response_format.schema",
        ),
        ({"response_format": {"type": "json_schema", "schema": ONE}}, "response_format.schema"),
        (
            {"response_format": {"type": "json_object", "schema": ONE, "json_schema": WRAPPED}},
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "json_object", "json_schema": ONE}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {**WRAPPED, "strict": "yes"}}},
            "response_format.json_schema.strict",
        ),
        ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format.format"),
        ({"response_format": {"type": "regex"}}, "response_format.type"),
        ({"response_format": {"type": "json_object", "schema": [1]}}, "response_format.schema"),
        ({"response_format": {"type": "json_object", "schema": CYCLE}}, "response_format.schema"),
        ({"json_schema": "[1]"}, "json_schema"),
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "json_schema"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"json_schema": ONE, "response_format": {"type": "json_object"}}, "json_schema"),
        ({"grammar": 'root ::= "a"', "guided_regex": "a"}, "grammar"),
        ({"structured_outputs": {"disable_additional_properties": False}}, "structured_outputs"),
        (
            {"structured_outputs": {"disable_additional_properties": False}, "grammar": 'root ::= "a"'},
            "structured_outputs",
        ),
        (
            {
                "structured_outputs": {"whitespace_pattern": " "},
                "guided_json": ONE,
                "guided_whitespace_pattern": " ",
            },
            "guided_whitespace_pattern",
        ),
    ],
)
def test_every_refused_spelling_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    for make in (chat, completion):
        assert refused(make(**fields)).param == param


def test_unlisted_properties_are_refused_by_default_and_allowed_by_the_option() -> None:
    """The grammar itself, on the tests' tokenizer: `{"a": 1, "b": 2}` is cut at the ',' under the
    default reading; with disable_additional_properties false (plain JSON Schema) it is whole."""
    extra = '{"a": 1, "b": 2}'
    fmt = {"type": "json_schema", "json_schema": WRAPPED}
    closed, _ = requested_grammar(chat(response_format=fmt))
    opened, _ = requested_grammar(
        chat(response_format=fmt, structured_outputs={"disable_additional_properties": False})
    )
    said, _ = requested_grammar(chat(json_schema={**ONE, "additionalProperties": {"type": "integer"}}))
    assert closed is not None and opened is not None and said is not None
    assert json.loads(opened.source) == ONE  # as sent
    for grammar, accepted in ((closed, extra.index(",")), (opened, len(extra)), (said, len(extra))):
        c, tok = _constraint(grammar)
        assert c.valid_prefix(tok.encode(extra, add_special_tokens=False)) == accepted
    # disable_additional_properties true says what is the default.
    same, _ = requested_grammar(
        chat(response_format=fmt, structured_outputs={"disable_additional_properties": True})
    )
    assert same == closed


def test_json_options_tune_every_json_spelling() -> None:
    ws = {"whitespace_pattern": r"[ ]?"}
    for fields in (
        {"response_format": {"type": "json_object", "schema": ONE}},
        {"json_schema": ONE},
        {"guided_json": ONE},
    ):
        grammar, _ = requested_grammar(chat(**fields, structured_outputs=ws))
        assert grammar == Grammar.json_schema(ONE_CLOSED, r"[ ]?")


def test_tool_arguments_admit_no_unlisted_properties() -> None:
    open_tool = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
            },
        }
    ]
    functions = forced_tool(open_tool, "required")
    assert functions is not None
    c, tok = _constraint(Grammar("lark", tool_call_lark(functions, parallel=False, native=False)))
    call = '<tool_call>{"name": "f", "arguments": {"x": 1, "y": 2}}</tool_call>'
    assert c.valid_prefix(tok.encode(call, add_special_tokens=False)) == call.index(', "y"')
