"""The diff of two policy versions: rule and prior leaves, modelled arms, nothing else."""

from __future__ import annotations

from typing import Any

from specgate.gateway.policy.diff import diff, flatten
from specgate.policies.rules import RuleConfig
from specgate.policies.state import PolicyState


def version(number: int, state: PolicyState, **meta: Any) -> dict[str, Any]:
    return {"version": number, "kind": state.kind, "source": "edit", "status": "retired", **meta,
            "artifact": state.as_dict()}  # fmt: skip


def test_identical_versions_have_no_changes() -> None:
    a = version(1, PolicyState())
    out = diff(a, version(2, PolicyState()))
    assert out["changes"] == [] and out["a"]["version"] == 1 and out["b"]["version"] == 2
    assert out["a"]["rules"]["classes"]["code"]["method"] == "ngram" and out["a"]["modelled_arms"] == []


def test_rule_and_prior_changes_are_named_by_path() -> None:
    edited = RuleConfig().merged(
        {"classes": {"qa": {"method": "off", "k_max": 0, "k_min": 0}}, "high_temperature": 0.5}
    )
    a = version(1, PolicyState())
    b = version(2, PolicyState(edited, None, {"code:ngram": 0.7}))
    changes = {c["path"]: (c["a"], c["b"]) for c in diff(a, b)["changes"]}
    assert changes == {
        "rules.classes.qa.method": ("ngram", "off"),
        "rules.classes.qa.k_max": (3, 0),
        "rules.high_temperature": (0.9, 0.5),
        "priors.code:ngram": (None, 0.7),
    }
    assert [c["path"] for c in diff(b, a)["changes"]] == sorted(changes)  # sorted, either way round


def test_models_are_summarised_by_arm() -> None:
    a = version(1, PolicyState())
    b = version(3, PolicyState())
    b["artifact"]["model"] = {"arms": {"embedded:ngram": {"n_rows": 120, "coef": [0.1] * 40}}}
    b["kind"] = "learned"
    out = diff(a, b)
    assert out["b"]["modelled_arms"] == ["embedded:ngram"]
    changes = {c["path"]: (c["a"], c["b"]) for c in out["changes"]}
    assert changes == {"kind": ("rules", "learned"), "model.arms.embedded:ngram.n_rows": (None, 120)}


def test_flatten_keeps_lists_whole_and_drops_empty_dicts() -> None:
    assert flatten({"a": {"b": [1, 2], "c": {}}, "d": 1}) == {"a.b": [1, 2], "d": 1}


def test_a_temperature_bands_prior_is_one_path() -> None:
    a = version(1, PolicyState(RuleConfig(), None, {"open_chat:ngram": 0.5}))
    b = version(2, PolicyState(RuleConfig(), None, {"open_chat:ngram": 0.5, "open_chat:ngram@t0.9+": 0.12}))
    changes = {c["path"]: (c["a"], c["b"]) for c in diff(a, b)["changes"]}
    assert changes == {"priors.open_chat:ngram@t0.9+": (None, 0.12)}
