"""Structured outputs on the embedded engine: the one grammar a request's fields ask for, checked.

Three spellings reach here: OpenAI's `response_format` (json_object, json_schema), vLLM's
`structured_outputs` (json, regex, choice, grammar, json_object, structural_tag) and vLLM's older
`guided_*` fields, which are aliases of its keys; a forced `tool_choice` ("required" or a named
function) is a grammar of the model's tool-call format (tools.py). A request may ask for one
constraint; two are a 400, as is anything the grammar library would enforce only in part (an
unsupported keyword, a format it does not know), checked before the request reaches the engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from specgate.engine.grammar import MAX_SCHEMA_DEPTH, Grammar, check, schema_depth
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


def _closed(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema that does not say otherwise
    allows no properties beyond the ones it names."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _from_response_format(fmt: Mapping[str, Any], _param: str = "response_format") -> Grammar | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_schema({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise _invalid("response_format.json_schema needs a schema", "response_format.json_schema")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise _invalid(
                f"unknown keys in response_format.json_schema: {', '.join(sorted(unknown))[:200]}",
                "response_format.json_schema",
            )
        # strict or not, the schema is enforced exactly: OpenAI's non-strict mode promises less.
        return Grammar.json_schema(_schema(spec["schema"], "response_format.json_schema.schema"))
    raise _invalid(
        f"response_format type {str(kind)[:64]!r} is not one of text, json_object, json_schema",
        "response_format",
    )


def _struct_tag(value: Mapping[str, Any] | str) -> Grammar:
    """vLLM's structural tag: free text in which each trigger opens a structure whose body follows a
    JSON schema, as a Lark grammar with lazy triggers (llguidance's StructTag)."""
    from llguidance import StructTag

    param = "structured_outputs.structural_tag"
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
        schema = _schema(s.get("schema", {"type": "object"}), f"{param}.schema")
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=dict(schema), end=s["end"]))
    return Grammar("lark", StructTag.to_grammar(tags, assume_special=False))


def _from_structured(so: StructuredOutputs, param: str) -> Grammar | None:
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
    whitespace = so.whitespace_pattern
    if so.disable_any_whitespace and whitespace is not None:
        raise _invalid(f"{param}: disable_any_whitespace contradicts whitespace_pattern", param)
    if (whitespace is not None or so.disable_additional_properties) and not (
        so.json_ is not None or so.json_object
    ):
        raise _invalid(
            f"{param}: whitespace_pattern and disable_additional_properties apply to json only", param
        )
    if so.json_ is not None:
        # guided_json is itself the schema; structured_outputs.json is a key of its object.
        schema = _schema(so.json_, param if param.startswith("guided_") else f"{param}.json")
        if so.disable_additional_properties:
            schema = _closed(schema)
        return Grammar.json_schema(schema, whitespace)
    if so.json_object:
        return Grammar.json_schema({"type": "object"}, whitespace)
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
    """vLLM's older guided_* fields as the structured_outputs they are aliases of."""
    fields = {
        "json": req.guided_json,
        "regex": req.guided_regex,
        "choice": req.guided_choice,
        "grammar": req.guided_grammar,
        "whitespace_pattern": req.guided_whitespace_pattern,
    }
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        return None
    return StructuredOutputs(**given)


def _built(make: Callable[[Any, str], Grammar | None], source: Any, param: str) -> Grammar | None:
    """A grammar made from a field, its own limits (size, depth) refused as a 400 naming the field."""
    try:
        return make(source, param)
    except GatewayError:
        raise
    except ValueError as exc:
        raise _invalid(f"{param}: {exc}", param) from None


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
    found: list[tuple[Grammar | None, str]] = []
    fmt = req.response_format
    if fmt is not None:
        found.append((_built(_from_response_format, fmt, "response_format"), "response_format"))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        found.append((_built(_from_structured, so, "structured_outputs"), "structured_outputs"))
    guided = _guided(req)
    if guided is not None:
        names = (
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "guided_whitespace_pattern",
        )
        param = next(n for n in names if getattr(req, n) is not None)
        found.append((_built(_from_structured, guided, param), param))
    asked = [(g, p) for g, p in found if g is not None]
    if len(asked) > 1:
        raise _invalid(f"ask for one output constraint; got {' and '.join(p for _, p in asked)}", asked[1][1])
    return asked[0] if asked else (None, "")


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
        or (so is not None and (so.json_ is not None or bool(so.json_object)))
    )
