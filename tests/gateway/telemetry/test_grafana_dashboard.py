"""docs/grafana-dashboard.json names only series the gateway's /metrics exports, with labels those
series carry (PromQL returns nothing, silently, for a misspelt name or label); and it is a dashboard
Grafana can import: unique panel ids, a Prometheus data source variable, model / backend filters."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.metrics import MetricWrapperBase

from tests.gateway.live import LiveGateway, start_gateway, tiny_settings

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana-dashboard.json"
SERIES = re.compile(r"\b(specgate_[a-z0-9_]+)(\{[^}]*\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
BY = re.compile(r"\bby\s*\(([^)]*)\)")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def expressions(dashboard: dict[str, Any]) -> list[str]:
    out = []
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        out.extend(t["expr"] for t in panel.get("targets", []))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["query"]["query"])
    return out


def families(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Every sample name the exposition may hold -> its family, and each family's label names."""
    names: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            base = family.removesuffix("_total") if kind == "counter" else family
            for suffix in SUFFIXES.get(kind, ("",)):
                names[base + suffix] = base
            labels.setdefault(base, set())
        elif line and not line.startswith("#"):
            name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line)
            assert name is not None
            family = names.get(name.group(0))
            if family is not None and "{" in line:
                labels[family] |= set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', line.split("{", 1)[1]))
    return names, labels


def declared_labels(gw: LiveGateway) -> dict[str, set[str]]:
    """Label names each metric of the app declares (a labelled family with no sample yet, such as
    failovers on a gateway that never failed over, shows none in the exposition)."""
    out = {}
    for value in vars(gw.services.metrics).values():
        if isinstance(value, MetricWrapperBase):
            out[value._name.removesuffix("_total")] = set(value._labelnames)
    return out


@pytest.fixture(scope="module")
def metrics(tiny_llama_dir: Path) -> Iterator[tuple[str, dict[str, set[str]]]]:
    gw: LiveGateway = start_gateway(tiny_settings(str(tiny_llama_dir)))  # telemetry: a temporary SQLite
    try:
        body = {"model": tiny_llama_dir.name, "messages": [{"role": "user", "content": "def f(x):"}]}
        for spec in ("ngram", "off"):
            r = httpx.post(
                f"{gw.url}/v1/chat/completions", json={**body, "max_tokens": 8, "spec": {"method": spec}}
            )
            assert r.status_code == 200, r.text
        httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "nope", "messages": []})
        yield httpx.get(f"{gw.url}/metrics").text, declared_labels(gw)
    finally:
        gw.stop()


def test_every_series_the_dashboard_names_is_exported(metrics: tuple[str, dict[str, set[str]]]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names, labels = families(metrics[0])
    for family, declared in metrics[1].items():
        assert family in labels, f"{family} is declared but not exported"
        labels[family] |= declared
    exprs = expressions(dashboard)
    assert len(exprs) >= 30
    used: set[str] = set()
    for expr in exprs:
        found = SERIES.findall(expr)
        assert found, f"no specgate series in {expr!r}"
        for name, selector in found:
            assert name in names, f"{name} (in {expr!r}) is not in /metrics"
            used.add(names[name])
            family_labels = labels[names[name]] | {"le"}
            wanted = set(MATCHER.findall(selector))
            assert wanted <= family_labels, f"{name} has no label {wanted - family_labels} ({expr!r})"
        for group in BY.findall(expr):
            by = {g.strip() for g in group.split(",") if g.strip()}
            have = set().union(*(labels[names[n]] for n, _ in found)) | {"le"}
            assert by <= have, f"by ({group}) in {expr!r}"
    # The dashboard covers the exporter: every family but the per-scrape Python runtime ones.
    exported = {f for f in labels if f.startswith("specgate_") and not f.endswith("_created")}
    assert exported - used == set(), f"series no panel shows: {sorted(exported - used)}"


def test_it_is_an_importable_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "specgate-gateway" and dashboard["schemaVersion"] >= 36
    ids = []
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        ids.append(panel["id"])
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"][
            "w"
        ] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"] and panel["title"]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert {"model", "backend"} <= set(variables)
