"""What the dashboard's browser tests share: the admin key, driving the sign-in form and the page
switcher, reading tiles, the telemetry rows, and the check that no page shows the key."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.tables import requests
from tests.gateway.live import LiveGateway

KEY = "adm-Dash-7f3a9c-0123456789"
ADMIN = {"authorization": f"Bearer {KEY}"}
CODE = "Write a Python function that merges two sorted lists and returns the merged list."
PAGES = ("traffic", "speculation", "policy", "explain", "backends")


def db_rows(db: str) -> list[dict[str, Any]]:
    engine = schema.make_engine(db)
    try:
        with engine.connect() as conn:
            return [dict(r) for r in conn.execute(select(requests)).mappings()]
    finally:
        engine.dispose()


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
