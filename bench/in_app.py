"""Two tools that drive the gateway's app in this process, each its own command:
`specgate bench request-path`: which of the project's files one chat request passes through, in the
order it first enters them; `specgate bench screenshots`: the operator dashboard's pages as
docs/dashboard-*.png. (bench/README.md, "What each benchmark does", has the methods.)
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from specgate.bench import launch

# The checkout whose code runs (this interpreter's install of specgate).
ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("gateway", "engine", "policies")
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


def _app(model: str | None, tmp: str, cache_dir: str | None, **settings: Any) -> Any:
    """The gateway's app on `model`, its telemetry in SQLite under `tmp`."""
    from specgate.gateway.http.app import create_app
    from specgate.gateway.settings import Settings

    telemetry = {"url": f"sqlite:///{tmp}/telemetry.db", "auto_upgrade": True, "spool_dir": f"{tmp}/spool"}
    embedded = {"model": model} if model else {}
    return create_app(Settings(embedded=embedded, telemetry=telemetry, **settings), cache_dir=cache_dir)


def add_request_path_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream", action="store_true", help="trace a streamed request")
    p.add_argument("--model", help="a model file or directory (default: the embedded default model)")


def request_path(args: argparse.Namespace) -> int:
    order: dict[str, None] = {}
    active = threading.Event()
    prefixes = tuple(str(ROOT / f) + "/" for f in FOLDERS)

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and active.is_set() and frame.f_code.co_filename.startswith(prefixes):
            order.setdefault(frame.f_code.co_filename)

    threading.setprofile(hook)  # every thread started from now on: the server's, the engine's
    with tempfile.TemporaryDirectory() as tmp:
        app = _app(args.model, tmp, tmp)
        with launch.in_process(app) as url:
            store = app.state.services.store  # built at start-up
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            text = "Write a Python function that adds two numbers."
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 16}
            body["stream"] = args.stream
            for n in (1, 2):  # the first warms up: lazy imports, compiled graphs, caches
                if n == 2:
                    active.set()
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
                    r.raise_for_status()
                    for _ in r.iter_bytes():
                        pass
                deadline = time.monotonic() + 10
                while store.writer.counters.written + store.writer.counters.spooled < n:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the request's row was not written")
                    time.sleep(0.005)
            active.clear()
    files = [str(Path(f).relative_to(ROOT)) for f in order]
    kind = "streamed" if args.stream else "JSON"
    print(f"one {kind} chat request, {len(files)} project files, in the order first entered:")
    for i, f in enumerate(files, 1):
        print(f"{i:3d}  {f}")
    counts = {folder: sum(f.startswith(folder + "/") for f in files) for folder in FOLDERS}
    print("by folder: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


def traffic(url: str, n: int, max_tokens: int) -> None:
    rng = random.Random(0)
    admin = {"authorization": f"Bearer {KEY}"}
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    with httpx.Client(base_url=url, timeout=300) as client:
        for i in range(n):
            messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
            body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
            body["temperature"] = rng.choice([0.0, 0.0, 0.7])
            if i % 4 == 3:
                body["spec"] = {"method": rng.choice(["off", "ngram", "suffix"])}
            client.post("/v1/chat/completions", json=body)
            if i % 12 == 5:  # refused: an unknown model, no messages
                client.post("/v1/chat/completions", json={"model": "no-such-model", "messages": messages})
                client.post("/v1/chat/completions", json={"model": model, "messages": [], "max_tokens": -1})
            if i == n // 2:
                rule = {"classes": {"qa": {"k_max": 2}}, "note": "shorter K for QA"}
                client.put("/admin/policy", json=rule, headers=admin)
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
                page.locator(f"#{name.replace('speculation', 'spec')}-window").select_option("0")
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


def add_screenshots_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=48)
    launch.options(p, max_tokens=48, model=None, out=str(ROOT / "docs"))


def screenshots(args: argparse.Namespace) -> int:
    tmp, out = tempfile.mkdtemp(prefix="specgate-shots-"), Path(args.out)
    app = _app(args.model, tmp, None, admin_key=KEY, policy={"seed": 0}, log_requests=False)
    with launch.in_process(app) as url:
        traffic(url, args.requests, args.max_tokens)
        out.mkdir(parents=True, exist_ok=True)
        for path in shoot(url, out):
            print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0
