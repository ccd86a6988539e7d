"""The operator dashboard in a real browser (Chromium under Playwright), on the live gateway of
conftest.py whose telemetry comes from real requests to its embedded engine: sign in, charts fed by
those rows and refreshed live, the Speculation and Backends pages, keyboard use, labels, a phone's
width, sign out; a wrong key is refused and no page ever shows the key."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.http.ui.dashboard import (
    KEY,
    PAGES,
    db_rows,
    error_codes,
    no_key_anywhere,
    show,
    sign_in,
    tile,
)
from tests.gateway.live import LiveGateway

pytestmark = pytest.mark.slow  # a real browser on a live gateway


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


def test_traffic_refreshes_live(page: Any, live: LiveGateway, tiny_llama_dir: Path) -> None:
    sign_in(page)
    page.wait_for_selector("#chart-rate svg")
    page.get_by_label("Refresh").first.select_option("5")
    sent = live.app.state.sent
    body = {"model": tiny_llama_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    live.app.state.sent = sent + 1
    # No click, no reload: the page asks again within its 5 s.
    locator = page.locator('#page-traffic [data-tile="Requests"] .value')
    locator.get_by_text(str(sent + 1), exact=True).wait_for(timeout=15_000)


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
