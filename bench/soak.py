"""`specgate bench soak`: a gateway under sustained, hostile, failing load, and what it lost.

    specgate bench soak --minutes 10 --concurrency 64

Starts a gateway process (the embedded default model, or --model) in front of its engine and of a
stub external backend, with telemetry in a fresh PostgreSQL database reached through a TCP proxy
(SQLite when no PostgreSQL answers: then there is no database outage). Streaming clients send
requests for the whole run, some of them hostile (numbers out of range, broken JSON, lone
surrogates, unknown methods) and some disconnecting mid-stream. A third of the way in the database
goes away for a fifth of the run; halfway the external backend is killed and restarted later.

Reports requests sent, answers by status, 500s (must be 0), telemetry rows written against requests
sent (must be equal), KV blocks still held once idle (must be 0) and the gateway's RSS growth from
the end of the warm-up to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from specgate.bench.stub_backend import MODEL as STUB_MODEL
from specgate.bench.stub_backend import free_port, launch
from specgate.bench.tcp_proxy import TcpProxy

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
NEVER_SENT = {"ConnectError", "ConnectTimeout", "PoolTimeout"}
PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog did not mind at all.",
    "What is 17 times 23? Think step by step.",
    "Translate to French: Good morning, how are you today?",
    "Tell me a short story about a lighthouse keeper.",
    "Return a JSON object with keys name and age for Alice, 30.",
]
# Requests no client should send; each must get a clean 4xx and leave one row.
HOSTILE: list[dict[str, Any] | bytes] = [
    {"seed": 2**64},
    {"temperature": 1e-50, "max_tokens": 8},
    {"top_p": 5e-324, "temperature": 1.0, "max_tokens": 8},
    {"stop_token_ids": [10**7]},
    {"spec": {"method": "no-such-method"}},
    {"model": "\ud800"},
    {"messages": []},
    {"logprobs": True, "top_logprobs": 10**6},
    b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b"[" * 5000 + b"]" * 5000,
    b"{not json",
]


@dataclass
class Tally:
    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: Counter[str] = field(default_factory=Counter)  # by exception class
    failed_ids: list[tuple[str, str, float]] = field(default_factory=list)  # (id, error, seconds in)
    disconnects: int = 0
    stream_errors: Counter[str] = field(default_factory=Counter)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=None, help="run length in seconds (overrides --minutes)")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent client streams")
    p.add_argument("--model", default=None, help="embedded model (default: SmolLM2)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--hostile-share", type=float, default=0.1)
    p.add_argument("--disconnect-share", type=float, default=0.1)
    p.add_argument("--external-share", type=float, default=0.1)
    p.add_argument("--telemetry-url", default=None, help="default: a fresh PostgreSQL database, else SQLite")
    p.add_argument("--out", default="soak-out")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    run_id = uuid.uuid4().hex[:8]
    db_url, drop_db = _database(args.telemetry_url, run_id, out)
    proxy = None
    url = db_url
    if db_url.startswith("postgresql"):
        real = db_url.split("@", 1)[1].split("/", 1)[0]
        pg_host, _, pg_port = real.partition(":")
        pg_port = pg_port or "5432"
        proxy = TcpProxy((pg_host, int(pg_port))).start()
        url = db_url.replace(real, f"127.0.0.1:{proxy.port}")
        _upgrade(db_url)
    stub_port = free_port()
    stub_cmd = [sys.executable, "bench/stub_backend.py", "--port", str(stub_port)]
    procs = {"stub": launch(stub_cmd, f"http://127.0.0.1:{stub_port}/v1/models")}
    port = free_port()
    config = out / "soak-config.json"
    config.write_text(json.dumps(_config(args, url, stub_port, out)))
    env = {**os.environ, "SPECGATE_DATA_DIR": str(out / "gateway-data")}
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specgate.gateway.cli.main",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
        ],
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, gateway)
        model = next(m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"] if m["id"] != STUB_MODEL)
        tally = Tally()
        rss: dict[str, int] = {}
        events = asyncio.run(
            _drive(
                args,
                base,
                model,
                run_id,
                duration,
                tally,
                rss,
                gateway.pid,
                proxy,
                procs,
                stub_cmd,
                stub_port,
            )
        )
        never = sum(n for name, n in tally.transport_errors.items() if name in NEVER_SENT)
        rows = _rows_written(db_url, run_id, tally.sent - never)
        blocks = _kv_blocks_idle(base)
    finally:
        gateway.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            gateway.wait(30)
        if gateway.poll() is None:
            gateway.kill()
        procs["stub"].kill()
        if proxy is not None:
            proxy.stop()
        if drop_db is not None:
            drop_db()
    growth = (rss["end"] - rss["warm"]) / rss["warm"] if rss.get("warm") else None
    never_sent = never
    report = {
        "run_id": run_id,
        "seconds": duration,
        "concurrency": args.concurrency,
        "requests": tally.sent,
        "statuses": dict(sorted(tally.statuses.items())),
        "responses_500": tally.statuses.get(500, 0),
        "other_5xx": sum(n for s, n in tally.statuses.items() if s >= 500 and s != 500),
        "stream_errors": dict(tally.stream_errors),
        "client_disconnects": tally.disconnects,
        "transport_errors": dict(tally.transport_errors),
        "transport_failures": [{"id": i, "error": e} for i, e, _ in tally.failed_ids[:50]],
        "telemetry_rows": rows,
        # A request that never left this client (no connection from the pool, or refused) cannot
        # have a row; any other transport failure counts against the gateway.
        "never_sent": never_sent,
        "rows_lost": tally.sent - never_sent - rows,
        "kv_blocks_held_when_idle": blocks,
        "rss_mb": {k: round(v / 2**20, 1) for k, v in rss.items()},
        "rss_growth": None if growth is None else round(growth, 4),
        "events": events,
        "database": "postgresql (with an outage)" if proxy is not None else db_url,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    _print(report)
    ok = report["responses_500"] == 0 and report["rows_lost"] <= 0 and blocks == 0
    return 0 if ok else 1


def _config(args: argparse.Namespace, url: str, stub_port: int, out: Path) -> dict[str, Any]:
    embedded: dict[str, Any] = {"max_waiting": 4096}
    if args.model:
        embedded["model"] = args.model
    return {
        "log_requests": False,
        "refused_rpm": 0,  # every client here shares one address
        "embedded": embedded,
        "backends": [
            {
                "name": "stub",
                "base_url": f"http://127.0.0.1:{stub_port}/v1",
                "models": [STUB_MODEL],
                "max_retries": 1,
                "health_interval": 1.0,
                "breaker_cooldown": 2.0,
            }
        ],
        "telemetry": {
            "url": url,
            "auto_upgrade": True,
            "retry_interval": 0.5,
            "spool_dir": str(out / "spool"),
            "connect_timeout": 2.0,
            "statement_timeout": 5.0,
        },
    }


async def _drive(
    args: argparse.Namespace,
    base: str,
    model: str,
    run_id: str,
    duration: float,
    tally: Tally,
    rss: dict[str, int],
    pid: int,
    proxy: TcpProxy | None,
    procs: dict[str, subprocess.Popen[bytes]],
    stub_cmd: list[str],
    stub_port: int,
) -> dict[str, Any]:
    from tqdm import tqdm

    rng = random.Random(args.seed)
    start = time.monotonic()
    end = start + duration
    events: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency)
    bar = tqdm(total=round(duration), desc="soak", unit="s")
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120, trust_env=False) as client:

        async def worker(w: int) -> None:
            n = 0
            while time.monotonic() < end:
                n += 1
                await _one(client, args, model, f"{run_id}-{w}-{n}", rng, tally)

        async def timeline() -> None:
            nonlocal proxy
            warm_at, db_down, db_up = 0.1 * duration, duration / 3, duration / 3 + duration / 5
            kill_at, revive_at = duration / 2, duration / 2 + duration / 10
            done: set[str] = set()
            while time.monotonic() < end:
                t = time.monotonic() - start
                bar.n = round(min(t, duration))
                bar.refresh()
                if "warm" not in done and t >= warm_at:
                    rss["warm"] = _rss(pid)
                    done.add("warm")
                if proxy is not None and "db_down" not in done and t >= db_down:
                    proxy.stop()
                    events["database_down_at_s"] = round(t, 1)
                    done.add("db_down")
                if proxy is not None and "db_up" not in done and t >= db_up:
                    proxy = proxy.restarted()
                    events["database_back_at_s"] = round(t, 1)
                    done.add("db_up")
                if "kill" not in done and t >= kill_at:
                    procs["stub"].kill()
                    events["backend_killed_at_s"] = round(t, 1)
                    done.add("kill")
                if "revive" not in done and t >= revive_at:
                    procs["stub"] = await asyncio.to_thread(
                        launch, stub_cmd, f"http://127.0.0.1:{stub_port}/v1/models"
                    )
                    events["backend_back_at_s"] = round(time.monotonic() - start, 1)
                    done.add("revive")
                await asyncio.sleep(0.5)

        await asyncio.gather(timeline(), *(worker(w) for w in range(args.concurrency)))
    bar.close()
    rss["end"] = _rss(pid)
    if proxy is not None:
        events["proxy_port"] = proxy.port
    return events


async def _one(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    model: str,
    rid: str,
    rng: random.Random,
    tally: Tally,
) -> None:
    headers = {"x-request-id": rid, "content-type": "application/json"}
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": args.max_tokens,
        "stream": True,
        "temperature": rng.choice([0.0, 0.0, 0.7, 1.0]),
    }
    roll = rng.random()
    disconnect_after = None
    if roll < args.hostile_share:
        hostile = rng.choice(HOSTILE)
        content = hostile if isinstance(hostile, bytes) else _dumps({**body, "stream": False, **hostile})
    else:
        if roll < args.hostile_share + args.external_share:
            body["model"] = STUB_MODEL
        elif roll < args.hostile_share + args.external_share + args.disconnect_share:
            disconnect_after = rng.randint(1, 4)
        content = _dumps(body)
    tally.sent += 1
    try:
        async with client.stream("POST", "/v1/chat/completions", content=content, headers=headers) as r:
            tally.statuses[r.status_code] += 1
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if '"error"' in line[:20]:
                        tally.stream_errors[json.loads(line[6:])["error"].get("code") or "?"] += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    tally.disconnects += 1
                    return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        tally.transport_errors[type(exc).__name__] += 1
        tally.failed_ids.append((rid, f"{type(exc).__name__}: {exc}"[:200], time.monotonic()))


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")


def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/readyz", timeout=5, trust_env=False).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("the gateway did not become ready")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _database(url: str | None, run_id: str, out: Path) -> tuple[str, Any]:
    if url:
        return url, None
    try:
        import psycopg

        name = f"specgate_soak_{run_id}"
        with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

        def drop() -> None:
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

        return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}", drop
    except Exception:
        return f"sqlite:///{Path(tempfile.mkdtemp(dir=out)) / 'telemetry.db'}", None


def _upgrade(url: str) -> None:
    from specgate.gateway.telemetry import schema

    schema.upgrade(url)


def _rows_written(url: str, run_id: str, sent: int, timeout: float = 120) -> int:
    """Rows of this run, once the gateway's writer has caught up (spool replay included)."""
    from sqlalchemy import func, select

    from specgate.gateway.telemetry import schema
    from specgate.gateway.telemetry.tables import requests

    engine = schema.make_engine(url)
    n = -1
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception), engine.connect() as conn:
                q = select(func.count()).where(requests.c.client_request_id.like(f"{run_id}-%"))
                n = int(conn.execute(q).scalar_one())
            if n >= sent:
                break
            time.sleep(0.5)
    finally:
        engine.dispose()
    return n


def _kv_blocks_idle(base: str, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    blocks = -1
    while time.monotonic() < deadline:
        text = httpx.get(f"{base}/metrics", timeout=10, trust_env=False).text
        for line in text.splitlines():
            if line.startswith("specgate_engine_kv_blocks_used "):
                blocks = int(float(line.split()[1]))
        if blocks == 0:
            break
        time.sleep(0.5)
    return blocks


def _print(report: dict[str, Any]) -> None:
    lines = [
        f"soak {report['run_id']}: {report['seconds']:.0f} s at {report['concurrency']} concurrent streams",
        f"  requests sent          {report['requests']}",
        f"  answers by status      {report['statuses']}",
        f"  500 responses          {report['responses_500']}  (other 5xx: {report['other_5xx']})",
        f"  errors inside streams  {report['stream_errors']}",
        f"  client disconnects     {report['client_disconnects']}",
        f"  telemetry rows         {report['telemetry_rows']}  (lost: {report['rows_lost']})",
        f"  transport errors       {report['transport_errors']}",
        f"  KV blocks held idle    {report['kv_blocks_held_when_idle']}",
        f"  gateway RSS (MB)       {report['rss_mb']}  growth {report['rss_growth']}",
        f"  events                 {report['events']}",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
