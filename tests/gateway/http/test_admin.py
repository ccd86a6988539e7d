"""The admin API on a live gateway with a SQLite telemetry file: auth, validation, edits, retrain on
synthetic telemetry, rollback, explain, stats, backends, warm start after a restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select

from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.tables import requests
from tests.gateway.live import LiveGateway, start_gateway, tiny_settings, wait_for
from tests.policies import synthetic_telemetry as synth

ADMIN = {"authorization": "Bearer admin-secret-0123456789"}
CODE = "Write a Python function that merges two sorted lists and returns the merged list."
CHAT = "Write a short poem about the first snow of winter."


def settings(model_dir: Path, db: str) -> Any:
    return tiny_settings(
        str(model_dir),
        admin_key="admin-secret-0123456789",
        api_keys=["user-key"],
        telemetry={"url": db, "auto_upgrade": True, "flush_interval": 0.05},
        policy={"seed": 0},
    )


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('admin') / 'telemetry.db'}"


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path, db: str) -> Iterator[LiveGateway]:
    gw = start_gateway(settings(tiny_llama_dir, db))
    yield gw
    gw.stop()


def get(live: LiveGateway, path: str, **kw: Any) -> httpx.Response:
    return httpx.get(f"{live.url}{path}", headers=kw.pop("headers", ADMIN), timeout=60, **kw)


def post(live: LiveGateway, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, headers=kw.pop("headers", ADMIN), timeout=120, **kw)


def model(live: LiveGateway) -> str:
    embedded = live.services.registry.embedded
    assert embedded is not None
    return embedded.model_ids()[0]


def explain(live: LiveGateway, text: str, temperature: float = 0.0) -> dict[str, Any]:
    body = {"model": model(live), "messages": [{"role": "user", "content": text}], "temperature": temperature}
    r = post(live, "/admin/route/explain", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_auth(live: LiveGateway, tiny_llama_dir: Path) -> None:
    assert get(live, "/admin/policy", headers={}).status_code == 401
    assert get(live, "/admin/policy", headers={"authorization": "Bearer nope"}).status_code == 401
    r = get(live, "/admin/policy", headers={"authorization": "Bearer user-key"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    # The admin key is not an API key for /v1 either way round: /v1 accepts only its own keys.
    assert get(live, "/v1/models", headers={"authorization": "Bearer user-key"}).status_code == 200
    closed = start_gateway(tiny_settings(str(tiny_llama_dir), embedded={"enabled": False}), wait_ready=False)
    try:
        r = httpx.get(f"{closed.url}/admin/policy", headers=ADMIN)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
    finally:
        closed.stop()


def test_fresh_install_runs_the_rules_as_version_one(live: LiveGateway) -> None:
    body = get(live, "/admin/policy").json()
    assert body["version"] == 1 and body["kind"] == "rules" and body["persistent"]
    assert body["rules"]["classes"]["code"]["method"] == "ngram"
    code = explain(live, CODE)
    assert code["workload_class"] == "code" and code["decision"]["arm"] == "embedded:ngram"
    assert explain(live, CHAT, temperature=1.2)["decision"]["arm"] == "embedded:off"
    tools = post(
        live,
        "/admin/route/explain",
        {
            "model": model(live),
            "messages": [{"role": "user", "content": "weather in Oslo?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        },
    ).json()
    assert tools["workload_class"] == "tool_call" and tools["class_rule"] == "tools"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"exploration_rate": 2}, "exploration_rate"),
        ({"classes": {"poetry": {"method": "off"}}}, "classes.poetry"),
        ({"classes": {"code": {"k_max": 100}}}, "classes.code.k_max"),
        ({"bogus": 1}, "bogus"),
        ({"max_batch_for_spec": "many"}, "max_batch_for_spec"),
        ({"deviation_z": 11}, "deviation_z"),
        ({"deviation_z": -1}, "deviation_z"),
    ],
)
def test_put_validation_names_the_field(live: LiveGateway, body: dict, field: str) -> None:
    r = httpx.put(f"{live.url}/admin/policy", json=body, headers=ADMIN)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"].startswith(field)


def test_put_refuses_inconsistent_rules_with_422(live: LiveGateway) -> None:
    cases = [
        ({"exploration_rate": 0.5, "exploration_cap": 0.1}, "exploration_rate"),
        ({"classes": {"code": {"k_min": 6, "k_max": 2}}}, "k_min"),
        ({"classes": {"code": {"method": "eagle9"}}}, "eagle9"),
    ]
    for body, word in cases:
        r = httpx.put(f"{live.url}/admin/policy", json=body, headers=ADMIN)
        assert r.status_code == 422 and word in r.json()["error"]["message"], r.text
    assert get(live, "/admin/policy").json()["version"] == 1  # nothing was recorded


def _seed_telemetry(db: str, n: int) -> None:
    """Synthetic finished requests (ngram doubles code, halves open chat) in the window."""
    engine = schema.make_engine(db)
    synth.insert(engine, n, seed=11)
    engine.dispose()


def test_retrain_with_too_little_data_is_refused(live: LiveGateway) -> None:
    r = post(live, "/admin/policy/retrain", {})
    assert r.status_code == 409
    err = r.json()["error"]
    assert err["code"] == "insufficient_telemetry" and "at least 200" in err["message"]


def test_edit_retrain_rollback_and_every_row_names_its_version(live: LiveGateway, db: str) -> None:
    # An operator edit: code stops speculating. A new version; requests now route by it.
    r = httpx.put(
        f"{live.url}/admin/policy", json={"classes": {"code": {"method": "off"}}, "note": "t"}, headers=ADMIN
    )
    assert r.status_code == 200, r.text
    assert r.json()["version"]["version"] == 2 and r.json()["version"]["source"] == "edit"
    assert explain(live, CODE)["decision"]["arm"] == "embedded:off"
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="user-key", max_retries=0)
    # Three tokens: below the retrain's minimum answer, so this real request (this machine's speed
    # on a tiny model, ~300 tok/s against the synthetic world's tens) stays out of the retrain below.
    # As the one held-out row the edited policy matched, it alone once moved the off-policy
    # interval across zero on a fast machine.
    reply = client.chat.completions.with_raw_response.create(
        model=model(live),
        messages=[{"role": "user", "content": CODE}],
        max_tokens=3,
        temperature=0.0,
    )
    rid = reply.headers["x-request-id"]
    route = reply.parse().model_extra["metrics"]["route"]  # type: ignore[index]
    assert (
        route["policy_version"] == "2"
        and route["arm"] == "embedded:off"
        and route["workload_class"] == "code"
    )

    engine = schema.make_engine(db)

    def row() -> dict | None:
        with engine.connect() as conn:
            got = conn.execute(select(requests).where(requests.c.request_id == rid)).mappings().first()
            return dict(got) if got else None

    assert wait_for(lambda: row() is not None, 10)
    stored = row()
    assert stored is not None and stored["policy_version"] == "2" and stored["route"]["arm"] == "embedded:off"
    assert stored["features"]["p_code"] > 0.5 and "load_running" in stored["features"]
    engine.dispose()

    # Retrain on synthetic telemetry: the learned policy wins its offline evaluation and is promoted.
    _seed_telemetry(db, 600)
    r = post(live, "/admin/policy/retrain", {})
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["rows"] == 600, result  # the synthetic world alone
    assert result["promoted"] and result["version"] == 3 and result["active_version"] == 3, result
    assert set(result["modelled_arms"]) == {"embedded:off", "embedded:ngram"}
    assert result["candidate"]["value_tokens_per_s"] > result["current"]["value_tokens_per_s"]
    code, chat = explain(live, CODE), explain(live, CHAT)
    assert code["decision"]["arm"] == "embedded:ngram" and chat["decision"]["arm"] == "embedded:off"
    assert set(code["predictions"]) == {"embedded:off", "embedded:ngram"}
    assert get(live, "/admin/policy").json()["kind"] == "learned"

    # Roll back to the fresh-install rules: open chat at temperature 0 speculates again.
    r = post(live, "/admin/policy/rollback/1")
    assert r.status_code == 200, r.text
    assert r.json()["version"]["source"] == "rollback" and r.json()["policy"]["kind"] == "rules"
    assert explain(live, CHAT)["decision"]["arm"] == "embedded:ngram"
    assert post(live, "/admin/policy/rollback/999").status_code == 404

    versions = get(live, "/admin/policy/versions").json()
    assert versions["active_version"] == 4
    assert [v["source"] for v in versions["versions"]] == ["rollback", "retrain", "edit", "default"]
    assert [v["status"] for v in versions["versions"]] == ["active", "retired", "retired", "retired"]
    assert versions["versions"][1]["metrics"]["promote"] is True and "artifact" not in versions["versions"][0]

    # Back to the learned version, then restart: the new process warm-starts from the database.
    assert post(live, "/admin/policy/rollback/3").status_code == 200


def test_stats_and_backends(live: LiveGateway) -> None:
    stats = get(live, "/admin/stats", params={"window": 1}).json()
    assert stats["totals"]["requests"] >= 600
    assert {"prompt_tokens", "cached_tokens", "cached_token_share"} <= set(stats["totals"])
    classes = {(r["workload_class"], r["spec_method"]) for r in stats["acceptance_by_class"]}
    assert ("code", "ngram") in classes and ("open_chat", "off") in classes
    assert any(r["policy_version"] == "2" for r in stats["by_policy_version"])
    assert get(live, "/admin/stats", params={"window": -1}).status_code == 422
    backends = get(live, "/admin/backends").json()
    assert backends["backends"][0]["name"] == "embedded" and backends["backends"][0]["healthy"]
    assert "load_running" in backends["engine_load"]


def test_openapi_lists_every_admin_route(live: LiveGateway) -> None:
    paths = set(httpx.get(f"{live.url}/openapi.json").json()["paths"])
    assert {
        "/admin/policy",
        "/admin/policy/retrain",
        "/admin/policy/versions",
        "/admin/policy/rollback/{version}",
        "/admin/route/explain",
        "/admin/stats",
        "/admin/backends",
    } <= paths
    assert httpx.get(f"{live.url}/docs").status_code == 200


def test_warm_start_after_restart(live: LiveGateway, tiny_llama_dir: Path, db: str) -> None:
    before = get(live, "/admin/policy").json()
    assert before["kind"] == "learned"
    live.stop()
    again = start_gateway(settings(tiny_llama_dir, db))
    try:
        after = get(again, "/admin/policy").json()
        assert (after["version"], after["kind"], after["modelled_arms"]) == (
            before["version"],
            "learned",
            before["modelled_arms"],
        )
        assert explain(again, CODE)["decision"]["arm"] == "embedded:ngram"
    finally:
        again.stop()


def test_without_telemetry_versions_live_in_memory(tiny_llama_dir: Path) -> None:
    s = tiny_settings(
        str(tiny_llama_dir),
        embedded={"enabled": False},
        telemetry={"enabled": False},
        admin_key="admin-secret-0123456789",
    )
    gw = start_gateway(s, wait_ready=False)
    try:
        assert get(gw, "/admin/policy").json()["persistent"] is False
        r = httpx.put(f"{gw.url}/admin/policy", json={"high_temperature": 0.5}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["policy"]["rules"]["high_temperature"] == 0.5
        assert [v["version"] for v in get(gw, "/admin/policy/versions").json()["versions"]] == [2, 1]
        r = post(gw, "/admin/policy/retrain")
        assert r.status_code == 409 and r.json()["error"]["code"] == "no_telemetry"
        assert get(gw, "/admin/stats").status_code == 409
    finally:
        gw.stop()
