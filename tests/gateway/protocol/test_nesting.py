"""The nesting bound: the bracket-count shortcut never changes the answer of the full walk."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from specgate.gateway.protocol.nesting import nests_deeper, text_nests_deeper

# JSON values whose strings are full of brackets (which the shortcut counts too) and that nest.
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}ab"\\', max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet="[{a", max_size=3), inner, max_size=3)
    ),
    max_leaves=30,
)


def _chain(depth: int) -> Any:
    """Arrays and objects alternating, `depth` containers in all."""
    value: Any = []
    for i in range(depth - 1):
        value = {"k": value} if i % 2 else [value]
    return value


@settings(max_examples=300, deadline=None)
@given(values, st.integers(min_value=1, max_value=6))
def test_the_shortcut_agrees_with_the_walk(value: Any, limit: int) -> None:
    text = json.dumps(value)
    expected = nests_deeper(value, limit)
    assert text_nests_deeper(text, value, limit) == expected
    assert text_nests_deeper(text.encode(), value, limit) == expected


def test_exactly_at_and_past_the_limit() -> None:
    for depth in (63, 64, 65, 200):
        value = json.loads(json.dumps(_chain(depth)))
        assert nests_deeper(value, 64) == (depth > 64)
        assert text_nests_deeper(json.dumps(value), value, 64) == (depth > 64)
