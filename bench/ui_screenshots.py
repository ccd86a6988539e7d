"""Screenshots of the operator dashboard for README: docs/dashboard-*.png. Not part of the tests.

    python bench/ui_screenshots.py [--requests 48] [--max-tokens 48] [--model DIR] [--out docs]

Starts a gateway in this process (the embedded default model unless --model, telemetry in a
throwaway SQLite file), sends it real chat requests (every workload class, some with a forced
speculation method, a few refused ones), edits a rule and rolls it back so that the Policy page has
versions, then signs in with Chromium (Debian's, by path, as the tests do) and saves one PNG per
page at laptop width, and the Traffic page at phone width.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from specgate.gateway.http.app import create_app
from specgate.gateway.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("SPECGATE_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run"]
ARGS += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "adm-screenshots"
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "def merge(a, b):\n    # merge two sorted lists\n    out = []\n",
    "Summarize in two sentences: The city council met on Tuesday to discuss the new park. "
    "Residents asked for more trees, a playground and longer opening hours.",
    "What is 17 * 23? Explain step by step.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "Who wrote Pride and Prejudice?",
    "Tell me something fun about octopuses.",
    "Context: Paris is the capital of France. It has 2.1 million inhabitants.\n"
    "Question: How many people live in Paris?",
]


def serve(settings: Settings) -> tuple[str, uvicorn.Server, threading.Thread]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return url, server, thread
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the gateway did not become ready")


def traffic(url: str, n: int, max_tokens: int) -> None:
    rng = random.Random(0)
    admin = {"authorization": f"Bearer {KEY}"}
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    with httpx.Client(base_url=url, timeout=300) as client:
        for i in range(n):
            body: dict[str, Any] = {
                "model": model,
                "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_tokens": max_tokens,
                "temperature": rng.choice([0.0, 0.0, 0.7]),
            }
            if i % 4 == 3:
                body["spec"] = {"method": rng.choice(["off", "ngram", "suffix"])}
            client.post("/v1/chat/completions", json=body)
            if i % 12 == 5:
                client.post(
                    "/v1/chat/completions", json={"model": "no-such-model", "messages": body["messages"]}
                )
                client.post("/v1/chat/completions", json={"model": model, "messages": [], "max_tokens": -1})
            if i == n // 2:
                client.put(
                    "/admin/policy",
                    json={"classes": {"qa": {"k_max": 2}}, "note": "shorter K for QA"},
                    headers=admin,
                )
    time.sleep(1.0)  # the telemetry writer flushes every 0.2 s


def sign_in(page: Any) -> None:
    page.goto("/admin/ui/login")
    page.get_by_label("Admin key").fill(KEY)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("**/admin/ui")


def shoot(url: str, out: Path) -> list[Path]:
    from playwright.sync_api import sync_playwright

    saved = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1366, "height": 900}, base_url=url)
        page.goto("/admin/ui/login")
        saved.append(out / "dashboard-signin.png")
        page.screenshot(path=str(saved[-1]))
        sign_in(page)
        for name in ("traffic", "speculation", "policy", "explain", "backends"):
            page.goto(f"/admin/ui#{name}")
            page.wait_for_selector(f"#page-{name}:not([hidden])")
            page.wait_for_load_state("networkidle")
            if name in ("traffic", "speculation"):  # the run took a minute or two: 15-second steps
                prefix = {"traffic": "traffic", "speculation": "spec"}[name]
                page.locator(f"#{prefix}-window").select_option("0")
                page.wait_for_load_state("networkidle")
            if name == "policy":
                page.get_by_label("Version A").select_option("1")
                page.get_by_role("button", name="Compare").click()
                page.wait_for_selector("#diff-result table")
            if name == "explain":
                page.get_by_role("button", name="Explain").click()
                page.wait_for_selector("#explain-decision")
            page.wait_for_timeout(300)
            saved.append(out / f"dashboard-{name}.png")
            page.screenshot(path=str(saved[-1]), full_page=True)
        # A phone: a fresh page of its width (charts are drawn for the width they are shown at).
        phone = browser.new_page(viewport={"width": 390, "height": 844}, base_url=url)
        sign_in(phone)
        phone.locator("#traffic-window").select_option("0")
        phone.wait_for_load_state("networkidle")
        phone.wait_for_timeout(300)
        saved.append(out / "dashboard-phone.png")
        phone.screenshot(path=str(saved[-1]))
        browser.close()
    return saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--model", help="a model directory or GGUF file; default: the embedded default model")
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="specgate-shots-"))
    embedded: dict[str, Any] = {}
    if args.model:
        embedded["model"] = args.model
    settings = Settings(
        admin_key=KEY,
        embedded=embedded,
        telemetry={"url": f"sqlite:///{tmp / 'telemetry.db'}", "auto_upgrade": True},
        policy={"seed": 0},
        log_requests=False,
    )
    url, server, thread = serve(settings)
    try:
        traffic(url, args.requests, args.max_tokens)
        args.out.mkdir(parents=True, exist_ok=True)
        for path in shoot(url, args.out):
            print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    finally:
        server.should_exit = True
        thread.join(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
