"""What changed between two policy versions: their artifacts flattened to dotted paths, compared.

The fitted model's coefficients are summarised as the arms it models and their row counts (a diff
of regression weights tells an operator nothing); rules and acceptance priors are compared leaf by
leaf.
"""

from __future__ import annotations

from typing import Any

from specgate.gateway.policy.store import Version


def side(row: Version) -> dict[str, Any]:
    """A version as the dashboard shows it: metadata, rules, priors, modelled arms."""
    artifact = row.get("artifact") or {}
    model = artifact.get("model") or {}
    return {
        "version": int(row["version"]),
        "kind": row.get("kind"),
        "source": row.get("source"),
        "status": row.get("status"),
        "created_at": row.get("created_at"),
        "note": row.get("note"),
        "rules": artifact.get("rules") or {},
        "priors": artifact.get("priors") or {},
        "modelled_arms": sorted((model.get("arms") or {}).keys()),
        "_arm_rows": {k: (v or {}).get("n_rows") for k, v in (model.get("arms") or {}).items()},
    }


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of nested dicts under dotted paths. Lists are leaves (compared whole); an empty dict
    has no leaves (a prior that appears shows as that one path, from None)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key in sorted(value):
        out.update(flatten(value[key], f"{prefix}.{key}" if prefix else str(key)))
    return out


def diff(a: Version, b: Version) -> dict[str, Any]:
    left, right = side(a), side(b)
    fa = flatten({"kind": left["kind"], "rules": left["rules"], "priors": left["priors"]})
    fb = flatten({"kind": right["kind"], "rules": right["rules"], "priors": right["priors"]})
    fa.update({f"model.arms.{k}.n_rows": v for k, v in left.pop("_arm_rows").items()})
    fb.update({f"model.arms.{k}.n_rows": v for k, v in right.pop("_arm_rows").items()})
    changes = [
        {"path": path, "a": fa.get(path), "b": fb.get(path)}
        for path in sorted(set(fa) | set(fb))
        if fa.get(path) != fb.get(path) or (path in fa) != (path in fb)
    ]
    return {"a": left, "b": right, "changes": changes}
