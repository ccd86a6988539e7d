"""Structured outputs on the embedded engine, through the official openai client.

The tiny model's weights are random, so the tests assert what the grammar guarantees (the output
parses, matches, validates), never what it says.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import jsonschema_rs
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from transformers import LlamaConfig, LlamaForCausalLM

from tests.conftest import build_tokenizer, tiny_config_kwargs

MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "pick",
            "description": "Pick a digit.",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "tag",
            "parameters": {
                "type": "object",
                "properties": {"t": {"enum": ["a", "b"]}, "note": {"type": "string", "maxLength": 6}},
                "required": ["t", "note"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=9)


PET_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "pet", "strict": True, "schema": Pet.model_json_schema()},
}


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared tiny Llama's weights with a 1024-token context: a template without tool support
    gets the tools as a system message of about 700 tokens, more than the usual 512 hold."""
    torch.manual_seed(0)  # as the shared one: the same weights (the context length adds none)
    config = LlamaConfig(**{**tiny_config_kwargs(), "max_position_embeddings": 1024})
    path = tmp_path_factory.mktemp("tiny-llama-1k")
    LlamaForCausalLM(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def token_id(char: str) -> str:
    """The tiny vocabulary's id of a printable ASCII character (one token each, from ' ')."""
    return str(ord(char) - 32)


def bad_request(call: Callable[[], Any]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body: dict[str, Any] = info.value.body  # type: ignore[assignment]
    return body


# ---- JSON ----------------------------------------------------------------------------------------


def test_parse_with_a_pydantic_model(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.parse(
        model=model_name, messages=MESSAGES, response_format=Pet, max_tokens=150, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert choice.message.parsed == Pet.model_validate_json(choice.message.content or "")


def test_stream_with_a_pydantic_model(client: openai.OpenAI, model_name: str) -> None:
    ref = client.chat.completions.parse(
        model=model_name, messages=MESSAGES, response_format=Pet, max_tokens=150, temperature=0
    )
    with client.chat.completions.stream(
        model=model_name, messages=MESSAGES, response_format=Pet, max_tokens=150, temperature=0
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "content.done" in events
    choice = final.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet)
    assert choice.message.parsed == ref.choices[0].message.parsed


def test_streamed_deltas_concatenate_to_json(client: openai.OpenAI, model_name: str) -> None:
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            response_format=PET_FORMAT,  # type: ignore[arg-type]
            max_tokens=150,
            temperature=0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert sum(1 for d in deltas if d) > 1  # it did stream
    Pet.model_validate(json.loads("".join(deltas)))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]


def test_json_object(client: openai.OpenAI, model_name: str) -> None:
    # The random model's strings seldom close by themselves: a nudge toward '"' and '}' (the
    # grammar still decides which of them may come) keeps the answer short.
    bias = {token_id('"'): 3, token_id("}"): 3}
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_object"},
        logit_bias=bias,  # type: ignore[arg-type]
        max_tokens=60,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    c = client.completions.create(
        model=model_name,
        prompt="hi",
        logit_bias=bias,  # type: ignore[arg-type]
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert c.choices[0].finish_reason == "stop" and isinstance(json.loads(c.choices[0].text), dict)


def test_json_schema_on_completions(client: openai.OpenAI, model_name: str) -> None:
    for extra in (
        {"response_format": PET_FORMAT},
        {"structured_outputs": {"json": Pet.model_json_schema()}},
        {"guided_json": Pet.model_json_schema()},
    ):
        r = client.completions.create(
            model=model_name, prompt="A pet:", max_tokens=150, temperature=0, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop"
        Pet.model_validate_json(r.choices[0].text)


def test_max_tokens_cuts_a_json_answer(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        response_format=PET_FORMAT,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert (r.choices[0].message.content or "").startswith('{"name": "')


# ---- every client's spelling (C2) ------------------------------------------------------------------

PET_SCHEMA = Pet.model_json_schema()
PET_REQUIRED = set(PET_SCHEMA["required"])
# Pet without additionalProperties (pydantic writes none): only the default reading closes it.
assert "additionalProperties" not in PET_SCHEMA


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object", "schema": PET_SCHEMA}},  # llama.cpp, instructor
        {"response_format": {"type": "json_object", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}},
        {"json_schema": PET_SCHEMA},  # llama.cpp's top-level field
        {"response_format": {**PET_FORMAT, "json_schema": {**PET_FORMAT["json_schema"], "strict": False}}},
    ],
    ids=["json_object+schema", "json_object+json_schema", "llama-json_schema", "json_schema-lax"],
)
def test_each_schema_spelling_is_enforced(
    client: openai.OpenAI, model_name: str, extra: dict[str, Any]
) -> None:
    chat = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=150, temperature=0, extra_body=extra
    )
    text = client.completions.create(
        model=model_name, prompt="A pet:", max_tokens=150, temperature=0, extra_body=extra
    )
    for answer, finish in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                           (text.choices[0].text, text.choices[0].finish_reason)):  # fmt: skip
        assert finish == "stop"
        value = json.loads(answer or "")
        assert set(value) == PET_REQUIRED  # every required field, nothing else
        Pet.model_validate(value)


def test_llama_cpp_grammar_field_is_enforced(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"grammar": GBNF}
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content in ("yes", "no")


ONE_DIGIT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
}


def test_unlisted_properties_only_when_the_option_allows_them(client: openai.OpenAI, model_name: str) -> None:
    """A schema with one property, a prompt that asks for more, and a bias toward ',' (which would
    open another property) and '"': by default the answer is that one property; with
    disable_additional_properties false (plain JSON Schema) the same request writes another key."""
    invite = [{"role": "user", "content": "Describe a pet as JSON: n, name, kind, age, colour, owner."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "one", "schema": ONE_DIGIT}}

    def answer(**extra: Any) -> tuple[str, str]:
        r = client.chat.completions.create(
            model=model_name,
            messages=invite,  # type: ignore[arg-type]
            response_format=fmt,  # type: ignore[arg-type]
            logit_bias={token_id(","): 20, token_id('"'): 5},  # type: ignore[arg-type]
            max_tokens=40,
            temperature=0,
            extra_body=extra,
        )
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    closed, finish = answer()
    assert finish == "stop" and re.fullmatch(r'\{"n": [0-9]\}', closed), closed
    opened, _ = answer(structured_outputs={"disable_additional_properties": False})
    assert re.match(r'\{"n": [0-9], "', opened), opened


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "text", "schema": ONE_DIGIT}}, "response_format.schema"),
        ({"response_format": {"type": "json_object", "strict": True}}, "response_format.strict"),
        ({"response_format": {"type": "json_schema", "schema": ONE_DIGIT}}, "response_format.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"json_schema": ONE_DIGIT, "grammar": 'root ::= "a"'}, "grammar"),
        ({"structured_outputs": {"disable_additional_properties": False}}, "structured_outputs"),
        ({"grammar_lazy": True}, "grammar_lazy"),  # llama.cpp's tool-call internals
    ],
)
def test_each_refused_spelling_is_a_400_naming_the_field(
    client: openai.OpenAI, model_name: str, extra: dict[str, Any], param: str
) -> None:
    body = bad_request(
        lambda: client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=8, extra_body=extra
        )
    )
    assert body["param"] == param, body


# ---- regex, choice, grammar --------------------------------------------------------------------

REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe"]
GBNF = 'root ::= "yes" | "no"'


@pytest.mark.parametrize(
    ("extra", "ok"),
    [
        ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) is not None),
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"structured_outputs": {"grammar": GBNF}}, lambda t: t in ("yes", "no")),
        ({"guided_grammar": GBNF}, lambda t: t in ("yes", "no")),
        ({"guided_grammar": 'start: "on" | "off"'}, lambda t: t in ("on", "off")),
    ],
    ids=["so-regex", "guided-regex", "so-choice", "guided-choice", "so-gbnf", "guided-gbnf", "guided-lark"],
)
def test_regex_choice_and_grammar_on_both_endpoints(
    client: openai.OpenAI, model_name: str, extra: dict[str, Any], ok: Callable[[str], bool]
) -> None:
    chat = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=16, temperature=0, extra_body=extra
    )
    assert chat.choices[0].finish_reason == "stop"
    assert ok(chat.choices[0].message.content or ""), chat.choices[0].message.content
    text = client.completions.create(
        model=model_name, prompt="Answer:", max_tokens=16, temperature=0, extra_body=extra
    )
    assert text.choices[0].finish_reason == "stop"
    assert ok(text.choices[0].text), text.choices[0].text


def test_logprobs_under_a_regex(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"guided_regex": REGEX},
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content
    assert "".join(t.token for t in lp.content) == r.choices[0].message.content
    for t in lp.content:
        assert math.isfinite(t.logprob) and t.logprob <= 0


def test_top_logprobs_beyond_the_allowed_tokens_are_numbers(client: openai.OpenAI, model_name: str) -> None:
    """Asking for more alternatives than the grammar allows (two here) must not put a non-number
    (JSON null for -inf) where OpenAI's schema has a logprob."""
    chat = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"guided_regex": "[ab]{3}"},
    )
    lp = chat.choices[0].logprobs
    assert lp is not None and lp.content
    for t in lp.content:
        for alt in t.top_logprobs:
            assert isinstance(alt.logprob, float) and alt.logprob <= 0, (alt.token, alt.logprob)
    text = client.completions.create(
        model=model_name,
        prompt="x",
        max_tokens=5,
        temperature=0,
        logprobs=5,
        extra_body={"guided_regex": "[ab]{3}"},
    )
    tlp = text.choices[0].logprobs
    assert tlp is not None and tlp.top_logprobs
    for alternatives in tlp.top_logprobs:
        assert all(isinstance(v, float) and v <= 0 for v in alternatives.values()), alternatives


@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 3}])
def test_eos_rules_contradicting_a_grammar_are_400s(
    client: openai.OpenAI, model_name: str, extra: dict[str, Any]
) -> None:
    calls: list[Callable[[], Any]] = [
        lambda: client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=8, extra_body={**extra, "guided_regex": "a+"}
        ),
        lambda: client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=8,
            response_format={"type": "json_object"},
            extra_body=extra,
        ),
        lambda: client.completions.create(
            model=model_name, prompt="a", max_tokens=8, extra_body={**extra, "guided_choice": ["a"]}
        ),
    ]
    for call in calls:
        body = bad_request(call)
        assert next(iter(extra)) in body["message"] and "grammar" in body["message"]


# ---- forced tool calls ---------------------------------------------------------------------------


def _check_calls(message: Any, names: set[str]) -> list[Any]:
    calls = message.tool_calls or []
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names
        jsonschema_rs.validate(SCHEMAS[call.function.name], json.loads(call.function.arguments))
    return calls


@pytest.mark.parametrize("parallel", [None, True, False])
def test_tool_choice_required(client: openai.OpenAI, model_name: str, parallel: bool | None) -> None:
    kw: dict[str, Any] = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_tokens=120,
        temperature=0,
        **kw,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    calls = _check_calls(r.choices[0].message, set(SCHEMAS))
    if parallel is False:
        assert len(calls) == 1


@pytest.mark.parametrize("name", ["pick", "tag"])
def test_named_tool_choice(client: openai.OpenAI, model_name: str, name: str) -> None:
    for parallel in (True, False):
        r = client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": name}},
            parallel_tool_calls=parallel,
            max_tokens=120,
            temperature=0,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        # A named function is called exactly once, parallel_tool_calls or not (OpenAI's and vLLM's).
        assert len(_check_calls(r.choices[0].message, {name})) == 1


def test_streamed_forced_tool_call(client: openai.OpenAI, model_name: str) -> None:
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "tag"}},
            max_tokens=120,
            temperature=0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert len(calls) == 1 and calls[0].function is not None and calls[0].function.name == "tag"
    jsonschema_rs.validate(SCHEMAS["tag"], json.loads(calls[0].function.arguments or ""))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


def test_a_forced_tool_call_cut_short_ends_by_length(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_tokens=20,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length"
    assert not r.choices[0].message.tool_calls
    assert r.usage is not None and r.usage.completion_tokens == 20


def test_tool_choice_refusals(client: openai.OpenAI, model_name: str) -> None:
    def chat(**kw: Any) -> Any:
        return client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=8, **kw)

    missing = {"type": "function", "function": {"name": "elsewhere"}}
    assert bad_request(lambda: chat(tools=TOOLS, tool_choice=missing))["param"] == "tool_choice"
    both = bad_request(
        lambda: chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    )
    assert both["param"] == "tool_choice"
    unenforceable = [
        {
            "type": "function",
            "function": {"name": "u", "parameters": {"type": "array", "uniqueItems": True}},
        }
    ]
    body = bad_request(lambda: chat(tools=unenforceable, tool_choice="required"))
    assert body["param"] == "tools" and body["code"] == "invalid_grammar"
    # With tool_choice auto too: the calls a model opens follow the tools' schemas.
    body = bad_request(lambda: chat(tools=unenforceable))
    assert body["param"] == "tools" and body["code"] == "invalid_grammar"


# ---- hostile requests ---------------------------------------------------------------------------


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


HUGE = {
    "type": "object",
    "properties": {f"p{i:05d}": {"type": "string", "description": "x" * 100} for i in range(1200)},
}
HOSTILE: dict[str, dict[str, Any]] = {
    "deep": {"guided_json": _nested(40)},
    "deep-response-format": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": _nested(40)}}
    },
    "huge-object": {"guided_json": HUGE},
    "huge-text": {"structured_outputs": {"json": json.dumps(HUGE)}},
    "cycle": {"structured_outputs": {"json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}},
    "unique-items": {"guided_json": {"type": "array", "uniqueItems": True}},
    "unknown-format": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "f", "schema": {"type": "string", "format": "no-such-format"}},
        }
    },
    "bad-regex": {"guided_regex": "(a"},
    "undefined-rule": {"structured_outputs": {"grammar": 'start: a b\na: "x"'}},
    "two-constraints": {"guided_regex": "a", "guided_choice": ["a"]},
}


@pytest.mark.slow
def test_hostile_grammars_are_400s_and_leave_a_running_stream_alone(
    client: openai.OpenAI, model_name: str
) -> None:
    victim_kw: dict[str, Any] = dict(
        model=model_name,
        messages=[{"role": "user", "content": "tell me a long story"}],
        max_tokens=200,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    victim: dict[str, Any] = {}
    started, attacked = threading.Event(), threading.Event()

    def run_victim() -> None:
        text, finishes = [], []
        for chunk in client.chat.completions.create(
            **victim_kw, stream=True, stream_options={"include_usage": True}
        ):
            if not started.is_set():
                started.set()
                attacked.wait(30)  # the stream stays open until every attack is answered
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                if chunk.choices[0].finish_reason:
                    finishes.append(chunk.choices[0].finish_reason)
            if chunk.usage is not None:
                victim["tokens"] = chunk.usage.completion_tokens
        victim.update(text="".join(text), finishes=finishes)

    def attack(name: str) -> tuple[str, int | None, str | None]:
        try:
            client.chat.completions.create(
                model=model_name, messages=MESSAGES, max_tokens=16, temperature=0, extra_body=HOSTILE[name]
            )
        except openai.APIStatusError as exc:
            body: Any = exc.body
            return name, exc.status_code, body.get("param") if isinstance(body, dict) else None
        return name, 200, None

    thread = threading.Thread(target=run_victim)
    thread.start()
    assert started.wait(30)
    names = [*HOSTILE, *HOSTILE]
    with ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(attack, names))
    attacked.set()
    thread.join(60)
    assert not thread.is_alive()
    assert victim["finishes"] == ["length"] and victim["tokens"] == 200
    alone = client.chat.completions.create(**victim_kw)
    assert victim["text"] == alone.choices[0].message.content
    # Every hostile request is a 400 that names the parameter at fault.
    assert [(name, status, param) for name, status, param in results if status != 400 or not param] == []


def test_a_reference_cycle_through_the_root_is_a_400(client: openai.OpenAI, model_name: str) -> None:
    """#/$defs/a refers to # which refers to #/$defs/a: no value matches, like the $defs-only cycle
    that is refused; it must not reach the engine (which fails the request with a 500)."""
    schema = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#"}}}
    body = bad_request(
        lambda: client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=8, extra_body={"guided_json": schema}
        )
    )
    assert body["param"]
