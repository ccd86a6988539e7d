"""The engine in its own process (engine_process = true), with a real engine-core child on the tiny
model: the same output as thread mode, aborts that reach the child, a killed child that costs its
waiters a retryable 503 and is replaced, and no child left behind by close() or by a gateway that
is gone. Each child costs a few seconds (it imports torch), so the module starts as few as it can."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specgate.engine.config import EngineConfig
from specgate.gateway.backends.embedded.backend import EmbeddedBackend
from specgate.gateway.backends.embedded.process import EngineProcess
from tests.gateway.live import (
    ADMIN_HEADERS,
    TEST_ADMIN_KEY,
    LiveGateway,
    start_gateway,
    tiny_settings,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)
LONG = {"max_tokens": 480, "ignore_eos": True}  # about all the tiny model's context allows


@pytest.fixture(scope="module")
def core(tiny_llama_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(
        tiny_settings(
            str(tiny_llama_dir),
            embedded={"engine_process": True},
            log_requests=False,
            admin_key=TEST_ADMIN_KEY,
        )
    )
    yield live
    live.stop()


def _backend(live: LiveGateway) -> EmbeddedBackend:
    backend = live.services.registry.embedded
    assert backend is not None
    return backend


def _process(live: LiveGateway) -> EngineProcess:
    worker = _backend(live).worker
    assert isinstance(worker, EngineProcess)
    return worker


def _body(model: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "tell me about the sea"}]
    return {"model": model, "messages": messages, "temperature": 0, **extra}


def _stream_text(live: LiveGateway, body: dict[str, Any]) -> str:
    text = []
    with httpx.stream(
        "POST", f"{live.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def test_a_stream_through_the_core_is_token_for_token_thread_mode(
    core: LiveGateway, gateway: LiveGateway, model_name: str
) -> None:
    proc = _process(core)
    assert proc.process.pid != os.getpid() and proc.alive and _backend(core).engine is None
    body = _body(model_name, max_tokens=40)
    served = _stream_text(core, body)
    assert served and served == _stream_text(gateway, body)  # `gateway`: thread mode, same model
    assert proc.load.steps > 0  # the load figures come back with each step
    ready = httpx.get(f"{core.url}/readyz", headers=ADMIN_HEADERS).json()["checks"]["embedded_model"]
    assert ready["state"] == "ready" and ready["num_running"] == 0
    assert "specgate" in httpx.get(f"{core.url}/metrics").text


def test_the_prefix_salt_reaches_the_core(core: LiveGateway, model_name: str) -> None:
    """Requests share cached prompt blocks in the child only under the same salt: the salt made it
    through the socket to Engine.add_request."""

    def cached(salt: str) -> int:
        body = _body(model_name, max_tokens=2, cache_salt=salt)
        r = httpx.post(f"{core.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        value: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return value

    assert cached("core-a") == 0
    assert cached("core-a") > 0
    assert cached("core-b") == 0


def test_a_client_that_leaves_aborts_its_request_in_the_core(core: LiveGateway, model_name: str) -> None:
    proc = _process(core)
    before = proc.load.steps
    with httpx.stream(
        "POST", f"{core.url}/v1/chat/completions", json={**_body(model_name, **LONG), "stream": True}
    ) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    assert wait_for(lambda: proc.load.num_running == 0 and proc.load.kv_blocks_used == 0, 10)
    assert proc.load.steps - before < LONG["max_tokens"] - 100  # stopped early: the abort arrived


def test_a_killed_core_is_a_retryable_503_and_a_new_core_serves(core: LiveGateway, model_name: str) -> None:
    backend, proc = _backend(core), _process(core)
    answers: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{core.url}/v1/chat/completions", json=_body(model_name, **LONG), timeout=60)
        )
    )
    waiter.start()
    assert wait_for(lambda: proc.load.num_running == 1, 10)
    os.kill(proc.process.pid, signal.SIGKILL)
    waiter.join(30)
    (r,) = answers
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] in ("engine_restarting", "model_not_ready")
    assert wait_for(lambda: backend.worker is not proc and backend.healthy, 60)
    assert httpx.get(f"{core.url}/readyz", headers=ADMIN_HEADERS).status_code == 200 and backend.restarts == 1
    ok = httpx.post(f"{core.url}/v1/chat/completions", json=_body(model_name, max_tokens=5), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
    assert proc.process.exitcode == -signal.SIGKILL  # reaped: no zombie


def test_close_stops_the_core(core: LiveGateway) -> None:
    proc = _process(core)
    core.stop()  # the gateway's shutdown closes the backend
    assert proc.process.exitcode == 0 and not _alive(proc.process.pid)


def test_a_core_whose_gateway_is_gone_exits_by_itself(tiny_llama_dir: Path) -> None:
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", num_blocks=64, block_size=4
    )

    async def orphan() -> EngineProcess:
        proc = EngineProcess(config, asyncio.get_running_loop())
        info = await proc.start()
        assert info.vocab_size == 96 and info.max_model_len == 64 * 4 and "ngram" in info.methods
        proc._channel.close()  # what the gateway's exit does to its end of the socket
        return proc

    proc = asyncio.run(orphan())
    proc.process.join(30)
    assert proc.process.exitcode == 0


def _alive(pid: int | None) -> bool:
    assert pid is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
