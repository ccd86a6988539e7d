"""/admin/timeseries/*: the dashboard's series on SQLite and PostgreSQL, from rows with known values;
hostile window / step values; the OpenAPI schema documents them."""

from __future__ import annotations

import datetime as dt
import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import insert

from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.tables import requests
from tests.gateway.live import LiveGateway, start_gateway, tiny_settings

ADMIN = {"authorization": "Bearer adm-series-0123456789"}
STEP = 60.0


def row(at: float, **values: Any) -> dict[str, Any]:
    base: dict[str, Any] = {c.name: None for c in requests.columns}
    base |= {
        "request_id": uuid.uuid4().hex,
        "endpoint": "chat",
        "model": "m-a",
        "stream": False,
        "arrival_time": dt.datetime.fromtimestamp(at, tz=dt.UTC),
        "status": 200,
        "outcome": "ok",
        "cancelled": False,
        "backend": "embedded",
    }
    base.update(values)
    return base


def seed(url: str, now: float) -> float:
    """Rows in two steps of a one-hour window; returns the start of the busier step."""
    busy = math.floor(now / STEP) * STEP - 10 * STEP  # ten steps before the current one
    quiet = busy - 20 * STEP
    rows = [
        # Busy step: three successes on m-a / embedded, one error, one on another backend.
        row(busy + 1, ttft_ms=100.0, tpot_ms=10.0, completion_tokens=10, prompt_tokens=5, tokens_per_s=50.0,
            workload_class="code", spec_method="ngram", num_drafts=4, num_draft_tokens=12,
            num_accepted_tokens=9, mean_acceptance_length=3.25, load_running=0, load_queue_depth=0),
        row(busy + 2, ttft_ms=200.0, tpot_ms=20.0, completion_tokens=20, prompt_tokens=5, tokens_per_s=40.0,
            workload_class="code", spec_method="off", load_running=3, load_queue_depth=1,
            decision_reason="code (0.90): rule ngram; batch 4 >= 4: speculation off"),
        row(busy + 3, ttft_ms=300.0, tpot_ms=30.0, completion_tokens=30, prompt_tokens=5, tokens_per_s=20.0,
            workload_class="code", spec_method="off", load_running=9, load_queue_depth=0,
            decision_reason="code (0.90): rule ngram; batch 9 >= 4: speculation off"),
        row(busy + 4, status=404, outcome="error", error_code="model_not_found", backend=None, model="nope"),
        row(busy + 5, backend="vllm-a", model="m-b", ttft_ms=80.0, tpot_ms=8.0, completion_tokens=7),
        # Quiet step: one request, so its percentiles are its own values exactly.
        row(quiet + 30, ttft_ms=123.4, tpot_ms=12.5, completion_tokens=4, tokens_per_s=8.0,
            workload_class="qa", spec_method="off"),
        row(quiet + 31, status=400, outcome="error", error_code=None, model="m-a", backend=None),
        # Outside the window: never counted.
        row(now - 7200, ttft_ms=1.0, completion_tokens=1000),
    ]  # fmt: skip
    engine = schema.make_engine(url)
    with engine.begin() as conn:
        conn.execute(insert(requests), rows)
    engine.dispose()
    return busy


@pytest.fixture
def live(db_url: str) -> Iterator[tuple[LiveGateway, float]]:
    gw = start_gateway(
        tiny_settings(
            "unused",
            embedded={"enabled": False},
            admin_key="adm-series-0123456789",
            telemetry={"url": db_url, "auto_upgrade": True},
        ),
        wait_ready=False,
    )
    busy = seed(db_url, time.time())
    yield gw, busy
    gw.stop()


def get(gw: LiveGateway, path: str, **params: Any) -> httpx.Response:
    return httpx.get(f"{gw.url}{path}", params=params, headers=ADMIN, timeout=30)


@pytest.mark.slow
def test_traffic_series(live: tuple[LiveGateway, float]) -> None:
    gw, busy = live
    r = get(gw, "/admin/timeseries/traffic", window=3600, step=STEP)
    assert r.status_code == 200, r.text
    data = r.json()
    pts = data["points"]
    assert len(pts) == 60 and pts[1]["t"] - pts[0]["t"] == STEP
    assert data["window"]["end"] > time.time() >= data["window"]["end"] - STEP
    by_t = {p["t"]: p for p in pts}
    p = by_t[busy]
    assert (p["requests"], p["ok"], p["errors"]) == (5, 4, 1)
    assert p["errors_by_code"] == {"model_not_found": 1}
    assert p["completion_tokens"] == 67 and p["tokens_per_s"] == pytest.approx(67 / STEP)
    assert p["requests_per_s"] == pytest.approx(5 / STEP)
    # Four TTFTs 80, 100, 200, 300: the median lies between 100 and 200; the ends are exact.
    assert 100 <= p["ttft_ms"]["p50"] <= 200
    assert p["ttft_ms"]["p99"] <= 300 and p["ttft_ms"]["p99"] >= 300 / 1.15
    quiet = by_t[busy - 20 * STEP]
    assert quiet["ttft_ms"] == {"p50": 123.4, "p90": 123.4, "p99": 123.4}
    assert quiet["tpot_ms"]["p50"] == 12.5 and quiet["errors_by_code"] == {"400": 1}
    assert sum(q["requests"] for q in pts) == 7  # the row two hours back is outside
    assert data["window"]["models"] == ["m-a", "m-b", "nope"]
    assert data["window"]["backends"] == ["embedded", "vllm-a"]
    routes = {(x["model"], x["backend"]): x for x in data["by_route"]}
    assert routes[("m-a", "embedded")]["requests"] == 4 and routes[("m-a", "embedded")]["errors"] == 0
    assert routes[("m-b", "vllm-a")]["ttft_ms"]["p50"] == 80.0

    only = get(gw, "/admin/timeseries/traffic", window=3600, step=STEP, backend="vllm-a").json()
    assert sum(q["requests"] for q in only["points"]) == 1
    assert only["window"]["backend"] == "vllm-a" and only["window"]["backends"] == ["embedded", "vllm-a"]
    model_only = get(gw, "/admin/timeseries/traffic", window=3600, step=STEP, model="m-a").json()
    assert sum(q["requests"] for q in model_only["points"]) == 5


def test_speculation_series(live: tuple[LiveGateway, float]) -> None:
    gw, busy = live
    r = get(gw, "/admin/timeseries/speculation", window=3600, step=STEP)
    assert r.status_code == 200, r.text
    data = r.json()
    p = {x["t"]: x for x in data["points"]}[busy]
    assert (p["draft_tokens"], p["accepted_tokens"]) == (12, 9)
    assert p["acceptance_rate"] == 0.75 and p["mean_acceptance_length"] == 3.25
    assert p["route_mix"] == {"embedded:ngram": 1, "embedded:off": 2, "vllm-a:upstream": 1}
    classes = {(c["workload_class"], c["method"]): c for c in data["by_class"]}
    # ngram at 50 tok/s against plain code requests at (40 + 20) / 2 = 30.
    assert classes[("code", "ngram")]["speedup_vs_plain"] == pytest.approx(50 / 30, abs=1e-3)
    assert classes[("code", "off")]["speedup_vs_plain"] is None
    assert classes[("code", "ngram")]["acceptance_rate"] == 0.75
    load = data["by_load"]
    assert load["turned_off_at_batch"] == 4
    bands = {b["batch_min"]: b for b in load["bands"]}
    assert bands[0]["requests"] == 1 and bands[0]["speculating"] == 1  # the ngram request, batch 0
    assert bands[4]["off_for_load"] == 1 and bands[8]["off_for_load"] == 1 and bands[8]["batch_max"] == 15


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"window": 0}, "window"),
        ({"window": -5}, "window"),
        ({"window": "1e999"}, "window"),
        ({"window": "nan"}, "window"),
        ({"window": "inf"}, "window"),
        ({"window": "abc"}, "window"),
        ({"window": 10**30}, "window"),
        ({"step": 0}, "step"),
        ({"step": "1e308"}, "step"),
        ({"window": 86400, "step": 1}, "step"),  # 86,400 points
        ({"model": ""}, "model"),
        ({"backend": "x" * 300}, "backend"),
    ],
)
def test_bad_windows_are_clean_422s(live: tuple[LiveGateway, float], params: dict, param: str) -> None:
    gw, _ = live
    for path in ("/admin/timeseries/traffic", "/admin/timeseries/speculation"):
        r = get(gw, path, **params)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == f"query.{param}"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_auth_and_openapi(live: tuple[LiveGateway, float]) -> None:
    gw, _ = live
    assert httpx.get(f"{gw.url}/admin/timeseries/traffic").status_code == 401
    bad = httpx.get(f"{gw.url}/admin/timeseries/traffic", headers={"authorization": "Bearer no"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    spec = httpx.get(f"{gw.url}/openapi.json").json()
    for path in ("/admin/timeseries/traffic", "/admin/timeseries/speculation", "/admin/policy/diff"):
        op = spec["paths"][path]["get"]
        assert op["summary"] and op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    names = {p["name"] for p in spec["paths"]["/admin/timeseries/traffic"]["get"]["parameters"]}
    assert names == {"window", "step", "model", "backend"}
    schemas = spec["components"]["schemas"]
    assert {"TrafficSeries", "SpeculationSeries", "PolicyDiff", "SignIn", "SessionInfo"} <= set(schemas)
    assert "/admin/ui/login" in spec["paths"] and "/admin/ui" not in spec["paths"]


def test_without_telemetry_the_series_are_a_409() -> None:
    gw = start_gateway(
        tiny_settings(
            "unused",
            embedded={"enabled": False},
            admin_key="adm-series-0123456789",
            telemetry={"enabled": False},
        ),
        wait_ready=False,
    )
    try:
        r = get(gw, "/admin/timeseries/traffic")
        assert r.status_code == 409 and r.json()["error"]["code"] == "no_telemetry"
    finally:
        gw.stop()
