"""Read-only containers: every change refused, everything that reads a dict or a list still can."""

from __future__ import annotations

import copy
import json
import pickle

import orjson
import pytest

from specgate.policies.frozen import FrozenDict, FrozenList, freeze


def test_freeze_reaches_every_nested_container() -> None:
    value = freeze({"a": [1, {"b": {2, 3}}, (4, [5])], "c": "text"})
    assert value == {"a": [1, {"b": {2, 3}}, [4, [5]]], "c": "text"}
    assert isinstance(value, FrozenDict) and isinstance(value["a"], FrozenList)
    assert isinstance(value["a"][1], FrozenDict) and value["a"][1]["b"] == frozenset({2, 3})
    assert isinstance(value["a"][2][1], FrozenList)
    for change in (
        lambda: value.__setitem__("x", 1),
        lambda: value.update(x=1),
        lambda: value.pop("c"),
        lambda: value.setdefault("x", 1),
        lambda: value["a"].append(6),
        lambda: value["a"].extend([6]),
        lambda: value["a"].__setitem__(0, 0),
        lambda: value["a"].sort(),
        lambda: value["a"][2][1].clear(),
    ):
        with pytest.raises(TypeError):
            change()
    assert value == {"a": [1, {"b": {2, 3}}, [4, [5]]], "c": "text"}


def test_in_place_operators_are_refused_too() -> None:
    d, items = freeze({"a": 1}), freeze([1])
    with pytest.raises(TypeError):
        d |= {"b": 2}
    with pytest.raises(TypeError):
        items += [2]
    assert d == {"a": 1} and items == [1]


def test_frozen_values_encode_copy_and_pickle_as_what_they_were_built_from() -> None:
    value = freeze({"a": [1, {"b": [2]}]})
    assert json.loads(json.dumps(value)) == {"a": [1, {"b": [2]}]}
    assert orjson.loads(orjson.dumps(value)) == {"a": [1, {"b": [2]}]}
    for clone in (copy.deepcopy(value), pickle.loads(pickle.dumps(value)), copy.copy(value)):
        assert clone == value and isinstance(clone["a"][1], FrozenDict)
        with pytest.raises(TypeError):
            clone["a"].append(3)


def test_nesting_deeper_than_the_recursion_limit_is_frozen_and_keeps_the_encoders_depth_limit() -> None:
    deep: list[object] = []
    for _ in range(5000):
        deep = [deep]
    frozen = freeze({"metrics": deep})
    node = frozen["metrics"]
    for _ in range(5000):
        assert isinstance(node, FrozenList)
        node = node[0]
    assert node == []
    # Lists, not tuples: orjson refuses a list nested this deep, where a tuple got past its limit.
    with pytest.raises(TypeError):
        orjson.dumps(frozen)


def test_scalars_and_frozen_values_come_back_as_they_are() -> None:
    already = freeze({"a": [1]})
    assert freeze(already) is already
    assert freeze(3) == 3 and freeze("x") == "x" and freeze(None) is None
