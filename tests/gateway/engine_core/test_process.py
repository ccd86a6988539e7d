"""The shared engine core as a process (`CoreProcess`, as `specgate serve` starts it) on the tiny
model, with a gateway app connected to it as a worker of `serve` is: the same output as the engine
thread, the prefix salt and aborts reaching the core, a killed core that costs its waiters a
retryable 503 and whose replacement the gateway reconnects to, a core that cannot load telling
each connection why, and no core left behind by `stop()` or by a supervisor that is gone. Each
core costs a few seconds (it imports torch), so the module starts as few as it can."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from specgate.gateway.backends.embedded.backend import EmbeddedBackend
from specgate.gateway.engine_core.client import EngineLoadFailed, SocketClient, connect
from specgate.gateway.engine_core.process import CoreProcess, LogSettings
from specgate.gateway.serve.supervisor import bind_unix
from specgate.gateway.settings import EmbeddedSettings
from specgate.gateway.worker_context import WorkerContext
from tests.gateway.live import (
    ADMIN_HEADERS,
    TEST_ADMIN_KEY,
    LiveGateway,
    start_gateway,
    tiny_settings,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
LONG = {"max_tokens": 480, "ignore_eos": True}  # about all the tiny model's context allows


@dataclass
class Served:
    live: LiveGateway  # a gateway app as one worker of `serve`
    core: CoreProcess
    listener: socket.socket
    path: str


def _start_core(listener: socket.socket, embedded: EmbeddedSettings) -> CoreProcess:
    core = CoreProcess(listener, functools.partial(embedded.engine_config, None), LogSettings.current())
    core.start()
    return core


@pytest.fixture(scope="module")
def run_dir() -> Iterator[str]:
    # Short: a Unix socket's path must fit in about 100 bytes, which pytest's tmp_path may not.
    where = tempfile.mkdtemp(prefix="sg-")
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, run_dir: str) -> Iterator[Served]:
    path = os.path.join(run_dir, "engine.sock")
    listener = bind_unix(path)
    settings = tiny_settings(str(tiny_llama_dir), log_requests=False, admin_key=TEST_ADMIN_KEY)
    core = _start_core(listener, settings.embedded)
    live = start_gateway(settings, worker=WorkerContext(0, 1, run_dir, engine_socket=path))
    yield Served(live, core, listener, path)
    live.stop()
    core.stop()
    listener.close()


def _backend(served: Served) -> EmbeddedBackend:
    backend = served.live.services.registry.embedded
    assert backend is not None
    return backend


def _client(served: Served) -> SocketClient:
    worker = _backend(served).client
    assert isinstance(worker, SocketClient)
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


def test_a_stream_through_the_core_is_token_for_token_the_engine_thread(
    served: Served, gateway: LiveGateway, model_name: str
) -> None:
    client, live = _client(served), served.live
    assert served.core.pid != os.getpid() and client.alive and _backend(served).engine is None
    body = _body(model_name, max_tokens=40)
    text = _stream_text(live, body)
    assert text and text == _stream_text(gateway, body)  # `gateway`: the engine thread, same model
    assert client.load.num_steps > 0  # the load figures come back with each step
    ready = httpx.get(f"{live.url}/readyz", headers=ADMIN_HEADERS).json()["checks"]["embedded_model"]
    assert ready["state"] == "ready" and ready["num_running"] == 0
    assert "specgate" in httpx.get(f"{live.url}/metrics").text


def test_the_prefix_salt_reaches_the_core(served: Served, model_name: str) -> None:
    """Requests share cached prompt blocks in the core only under the same salt: the salt made it
    through the socket to Engine.add_request."""

    def cached(salt: str) -> int:
        body = _body(model_name, max_tokens=2, cache_salt=salt)
        r = httpx.post(f"{served.live.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        value: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return value

    assert cached("core-a") == 0
    assert cached("core-a") > 0
    assert cached("core-b") == 0


def test_a_client_that_leaves_aborts_its_request_in_the_core(served: Served, model_name: str) -> None:
    client = _client(served)
    before = client.load.num_steps
    body = {**_body(model_name, **LONG), "stream": True}
    with httpx.stream("POST", f"{served.live.url}/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    assert wait_for(lambda: client.load.num_running == 0 and client.load.kv_blocks_used == 0, 10)
    assert client.load.num_steps - before < LONG["max_tokens"] - 100  # stopped early: the abort arrived


def test_a_killed_core_is_a_retryable_503_and_the_gateway_reconnects_to_its_replacement(
    served: Served, model_name: str
) -> None:
    backend, client, live = _backend(served), _client(served), served.live
    answers: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{live.url}/v1/chat/completions", json=_body(model_name, **LONG), timeout=60)
        )
    )
    waiter.start()
    assert wait_for(lambda: client.load.num_running == 1, 10)
    killed = served.core.process
    assert killed is not None and killed.pid is not None
    os.kill(killed.pid, signal.SIGKILL)
    waiter.join(30)
    (r,) = answers
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] in ("engine_restarting", "model_not_ready")
    assert wait_for(served.core.ended, 10)
    served.core.reap()  # what the serve supervisor does (serve/supervisor.py), then starts another
    assert killed.exitcode == -signal.SIGKILL  # reaped: no zombie
    served.core.start()
    assert wait_for(lambda: backend.client is not client and backend.healthy, 60)
    assert httpx.get(f"{live.url}/readyz", headers=ADMIN_HEADERS).status_code == 200 and backend.restarts == 1
    ok = httpx.post(f"{live.url}/v1/chat/completions", json=_body(model_name, max_tokens=5), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5


def test_stop_stops_the_core(served: Served) -> None:
    process = served.core.process
    assert process is not None
    served.core.stop()
    assert process.exitcode == 0 and not _alive(process.pid)


def test_a_core_that_cannot_load_tells_each_connection_and_exits_once_its_supervisor_is_gone(
    run_dir: str,
) -> None:
    path = os.path.join(run_dir, "failing.sock")
    listener = bind_unix(path)
    core = _start_core(listener, EmbeddedSettings(model=run_dir, device="cpu"))  # no weights there

    async def connect_twice() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(2):  # every connection is told, not just the first
            with pytest.raises(EngineLoadFailed, match="ModelNotFoundError"):
                await asyncio.wait_for(connect(path, loop), 60)

    try:
        asyncio.run(connect_twice())
        process = core.process
        assert process is not None and process.exitcode is None  # it waits to be stopped
        assert core._control is not None
        core._control.close()  # the supervisor's end closing, however it died
        process.join(30)
        assert process.exitcode == 0
    finally:
        core.stop()
        listener.close()


def _alive(pid: int | None) -> bool:
    assert pid is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
