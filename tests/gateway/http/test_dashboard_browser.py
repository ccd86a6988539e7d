"""The operator dashboard in a real browser (Chromium under Playwright) on a live gateway whose
telemetry comes from real requests to its embedded engine (the tiny random-weight model): sign in,
charts fed by those rows, a rule change and its new version, rollback, explain, backends, sign out;
a wrong key is refused, no page ever shows the key, and every page fits a phone's width."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.tables import requests
from tests.gateway.http.browser import launch
from tests.gateway.live import LiveGateway, start_gateway, tiny_settings, wait_for

KEY = "adm-Dash-7f3a9c"
ADMIN = {"authorization": f"Bearer {KEY}"}
CODE = "Write a Python function that merges two sorted lists and returns the merged list."
PAGES = ("traffic", "speculation", "policy", "explain", "backends")


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('dashboard') / 'telemetry.db'}"


def _rows(db: str) -> int:
    return len(db_rows(db))


def db_rows(db: str) -> list[dict[str, Any]]:
    engine = schema.make_engine(db)
    try:
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(select(requests)).mappings()]
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path, db: str) -> Iterator[LiveGateway]:
    gw = start_gateway(
        tiny_settings(
            str(tiny_llama_dir),
            admin_key=KEY,
            telemetry={"url": db, "auto_upgrade": True, "flush_interval": 0.05},
            policy={"seed": 0},
            ui={"max_failed_signins": 3, "signin_lockout": 60},
        )
    )
    model = tiny_llama_dir.name
    prompts = [CODE, "Summarize: the cat sat on the mat. The mat was red.", "What is 12 * 7?", CODE]
    sent = 0
    with httpx.Client(base_url=gw.url, timeout=120) as client:
        for i, text in enumerate(prompts * 2):
            body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}]}
            body.update(max_tokens=12, temperature=0.0)
            if i % 4 == 3:
                body["spec"] = {"method": "off"}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            sent += 1
        # Two refused requests: errors by code on the Traffic page.
        assert client.post("/v1/chat/completions", json={"model": model, "messages": []}).status_code == 400
        bad = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/chat/completions", json=bad).status_code == 404
        sent += 2
    assert wait_for(lambda: _rows(db) == sent, 20)
    gw.app.state.sent = sent
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from launch()


@pytest.fixture
def page(browser: Any, live: LiveGateway) -> Iterator[Any]:
    context = browser.new_context(base_url=live.url, viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.on("dialog", lambda d: d.dismiss())  # no native dialogs: confirmations are our <dialog>
    yield pg
    context.close()
    assert not errors, errors


def sign_in(page: Any, key: str = KEY) -> None:
    page.goto("/admin/ui")
    assert page.url.endswith("/admin/ui/login")
    page.get_by_label("Admin key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    if key == KEY:
        page.wait_for_url("**/admin/ui")


def tile(page: Any, name: str, label: str) -> str:
    return str(page.locator(f'#page-{name} [data-tile="{label}"] .value').inner_text())


def error_codes(live: LiveGateway) -> list[str]:
    return [r.error_code for r in live.services.recent.records if r.outcome == "error"]


def show(page: Any, name: str) -> None:
    page.get_by_role("link", name=name.capitalize()).click()
    page.wait_for_selector(f"#page-{name}:not([hidden])")


def no_key_anywhere(page: Any) -> None:
    assert KEY not in page.content()
    assert KEY not in page.url
    storage = page.evaluate("() => JSON.stringify([document.cookie, {...localStorage}, {...sessionStorage}])")
    assert KEY not in storage and "specgate_admin" not in storage  # HttpOnly: no script sees it


def test_wrong_key_is_refused(page: Any) -> None:
    sign_in(page, "adm-wrong-guess")
    alert = page.get_by_role("alert")
    assert "Wrong admin key" in alert.inner_text()
    assert page.url.endswith("/admin/ui/login") and "adm-wrong-guess" not in page.content()
    assert page.get_by_label("Admin key").input_value() == ""
    assert not page.context.cookies()
    page.goto("/admin/ui")  # still not signed in
    assert page.url.endswith("/admin/ui/login")


def test_sign_in_sets_a_safe_cookie_and_traffic_shows_the_real_rows(page: Any, live: LiveGateway) -> None:
    sign_in(page)
    page.wait_for_url("**/admin/ui")
    (cookie,) = page.context.cookies()
    assert cookie["name"] == "specgate_admin" and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert cookie["path"] == "/admin" and not cookie["secure"]  # plain HTTP on loopback
    assert 8 * 3600 - 60 < cookie["expires"] - time.time() <= 8 * 3600
    assert KEY not in cookie["value"]
    page.wait_for_selector("#chart-rate svg path[data-series='all']")
    assert tile(page, "traffic", "Requests") == str(live.app.state.sent)
    assert tile(page, "traffic", "Error rate") == "20.0%"  # 2 of 10
    # The chart's own numbers (its data table) add up to the rows the requests left.
    rows = page.locator("#chart-rate tbody tr")
    per_step = [float(t) for t in rows.evaluate_all("rs => rs.map(r => r.cells[1].textContent)") if t != "–"]
    step = 60.0
    assert round(sum(per_step) * step) == live.app.state.sent
    assert page.locator("#chart-ttft svg circle").count() >= 3  # p50 / p90 / p99 of the busy step
    codes = page.locator("#chart-errors svg rect[data-series]").evaluate_all(
        "rs => rs.map(r => r.dataset.series)"
    )
    assert sorted(codes) == sorted(error_codes(live))
    assert "embedded" in page.locator('table[data-table="Traffic by model and backend"]').inner_text()
    no_key_anywhere(page)


def test_speculation_page_shows_acceptance_and_route_mix(page: Any, db: str) -> None:
    sign_in(page)
    show(page, "speculation")
    page.wait_for_selector("#chart-mix svg")
    arms = page.locator("#chart-mix .legend li").all_inner_texts()
    ok = [r for r in db_rows(db) if r["outcome"] == "ok"]
    assert set(arms) == {f"{r['backend']}:{r['spec_method']}" for r in ok} >= {"embedded:off"}
    drafted = sum(r["num_draft_tokens"] or 0 for r in ok)
    assert tile(page, "speculation", "Drafted tokens") == str(drafted)
    table = page.locator('table[data-table="Acceptance by class and method"]').inner_text()
    assert "code" in table and "ngram" in table
    no_key_anywhere(page)


def test_change_a_rule_see_a_new_version_then_roll_back(page: Any, live: LiveGateway) -> None:
    sign_in(page)
    show(page, "policy")
    page.wait_for_selector("#rules-form")
    before = httpx.get(f"{live.url}/admin/policy", headers=ADMIN).json()["version"]
    page.get_by_label("code method").select_option("off")
    page.get_by_label("code k_max").fill("5")
    page.get_by_role("button", name="Save as a new version…").click()
    dialog = page.get_by_role("dialog")
    assert "code.method: ngram → off" in dialog.inner_text()
    page.get_by_role("button", name="Cancel").click()  # cancelled: nothing changes
    assert httpx.get(f"{live.url}/admin/policy", headers=ADMIN).json()["version"] == before
    page.get_by_role("button", name="Save as a new version…").click()
    page.get_by_role("button", name="Confirm").click()
    page.get_by_role("status").get_by_text(f"Version {before + 1} is now active.").wait_for()
    policy = httpx.get(f"{live.url}/admin/policy", headers=ADMIN).json()
    assert policy["version"] == before + 1
    assert policy["rules"]["classes"]["code"] == {
        "method": "off",
        "k_min": 1,
        "k_max": 5,
        "controller": "goodput",
    }
    page.locator("#page-policy h2", has_text=f"Rules of version {before + 1}").wait_for()
    # The diff of the two versions names exactly the two changes.
    page.get_by_label("Version A").select_option(str(before))
    page.get_by_label("Version B").select_option(str(before + 1))
    page.get_by_role("button", name="Compare").click()
    diff = page.locator("#diff-result table tbody tr")
    diff.first.wait_for()
    assert diff.all_inner_texts() == [
        "rules.classes.code.k_max\t8\t5",
        "rules.classes.code.method\tngram\toff",
    ]
    # Roll back to the version before: a new version with the old rules.
    page.get_by_role("button", name=f"Roll back to v{before}…").click()
    page.get_by_role("button", name="Confirm").click()
    page.get_by_role("status").get_by_text(f"Rolled back: version {before + 2} is now active.").wait_for()
    policy = httpx.get(f"{live.url}/admin/policy", headers=ADMIN).json()
    assert policy["version"] == before + 2 and policy["rules"]["classes"]["code"]["method"] == "ngram"
    versions = page.locator('table[data-table="Policy versions"]').inner_text()
    assert "rollback" in versions and "edit" in versions
    no_key_anywhere(page)


def test_explain_a_request(page: Any, live: LiveGateway, tiny_llama_dir: Path) -> None:
    sign_in(page)
    show(page, "explain")
    box = page.get_by_label("Chat completion request (JSON)")
    wait_for(lambda: tiny_llama_dir.name in box.input_value(), 10)
    body = {"model": tiny_llama_dir.name, "messages": [{"role": "user", "content": CODE}], "temperature": 0}
    box.fill(__import__("json").dumps(body))
    page.get_by_role("button", name="Explain").click()
    page.locator("#explain-decision").wait_for()
    expected = httpx.post(f"{live.url}/admin/route/explain", json=body, headers=ADMIN).json()
    assert page.locator("#explain-class").inner_text() == expected["workload_class"] == "code"
    assert page.locator("#explain-arm").inner_text() == expected["decision"]["arm"]
    assert page.locator("#explain-reason").inner_text() == expected["decision"]["reason"]
    arms = page.locator("#explain-arms li").evaluate_all("ls => ls.map(l => l.dataset.name)")
    assert arms == expected["arms"]
    assert page.locator("#explain-arms li.chosen").get_attribute("data-name") == expected["decision"]["arm"]
    features = page.locator('table[data-table="Features"]').inner_text()
    assert "copyability" in features and "p_code" in features
    box.fill("{not json")
    page.get_by_role("button", name="Explain").click()
    assert "Not valid JSON" in page.get_by_role("alert").inner_text()
    box.fill('{"model": "x", "messages": []}')
    page.get_by_role("button", name="Explain").click()
    page.get_by_role("alert").get_by_text("Refused:").wait_for()


def test_backends_page(page: Any, tiny_llama_dir: Path) -> None:
    sign_in(page)
    show(page, "backends")
    first = page.locator('table[data-table="Backends"] tbody tr').first
    first.get_by_text("healthy").wait_for()
    text = first.inner_text()
    assert text.startswith("embedded") and tiny_llama_dir.name in text
    assert "load_running" in page.locator('table[data-table="Engine load"]').inner_text()


def test_keyboard_labels_and_phone_width(page: Any) -> None:
    sign_in(page)
    page.wait_for_selector("#chart-rate")
    # Every control has a label a screen reader announces.
    for name in PAGES:
        show(page, name)
        page.wait_for_load_state("networkidle")
        unlabeled = page.evaluate(
            """() => [...document.querySelectorAll('section.page:not([hidden]) :is(input, select, textarea)')]
                .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label'))
                .map(e => e.outerHTML)"""
        )
        assert not unlabeled, unlabeled
    # Keyboard only: Tab to the Speculation link, Enter, and the page's heading has the focus.
    page.goto("/admin/ui#traffic")
    page.reload()
    page.wait_for_selector("#chart-rate")
    focused = []
    for _ in range(3):
        page.keyboard.press("Tab")
        focused.append(page.evaluate("document.activeElement.textContent"))
    assert focused == ["Skip to content", "Traffic", "Speculation"]
    page.keyboard.press("Enter")
    page.wait_for_selector("#page-speculation:not([hidden])")
    assert page.evaluate("document.activeElement.id") == "h-speculation"
    # A phone: nothing wider than the screen, on every page.
    page.set_viewport_size({"width": 390, "height": 844})
    for name in PAGES:
        show(page, name)
        page.wait_for_load_state("networkidle")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), name
        no_key_anywhere(page)


def test_sign_out_ends_the_session(page: Any, live: LiveGateway) -> None:
    sign_in(page)
    (cookie,) = page.context.cookies()
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url("**/admin/ui/login")
    assert not page.context.cookies()
    page.goto("/admin/ui")
    assert page.url.endswith("/admin/ui/login")
    # The old cookie, replayed, opens nothing.
    jar = {"specgate_admin": cookie["value"]}
    assert httpx.get(f"{live.url}/admin/policy", cookies=jar).status_code == 401
