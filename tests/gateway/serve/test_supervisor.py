"""`specgate serve --workers 2` as operators run it: a real supervisor, two worker processes on one
port, one engine core on the tiny model, and a stub upstream, all on loopback. Both workers serve
(each names its pid in `x-specgate-worker`), the shared engine answers greedy requests token for
token as a single-process gateway does, any worker's /metrics counts every worker's requests, a
killed core costs a retryable 503 and comes back, a killed worker is replaced, and SIGTERM leaves no
process and no run directory behind. The fleet's tests share one fleet and run in order (about 45 s
on two cores, most of it three processes importing torch)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from specgate.gateway.cli.main import build_parser, main
from specgate.gateway.cli.serve import serve_settings
from specgate.gateway.serve.supervisor import MAX_BACKOFF, STABLE_AFTER, Restarts
from tests.gateway.cli.procs import children, cmdline, gone, maps_torch
from tests.gateway.fake_upstream import FakeUpstream, metric_value
from tests.gateway.live import free_port, wait_for, wait_until_ready

pytestmark = pytest.mark.timeout(180)
PROMPT = [{"role": "user", "content": "tell me about the sea"}]
HEADER = "x-specgate-worker"


@dataclass
class Fleet:
    proc: subprocess.Popen[bytes]
    url: str
    model: str
    tmp: str  # the supervisor's TMPDIR: its run directory is made here
    log: Path
    seen: set[int] = field(default_factory=set)  # worker pids that answered

    def client(self) -> openai.OpenAI:
        # A client (and so a connection) per call: the kernel picks a worker per connection.
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def chat(self, model: str | None = None, **extra: object) -> tuple[int, str]:
        """(worker pid, text) of one greedy chat completion over a new connection."""
        with self.client() as client:
            raw = client.chat.completions.with_raw_response.create(
                model=model or self.model, messages=PROMPT, temperature=0, **extra
            )
        pid = int(raw.headers[HEADER])
        self.seen.add(pid)
        return pid, raw.parse().choices[0].message.content or ""

    def requests_counted(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            metric_value(text, "specgate_requests_total", backend=b, status="200") or 0.0
            for b in ("embedded", "stub")
        )

    def children(self) -> set[int]:
        return children(self.proc.pid)

    def core_pid(self) -> int | None:
        """The spawned child that is neither a worker nor multiprocessing's resource tracker (None
        while there is not exactly one: a core being restarted, a worker not seen yet)."""
        pids = {p for p in self.children() if p not in self.seen and b"resource_tracker" not in cmdline(p)}
        return next(iter(pids)) if len(pids) == 1 else None


# ---- without processes ---------------------------------------------------------------------------


def test_the_workers_flag_and_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def workers(*argv: str) -> int:
        value: int = serve_settings(build_parser().parse_args(["serve", *argv])).workers
        return value

    assert workers() == 1  # one process, as before
    assert workers("--workers", "4") == 4
    for bad in ("0", "65"):  # refused before anything starts
        assert main(["serve", "--workers", bad]) == 2
        assert "workers" in capsys.readouterr().err
    monkeypatch.setenv("SPECGATE_WORKERS", "3")
    assert workers() == 3


def test_one_engine_core_is_shared_so_an_engine_thread_is_refused() -> None:
    with pytest.raises(ValueError, match="--engine-thread"):
        serve_settings(build_parser().parse_args(["serve", "--workers", "2", "--engine-thread"]))


def test_a_child_that_keeps_dying_waits_longer_each_time() -> None:
    r = Restarts()
    r.start(0.0)
    waits = []
    for _ in range(8):
        waits.append(r.ended(r.started + 1.0))  # died a second after its start
        r.start(r.due)
    assert waits[:3] == [0.5, 1.0, 2.0] and waits[-1] == MAX_BACKOFF
    r.start(100.0)
    assert r.ended(100.0 + STABLE_AFTER + 1) == 0.0  # after a long run: at once


# ---- a real fleet ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path) -> Iterator[Fleet]:
    tmp = tempfile.mkdtemp(prefix="sgw-")  # short: it holds the engine core's Unix socket
    stub = FakeUpstream(models=("stub-model",), text="stubbed").start()
    config = Path(tmp) / "specgate.json"
    config.write_text(
        json.dumps(
            {
                "embedded": {"model": str(tiny_llama_dir), "dtype": "float32", "device": "cpu"}
                | {"num_blocks": 256, "block_size": 4},
                "backends": [{"name": "stub", "base_url": stub.base_url, "models": ["stub-model"]}],
                "log_requests": False,
            }
        )
    )
    port = free_port()
    log = Path(tmp) / "serve.log"
    argv = ["serve", "--config", str(config), "--port", str(port), "--workers", "2"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specgate.gateway.cli.main", *argv],
            env={**os.environ, "TMPDIR": tmp},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so that teardown can end whatever is left of it, and only it
        )
    fleet = Fleet(proc, f"http://127.0.0.1:{port}", tiny_llama_dir.name, tmp, log)
    try:
        wait_until_ready(fleet.url, time.monotonic() + 120)
        yield fleet
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        stub.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_both_workers_serve_and_the_shared_engine_answers_as_one_process_does(
    fleet: Fleet, client: openai.OpenAI
) -> None:
    # `client`: a single-process gateway (tests/gateway/conftest.py) on the same tiny model.
    alone = client.chat.completions.create(model=fleet.model, messages=PROMPT, temperature=0, max_tokens=12)
    expected = alone.choices[0].message.content
    assert expected
    answers = []
    for _ in range(60):
        answers.append(fleet.chat(max_tokens=12)[1])
        if len(fleet.seen) == 2 and len(answers) >= 4:
            break
    assert len(fleet.seen) == 2, f"one worker answered all {len(answers)} connections"
    assert set(answers) == {expected}
    # Several at once over several connections: batched together in the one engine.
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(fleet.chat(max_tokens=12)[1])) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [expected] * 4
    _, stubbed = fleet.chat(model="stub-model")
    assert stubbed == "stubbed"  # the external backend, from a worker
    total = len(answers) + len(results) + 1
    # Whichever worker answers /metrics counts both workers' requests (settled just after the answer).
    assert wait_for(lambda: fleet.requests_counted() == total, 10), fleet.requests_counted()
    assert fleet.requests_counted() == total


@pytest.mark.slow
def test_only_the_engine_core_loads_torch(fleet: Fleet) -> None:
    """The supervisor and the workers serve without torch (about 0.3 GB of RSS each): the core owns it."""
    core = fleet.core_pid()
    assert core is not None and len(fleet.seen) == 2
    assert maps_torch(core)
    assert not any(maps_torch(pid) for pid in (fleet.proc.pid, *fleet.seen))


@pytest.mark.slow
def test_a_killed_core_is_a_retryable_503_and_the_workers_reconnect(fleet: Fleet) -> None:
    core = fleet.core_pid()
    assert core is not None
    answers: list[Exception | tuple[int, str]] = []

    def long_request() -> None:
        try:
            # All the context allows: it must still be running when the core dies.
            answers.append(fleet.chat(max_tokens=480, extra_body={"ignore_eos": True}))
        except Exception as exc:
            answers.append(exc)

    waiter = threading.Thread(target=long_request)
    waiter.start()
    time.sleep(0.15)  # let it reach the engine
    os.kill(core, signal.SIGKILL)
    waiter.join(30)
    (failed,) = answers
    assert isinstance(failed, openai.APIStatusError) and failed.status_code == 503, failed
    assert failed.response.headers["retry-after"]
    assert wait_for(lambda: fleet.core_pid() not in (None, core), 20)  # the supervisor started another

    def served() -> bool:
        try:
            return all(fleet.chat(max_tokens=2)[1] for _ in range(6))  # both workers, most likely
        except openai.APIStatusError:
            return False

    assert wait_for(served, 60, interval=0.5)


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_its_counts_are_kept(fleet: Fleet) -> None:
    before = fleet.requests_counted()
    victim = next(iter(fleet.seen & fleet.children()))
    os.kill(victim, signal.SIGKILL)
    assert wait_for(lambda: gone(victim), 10)
    fleet.seen.discard(victim)
    workers_before = set(fleet.seen)

    def replaced() -> bool:
        # The other worker serves meanwhile; then a new pid answers in the victim's place.
        return fleet.chat(max_tokens=2)[0] not in workers_before | {victim}

    assert wait_for(replaced, 60, interval=0.2)
    assert victim not in fleet.children()
    assert fleet.requests_counted() >= before  # a dead worker's requests stay counted


@pytest.mark.slow
def test_sigterm_stops_every_process_and_removes_the_run_directory(fleet: Fleet) -> None:
    family = fleet.children()
    assert len(family) >= 3  # two workers, the core (and multiprocessing's resource tracker)
    fleet.proc.send_signal(signal.SIGTERM)
    assert fleet.proc.wait(30) == 0
    assert wait_for(lambda: all(gone(p) for p in family), 10)
    assert [p.name for p in Path(fleet.tmp).iterdir() if p.name.startswith("specgate-")] == []
    out = fleet.log.read_text()
    assert "Traceback" not in out, out[-3000:]
