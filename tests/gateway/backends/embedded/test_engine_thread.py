"""The engine core on a thread of the gateway (`InprocClient`) is supervised: a broken engine is
rebuilt, a dead thread replaced by the backend's watchdog, and /readyz says what is going on
meanwhile. Never a permanent 503."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from specgate.gateway.backends.embedded.backend import EmbeddedBackend
from specgate.gateway.engine_core.client import InprocClient
from tests.gateway.live import (
    ADMIN_HEADERS,
    TEST_ADMIN_KEY,
    LiveGateway,
    start_gateway,
    tiny_settings,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def live(tiny_llama_dir: Path) -> Iterator[LiveGateway]:
    gw = start_gateway(tiny_settings(str(tiny_llama_dir), log_requests=False, admin_key=TEST_ADMIN_KEY))
    yield gw
    gw.stop()


def _chat(live: LiveGateway, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=30)


def _embedded(live: LiveGateway) -> EmbeddedBackend:
    backend = live.services.registry.embedded
    assert backend is not None and isinstance(backend.client, InprocClient)  # thread mode: faults injected
    return backend


def test_a_broken_engine_is_rebuilt_and_readyz_says_so(live: LiveGateway, tiny_llama_dir: Path) -> None:
    model = tiny_llama_dir.name
    backend = _embedded(live)
    worker = backend.client
    assert isinstance(worker, InprocClient)

    def broken(*_: object) -> None:
        raise RuntimeError("device lost")

    worker.engine.runner.execute_with_hidden = broken  # type: ignore[method-assign]
    build = worker.core.factory
    assert build is not None

    def slow_build():  # type: ignore[no-untyped-def]
        time.sleep(1.5)  # long enough to see the rebuild from outside
        return build()

    worker.core.factory = slow_build
    failures = [_chat(live, model) for _ in range(3)]  # each step fails: the engine is judged broken
    assert all(r.status_code in (500, 503) for r in failures)
    assert all(set(r.json()["error"]) == {"message", "type", "param", "code"} for r in failures)
    assert wait_for(lambda: worker.state == "rebuilding", 10)
    ready = httpx.get(f"{live.url}/readyz", headers=ADMIN_HEADERS)
    assert ready.status_code == 503 and ready.json()["checks"]["embedded_model"]["state"] == "rebuilding"
    during = _chat(live, model)
    assert during.status_code == 503 and during.json()["error"]["code"] == "model_not_ready"
    assert int(during.headers["retry-after"]) >= 1
    assert wait_for(lambda: httpx.get(f"{live.url}/readyz", headers=ADMIN_HEADERS).status_code == 200, 30)
    assert _chat(live, model).status_code == 200
    assert backend.status()["rebuilds"] == 1 and worker.engine.consecutive_forward_failures == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_is_replaced(live: LiveGateway, tiny_llama_dir: Path) -> None:
    model = tiny_llama_dir.name
    backend = _embedded(live)
    old = backend.client
    assert isinstance(old, InprocClient)

    def die(*_: object) -> None:
        raise SystemExit("the thread ends")  # not an Exception: the loop's own guard lets it through

    old.core._step = die  # type: ignore[method-assign]
    first = _chat(live, model)
    assert first.status_code == 503 and first.json()["error"]["code"] in (
        "engine_restarting",
        "model_not_ready",
    )
    assert wait_for(lambda: backend.client is not old and backend.healthy, 30)
    assert _chat(live, model).status_code == 200
    assert (
        httpx.get(f"{live.url}/readyz", headers=ADMIN_HEADERS).status_code == 200
        and backend.status()["rebuilds"] == 1
    )
