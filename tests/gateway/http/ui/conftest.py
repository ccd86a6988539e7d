"""One live gateway for the dashboard's browser tests (this package), its telemetry made by real
requests to the embedded engine (the tiny random-weight model), and Debian's Chromium."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.http.ui.browser import launch
from tests.gateway.http.ui.dashboard import CODE, KEY, db_rows
from tests.gateway.live import LiveGateway, start_gateway, tiny_settings, wait_for


@pytest.fixture(scope="package")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('dashboard') / 'telemetry.db'}"


@pytest.fixture(scope="package")
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
    assert wait_for(lambda: len(db_rows(db)) == sent, 20)
    gw.app.state.sent = sent
    yield gw
    gw.stop()


@pytest.fixture(scope="package")
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
