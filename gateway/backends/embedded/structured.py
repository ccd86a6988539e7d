"""Structured outputs on the embedded engine: the one grammar a request's fields ask for, checked.

Every spelling the common clients send reaches here, and each is either enforced or refused (a 400
naming the field), never silently dropped: OpenAI's `response_format` (text, json_object,
json_schema; json_object with a `schema` is llama.cpp's, Together's and Fireworks' form, and
instructor's JSON_SCHEMA mode), vLLM's `structured_outputs` (json, regex, choice, grammar,
json_object, structural_tag) and its older `guided_*` aliases, and llama.cpp's top-level
`json_schema` and `grammar` (GBNF). A forced `tool_choice` ("required" or a named function) is a
grammar of the model's tool-call format (tools.py). A request may ask for one constraint; two are a
400, as is anything the grammar library would enforce only in part (an unsupported keyword, a
format it does not know), checked before the request reaches the engine.

JSON schemas are read as the peers read them (llama.cpp's converter, vLLM's xgrammar, OpenAI's
strict mode): an object schema that lists `properties` admits no others unless it says
`additionalProperties` (engine/structured_output/grammar.py `closed_objects`); `structured_outputs:
{"disable_additional_properties": false}` asks for plain JSON Schema instead, whichever field
carries the schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from specgate.engine.structured_output.grammar import (
    MAX_SCHEMA_DEPTH,
    Grammar,
    check,
    closed_objects,
    schema_depth,
)
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest, StructuredOutputs

# vLLM's guided_decoding_backend names that mean "whichever library the server has"; a request
# asking for a specific other one is told which one this server uses.
_ANY_BACKEND = ("auto", "guidance", "llguidance")


def _invalid(message: str, param: str) -> GatewayError:
    return GatewayError(400, message, code="invalid_value", param=param)


def _json_text(text: str, param: str) -> Any:
    """A field's value given as JSON text, parsed; a 400 for text that is not JSON, or that nests too
    deep for the parser (the body's own nesting limit does not reach inside a string)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _invalid(f"{param} is not valid JSON: {exc}", param) from None
    except RecursionError:
        raise _invalid(f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep", param) from None


def _schema(value: Any, param: str) -> Mapping[str, Any]:
    """A JSON schema given as an object, as true / false, or as its JSON text."""
    if isinstance(value, str):
        value = _json_text(value, param)
    if value is True:
        value = {}  # any JSON value
    if not isinstance(value, dict):
        raise _invalid(f"{param} must be a JSON schema (an object, or true)", param)
    if schema_depth(value) > MAX_SCHEMA_DEPTH:
        raise _invalid(f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep", param)
    cycle = _must_cycle(value)
    if cycle is not None:
        raise _invalid(
            f"{param} refers to itself with no value in between ({cycle[:100]}): no value matches it", param
        )
    return value


def _pointer(root: Any, ref: str) -> Any:
    """The schema a local `$ref` ("#", "#/$defs/a", "#/properties/x/items") points at, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _must_cycle(root: Mapping[str, Any]) -> str | None:
    """A schema that must contain itself: following only what every valid value must hold (a `$ref`,
    each `allOf` part, each required property, an array's items when it needs at least one) comes
    back to where it started, so no finite value matches and the grammar dead-ends mid-answer."""
    visiting: set[int] = set()
    done: set[int] = set()

    # Iterative depth-first search over schema objects (by identity); a frame is (node, its edges).
    def edges(node: Mapping[str, Any]) -> list[tuple[Any, str]]:
        out: list[tuple[Any, str]] = []
        ref = node.get("$ref")
        if isinstance(ref, str):
            out.append((_pointer(root, ref), ref))
        for part in node.get("allOf") or () if isinstance(node.get("allOf"), list) else ():
            out.append((part, "allOf"))
        props = node.get("properties")
        if isinstance(props, Mapping) and isinstance(node.get("required"), list):
            out.extend(
                (props[k], f"properties/{k}") for k in node["required"] if isinstance(k, str) and k in props
            )
        min_items = node.get("minItems")
        if isinstance(min_items, int) and min_items > 0 and isinstance(node.get("items"), Mapping):
            out.append((node["items"], "items"))
        return [(n, why) for n, why in out if isinstance(n, Mapping)]

    stack: list[tuple[Mapping[str, Any], list[tuple[Any, str]]]] = [(root, edges(root))]
    visiting.add(id(root))
    while stack:
        node, todo = stack[-1]
        if not todo:
            stack.pop()
            visiting.discard(id(node))
            done.add(id(node))
            continue
        child, why = todo.pop()
        if id(child) in visiting:
            return why
        if id(child) not in done:
            visiting.add(id(child))
            stack.append((child, edges(child)))
    return None


@dataclass(frozen=True, slots=True)
class _Json:
    """A JSON schema a field asks for, before the request's JSON options (whitespace, unlisted
    properties) make it a grammar: those may come from another field (structured_outputs)."""

    schema: Mapping[str, Any]


# The keys each response_format type takes; any other is refused rather than ignored (a schema
# beside "type": "text", a vendor option the engine does not implement).
_FORMAT_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type"}),
    # llama.cpp, Together and Fireworks put the schema beside the type; some clients wrap it as
    # json_schema does.
    "json_object": frozenset({"type", "schema", "json_schema"}),
    "json_schema": frozenset({"type", "json_schema"}),
    # vLLM's response_format spelling of structured_outputs.structural_tag.
    "structural_tag": frozenset({"type", "structures", "triggers"}),
}
_WRAPPER_KEYS = frozenset({"name", "schema", "strict", "description"})


def _wrapped(spec: Any, param: str) -> _Json:
    """OpenAI's json_schema object: {name, schema, strict, description}. Strict or not, the schema
    is enforced exactly (OpenAI's non-strict mode promises less)."""
    if not isinstance(spec, Mapping) or "schema" not in spec:
        raise _invalid(f"{param} needs a schema", param)
    unknown = sorted(set(spec) - _WRAPPER_KEYS)
    if unknown:
        raise _invalid(f"unknown keys in {param}: {', '.join(unknown)[:200]}", f"{param}.{unknown[0][:64]}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _invalid(f"{param}.strict must be true or false", f"{param}.strict")
    return _Json(_schema(spec["schema"], f"{param}.schema"))


def _from_response_format(fmt: Mapping[str, Any], param: str = "response_format") -> Grammar | _Json | None:
    """The one reading of a chat `response_format` (the Responses API's `text.format` is mapped onto
    it): each type's keys, and nothing else."""
    kind = fmt.get("type", "text")
    if not isinstance(kind, str) or kind not in _FORMAT_KEYS:
        raise _invalid(
            f"response_format type {str(kind)[:64]!r} is not one of {', '.join(_FORMAT_KEYS)}",
            f"{param}.type",
        )
    unknown = sorted(set(fmt) - _FORMAT_KEYS[kind])
    if unknown:
        raise GatewayError(
            400,
            f"{param}.{unknown[0][:64]} is not supported with type {kind!r} "
            f"(it takes {', '.join(sorted(_FORMAT_KEYS[kind]))})",
            code="unsupported_parameter",
            param=f"{param}.{unknown[0][:64]}",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        if "schema" in fmt and "json_schema" in fmt:
            raise _invalid(f"{param} may give schema or json_schema, not both", f"{param}.json_schema")
        if "schema" in fmt:
            return _Json(_schema(fmt["schema"], f"{param}.schema"))
        if "json_schema" in fmt:
            return _wrapped(fmt["json_schema"], f"{param}.json_schema")
        return _Json({"type": "object"})
    if kind == "json_schema":
        return _wrapped(fmt.get("json_schema"), f"{param}.json_schema")
    return _struct_tag({k: fmt[k] for k in ("structures", "triggers") if k in fmt}, param)


def _struct_tag(value: Mapping[str, Any] | str, param: str = "structured_outputs.structural_tag") -> Grammar:
    """vLLM's structural tag: free text in which each trigger opens a structure whose body follows a
    JSON schema, as a Lark grammar with lazy triggers (llguidance's StructTag)."""
    from llguidance import StructTag

    if isinstance(value, str):
        value = _json_text(value, param)
    if (
        not isinstance(value, Mapping)
        or not isinstance(value.get("structures"), list)
        or not value["structures"]
    ):
        raise _invalid(f"{param} needs a non-empty list of structures", param)
    triggers = value.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise _invalid(f"{param} needs a non-empty list of trigger strings", param)
    tags = []
    for s in value["structures"]:
        if not isinstance(s, Mapping) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise _invalid(f"each structure of {param} needs begin and end strings", param)
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise _invalid(
                f"the structure beginning {s['begin'][:64]!r} starts with none of the triggers", param
            )
        schema = closed_objects(_schema(s.get("schema", {"type": "object"}), f"{param}.schema"))
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=dict(schema), end=s["end"]))
    return Grammar("lark", StructTag.to_grammar(tags, assume_special=False))


def _from_structured(so: StructuredOutputs, param: str) -> Grammar | _Json | None:
    unknown = sorted(so.model_extra or {})
    if unknown:
        raise GatewayError(
            400,
            f"{param} keys not supported by the embedded engine: {', '.join(unknown)[:200]}",
            code="unsupported_parameter",
            param=f"{param}.{unknown[0][:64]}",
        )
    chosen = [
        name
        for name in ("json_", "regex", "choice", "grammar", "json_object", "structural_tag")
        if getattr(so, name) not in (None, False)
    ]
    if len(chosen) > 1:
        names = ", ".join(n.rstrip("_") for n in chosen)
        raise _invalid(
            f"{param} may set one of json, regex, choice, grammar, json_object, structural_tag; got {names}",
            param,
        )
    if so.json_ is not None:
        # guided_json is itself the schema; structured_outputs.json is a key of its object.
        return _Json(_schema(so.json_, param if param.startswith("guided_") else f"{param}.json"))
    if so.json_object:
        return _Json({"type": "object"})
    if so.regex is not None:
        return Grammar("regex", so.regex)
    if so.choice is not None:
        return Grammar.choice(so.choice)
    if so.grammar is not None:
        # GBNF (llama.cpp's, what vLLM's EBNF users write) or llguidance's Lark; the converter tells.
        return Grammar("gbnf", so.grammar)
    if so.structural_tag is not None:
        return _struct_tag(so.structural_tag)
    return None


def _guided(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutputs | None:
    """vLLM's older guided_* constraint fields as the structured_outputs they are aliases of."""
    fields = {
        "json": req.guided_json,
        "regex": req.guided_regex,
        "choice": req.guided_choice,
        "grammar": req.guided_grammar,
    }
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        return None
    return StructuredOutputs(**given)


@dataclass(frozen=True, slots=True)
class _JsonOptions:
    """How a JSON schema becomes a grammar, from whichever fields tune it, and the field that did
    (empty: the defaults)."""

    whitespace_pattern: str | None = None
    open_objects: bool = False  # plain JSON Schema: unlisted properties allowed where not said
    param: str = ""


def _json_options(req: ChatCompletionRequest | CompletionRequest) -> _JsonOptions:
    """structured_outputs' tuning keys and guided_whitespace_pattern. They tune the request's JSON
    constraint whichever field carries it (response_format, guided_json, json_schema), so a client
    of OpenAI's spelling can still ask for plain JSON Schema semantics."""
    so = req.structured_outputs
    whitespace = so.whitespace_pattern if so is not None else None
    params = []
    if so is not None and (
        so.whitespace_pattern is not None
        or so.disable_any_whitespace is not None
        or so.disable_additional_properties is not None
    ):
        params.append("structured_outputs")
    if req.guided_whitespace_pattern is not None:
        if whitespace is not None:
            raise _invalid(
                "give whitespace_pattern once: structured_outputs or guided_whitespace_pattern",
                "guided_whitespace_pattern",
            )
        whitespace = req.guided_whitespace_pattern
        params.append("guided_whitespace_pattern")
    # disable_any_whitespace: true is the default already (fixed separators); false, vLLM's default,
    # permits whitespace the grammar then does not use, so the output still satisfies it.
    if so is not None and so.disable_any_whitespace and whitespace is not None:
        raise _invalid("disable_any_whitespace contradicts whitespace_pattern", params[-1])
    open_objects = so is not None and so.disable_additional_properties is False
    return _JsonOptions(whitespace, open_objects, params[0] if params else "")


def _json_grammar(ask: _Json, options: _JsonOptions) -> Grammar:
    schema = ask.schema if options.open_objects else closed_objects(ask.schema)
    return Grammar.json_schema(schema, options.whitespace_pattern)


def _built(
    make: Callable[[Any, str], Grammar | _Json | None], source: Any, param: str
) -> Grammar | _Json | None:
    """What a field asks for, its own limits (size, depth) refused as a 400 naming the field."""
    try:
        return make(source, param)
    except GatewayError:
        raise
    except ValueError as exc:
        raise _invalid(f"{param}: {exc}", param) from None


def _top_level_schema(value: Any, param: str) -> _Json:
    return _Json(_schema(value, param))


def _top_level_grammar(value: str, param: str) -> Grammar:
    return Grammar("gbnf", value)  # llama.cpp's GBNF; llguidance's Lark is told apart as in guided_grammar


def requested_grammar(req: ChatCompletionRequest | CompletionRequest) -> tuple[Grammar | None, str]:
    """The grammar the request's structured-output fields ask for (None: none) and the parameter
    that asked; a 400 for contradictory or malformed ones. Forced tool calls are tools.py's."""
    backend = req.guided_decoding_backend
    if backend is not None and backend not in _ANY_BACKEND:
        raise GatewayError(
            400,
            f"guided_decoding_backend {backend[:64]!r} is not available; this server constrains with "
            f"llguidance (send one of {', '.join(_ANY_BACKEND)}, or leave it out)",
            code="unsupported_parameter",
            param="guided_decoding_backend",
        )
    options = _json_options(req)
    found: list[tuple[Grammar | _Json | None, str]] = []
    fmt = req.response_format
    if fmt is not None:
        found.append((_built(_from_response_format, fmt, "response_format"), "response_format"))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        found.append((_built(_from_structured, so, "structured_outputs"), "structured_outputs"))
    guided = _guided(req)
    if guided is not None:
        names = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        param = next(n for n in names if getattr(req, n) is not None)
        found.append((_built(_from_structured, guided, param), param))
    # llama.cpp's server fields.
    if req.json_schema is not None:
        found.append((_built(_top_level_schema, req.json_schema, "json_schema"), "json_schema"))
    if req.grammar is not None:
        found.append((_built(_top_level_grammar, req.grammar, "grammar"), "grammar"))
    asked = [(g, p) for g, p in found if g is not None]
    if len(asked) > 1:
        raise _invalid(f"ask for one output constraint; got {' and '.join(p for _, p in asked)}", asked[1][1])
    if not asked:
        if options.param:
            raise _invalid(
                f"{options.param}: whitespace_pattern, disable_any_whitespace and "
                "disable_additional_properties tune a JSON constraint, and the request asks for none",
                options.param,
            )
        return None, ""
    ask, param = asked[0]
    if isinstance(ask, _Json):
        try:
            return _json_grammar(ask, options), param
        except ValueError as exc:  # closed, the schema's text is over the size limit
            raise _invalid(f"{param}: {exc}", param) from None
    if options.param:
        raise _invalid(
            f"{options.param}: whitespace_pattern, disable_any_whitespace and disable_additional_properties "
            f"tune a JSON constraint; {param} asks for another kind",
            options.param,
        )
    return ask, param


def checked(grammar: Grammar, param: str) -> Grammar:
    """The grammar once llguidance would enforce all of it; else a 400 naming the parameter and the
    library's reason (an unsupported keyword, a syntax error, a grammar over its limits)."""
    problem = check(grammar)
    if problem is not None:
        raise GatewayError(
            400, f"{param} cannot be enforced: {problem[:500]}", code="invalid_grammar", param=param
        )
    return grammar


def wants_json(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether the request asks for JSON output (the routing policy's json_mode), without checking it."""
    fmt = (req.response_format or {}).get("type")
    so = req.structured_outputs
    return (
        fmt in ("json_object", "json_schema")
        or req.guided_json is not None
        or req.json_schema is not None
        or (so is not None and (so.json_ is not None or bool(so.json_object)))
    )
