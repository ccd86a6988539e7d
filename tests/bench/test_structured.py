"""`specgate bench structured`'s pieces: BFCL schemas made JSON Schema, the workload, the validity
check, and a few served requests through its arms on the tiny model (no llama.cpp, no network)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

from specgate.bench.structured import (
    ARMS,
    SPECGATE,
    SPECGATE_NOFORCE,
    Case,
    Result,
    call_schema,
    convert_bfcl,
    enforceable,
    measure,
    tables,
    validity,
    workload,
)
from specgate.engine.structured_output.grammar import Grammar, check
from tests.gateway.live import start_gateway, tiny_settings

BFCL_PARAMS = {
    "type": "dict",
    "properties": {
        "radius": {"type": "float", "description": "r"},
        "point": {"type": "tuple", "items": {"type": "integer"}},
        "extra": {"type": "any"},
        "options": {"type": "dict", "properties": {"exact": {"type": "boolean", "optional": True}}},
    },
    "required": ["radius"],
}


def test_bfcl_types_become_json_schema_and_objects_are_closed() -> None:
    counts: Counter[str] = Counter()
    schema = convert_bfcl(BFCL_PARAMS, counts)
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    props = schema["properties"]
    assert props["radius"] == {"type": "number", "description": "r"}
    assert props["point"] == {"type": "array", "items": {"type": "integer"}}
    assert props["extra"] == {}  # any value
    assert props["options"]["type"] == "object" and props["options"]["additionalProperties"] is False
    assert counts == {
        "type dict -> object": 2,
        "type float -> number": 1,
        "type tuple -> array": 1,
        "type any -> {}": 1,
        "object closed (additionalProperties: false)": 2,
    }
    call = call_schema([{"name": "area", "parameters": schema}])
    assert check(Grammar.json_schema(call)) is None
    assert validity('{"name": "area", "arguments": {"radius": 2.5}}', call)[0] == "valid"
    assert validity('{"name": "area", "arguments": {"radius": 2.5, "r": 1}}', call)[0] == "invalid"
    both = call_schema([{"name": "a", "parameters": schema}, {"name": "b"}])
    assert validity('{"name": "b", "arguments": {"x": 1}}', both)[0] == "valid"


def test_keys_llguidance_refuses_are_dropped_and_counted() -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "format": "bogus"}, "uniqueItems": True},
            "uniqueItems": {"type": "boolean"},  # a property named like the keyword stays
            "day": {"type": "string", "format": "date"},  # a format it knows stays
        },
    }
    assert check(Grammar.json_schema(schema)) is not None
    dropped: Counter[str] = Counter()
    fixed = enforceable(schema, dropped)
    assert fixed is not None and check(Grammar.json_schema(fixed)) is None
    assert dropped == {"uniqueItems": 1, "format: bogus": 1}
    assert set(fixed["properties"]) == {"tags", "uniqueItems", "day"}
    assert fixed["properties"]["day"]["format"] == "date"
    # Unsatisfiable for another reason: refused, not patched.
    bad = {"type": "object", "properties": {}, "required": ["x"], "additionalProperties": False}
    assert enforceable(bad, Counter()) is None


def test_the_workload_mixes_own_schemas_and_both_bfcl_files() -> None:
    w = workload(9)
    assert Counter(c.source for c in w.cases) == {"own": 3, "simple": 3, "multiple": 3}
    assert w.skipped == 0 and w.conversions["type dict -> object"] > 0
    for case in w.cases:
        assert check(Grammar.json_schema(case.schema)) is None
        assert case.messages[0]["role"] == "system" and case.messages[-1]["role"] == "user"
    multiple = [c for c in w.cases if c.source == "multiple"]
    assert all("anyOf" in c.schema or c.schema["properties"]["name"].get("const") for c in multiple)


def test_validity_strict_and_lenient() -> None:
    schema = {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date-time"}},
        "required": ["when"],
    }
    assert validity('{"when": "2025-03-14T09:30:00Z"}', schema) == ("valid", True, "")
    status, lenient, why = validity('{"when": "March 14"}', schema)
    assert (status, lenient) == ("invalid", False) and "date-time" in why
    assert validity('Here:\n```json\n{"when": "2025-03-14T09:30:00Z"}\n```', schema)[:2] == ("unparsed", True)
    assert validity('{"when": "2025-03-14T09:30:00Z"', schema)[:2] == ("unparsed", False)


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"label": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["label", "n"],
    "additionalProperties": False,
}


def test_served_arms_on_the_tiny_model(tiny_llama_dir: Path) -> None:
    case = Case("tiny", "own", [{"role": "user", "content": "Say yes or no."}], SCHEMA)
    arms = [ARMS[a] for a in ("free", "json", "json-ngram", "json-suffix", "json-noforce")]
    on = start_gateway(tiny_settings(str(tiny_llama_dir), embedded={"draft_cache_scope": "off"}))
    off = start_gateway(
        tiny_settings(str(tiny_llama_dir), embedded={"draft_cache_scope": "off", "forced_drafts": False})
    )
    try:
        started = {SPECGATE: on.url, SPECGATE_NOFORCE: off.url}
        results = asyncio.run(measure(started, arms, [case], 40, reps=1, chunk=512))
    finally:
        on.stop()
        off.stop()
    by = {x.arm: x for x in results}
    assert all(x.r.ok for x in results), [x.r.error for x in results]
    for name in ("json", "json-ngram", "json-suffix", "json-noforce"):
        x: Result = by[name]
        assert x.r.finish == "stop" and x.status == "valid", (name, x.r.text)
        assert x.r.text == by["json-noforce"].r.text  # forced drafts and speculation are lossless
        assert x.decode_tps and x.e2e_tps and x.r.steps
    assert by["json"].forced >= len('{"label": "') and by["json-noforce"].forced == 0
    steps_on, steps_off = by["json"].decode_steps, by["json-noforce"].decode_steps
    assert (
        steps_on is not None and steps_off is not None and steps_on < steps_off
    )  # forced tokens share steps
    assert by["free"].r.output_tokens == 40 or by["free"].r.finish == "stop"
    table = tables(results, [a.name for a in arms])
    assert "| json | 1/1 |" in table and "forced drafts on / off" in table and "mask's cost" in table
