"""engine/structured_output/grammar.py: how a JSON schema is read before llguidance compiles it."""

from __future__ import annotations

from typing import Any

from specgate.engine.structured_output.grammar import Grammar, check, closed_objects


def test_closed_objects_closes_what_lists_properties_and_says_nothing_else() -> None:
    props = {"x": {"type": "string"}}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            # A property named like a keyword is a property, not a keyword.
            "properties": {"type": "object", "properties": props},
            "open": {"type": "object", "properties": props, "additionalProperties": True},
            "typed": {"type": "object", "properties": props, "additionalProperties": {"type": "integer"}},
            "uneval": {"type": "object", "properties": props, "unevaluatedProperties": True},
            "any": {"type": "object"},
            "list": {"type": "array", "items": {"properties": props}},
            "union": {"anyOf": [{"properties": props}, {"type": "null"}]},
            "data": {"const": {"properties": {}}, "default": {"properties": {}}},
            "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
            "ref": {"allOf": [{"$ref": "#/$defs/d"}]},
        },
        "$defs": {"d": {"properties": props}},
    }
    out = closed_objects(schema)
    p = out["properties"]
    assert out["additionalProperties"] is False
    assert p["properties"]["additionalProperties"] is False
    assert p["open"]["additionalProperties"] is True
    assert p["typed"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in p["uneval"]
    assert "additionalProperties" not in p["any"]  # any object: json_object stays json_object
    assert p["list"]["items"]["additionalProperties"] is False
    assert p["union"]["anyOf"][0]["additionalProperties"] is False
    assert p["data"] == schema["properties"]["data"]  # values, not schemas
    # Closed, each part of an allOf would refuse the properties the other lists.
    assert all("additionalProperties" not in part for part in p["both"]["allOf"])
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy
    assert closed_objects(True) is True


def test_a_schemas_own_x_guidance_cannot_loosen_what_is_enforced() -> None:
    one_of = {"oneOf": [{"type": "object"}, {"type": "object", "properties": {"a": {}}}]}
    assert check(Grammar.json_schema({**one_of, "x-guidance": {"coerce_one_of": True}})) is not None
    unique = {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}
    assert check(Grammar.json_schema(unique)) is not None
