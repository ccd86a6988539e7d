"""The dashboard's Policy and Explain pages in a real browser: change a rule (after a confirmation)
and see the new version, diff it against the old one, roll back, retrain; explain a request and
see what the admin API says about it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.http.ui.dashboard import ADMIN, CODE, no_key_anywhere, show, sign_in
from tests.gateway.live import LiveGateway, wait_for

pytestmark = pytest.mark.slow  # a real browser on a live gateway


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
        "k_min": 0,
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
    # Retrain: ten requests of telemetry are too few, and the page says so (nothing is promoted).
    page.get_by_role("button", name="Retrain…").click()
    page.get_by_role("button", name="Confirm").click()
    refused = page.locator("#retrain-result").get_by_role("alert")
    assert "Retrain refused" in refused.inner_text() and "at least 200" in refused.inner_text()
    assert httpx.get(f"{live.url}/admin/policy", headers=ADMIN).json()["version"] == before + 2
    no_key_anywhere(page)


def test_explain_a_request(page: Any, live: LiveGateway, tiny_llama_dir: Path) -> None:
    sign_in(page)
    show(page, "explain")
    box = page.get_by_label("Chat completion request (JSON)")
    wait_for(lambda: tiny_llama_dir.name in box.input_value(), 10)
    body = {"model": tiny_llama_dir.name, "messages": [{"role": "user", "content": CODE}], "temperature": 0}
    box.fill(json.dumps(body))
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
