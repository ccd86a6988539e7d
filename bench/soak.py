"""`specgate bench soak`: a gateway under sustained, hostile, failing load, and what it lost; and
`specgate bench exhaustion`: a victim tenant streams while other clients (a hog tenant, a slowloris
client, trickling and huge bodies, each from its own loopback address in an attacker process) try
to exhaust the gateway, and a load balancer's probe asks /healthz. Both count what the clients saw
against the gateway's telemetry rows. (bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import random
import resource
import shutil
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from specgate.bench import launch, models, stub
from specgate.bench.stats import distribution, percentile
from specgate.bench.tcp_proxy import TcpProxy, behind_proxy

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
STUB_MODEL = "stub-model"
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


HOG, VICTIM = "sk-bench-hog-000000", "sk-bench-victim-000"
ADMIN = "adm-bench-exhaustion-000"
HOG_ADDRESS, SLOWLORIS_ADDRESS = "127.0.0.2", "127.0.0.3"
VICTIM_PROMPT = "Write a Python function that returns the square of a number."
HOG_PROMPT = "Write a long story about a lighthouse keeper and the sea, in many chapters."
ATTACKS = ("hog", "slowloris", "trickle", "big")


@dataclass
class Tally:
    """What the clients saw: every request sent, the ids answered with a status line (each must leave
    a telemetry row), transport errors by exception class."""

    sent: int = 0
    answered: list[str] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    transport: Counter[str] = field(default_factory=Counter)
    failed_ids: list[tuple[str, str]] = field(default_factory=list)  # (id, error)
    disconnects: int = 0
    stream_errors: Counter[str] = field(default_factory=Counter)

    def answer(self, rid: str, status: int) -> None:
        self.answered.append(rid)
        self.statuses[status] += 1

    def error(self, rid: str, exc: BaseException) -> None:
        self.transport[type(exc).__name__] += 1
        self.failed_ids.append((rid, f"{type(exc).__name__}: {exc}"[:200]))

    def shared(self) -> dict[str, Any]:
        """What another process's tally adds to this one (`merge`)."""
        return {"answered": self.answered, "statuses": dict(self.statuses), "transport": dict(self.transport)}

    def merge(self, other: dict[str, Any]) -> None:
        self.answered += other["answered"]
        self.statuses.update({int(k): v for k, v in other["statuses"].items()})
        self.transport.update(other["transport"])


@contextlib.contextmanager
def gateway(
    out: Path, config: dict[str, Any], timeout: float, key: str = "", **kwargs: Any
) -> Iterator[tuple[launch.Server, str]]:
    """`specgate serve` with `config`, its data in `out`/gateway-data: the server and the model it
    serves (the first that is not the stub's), as API key `key` sees them."""
    shutil.rmtree(data := out / "gateway-data", ignore_errors=True)  # a fresh data directory
    with launch.specgate(out / "gateway.log", None, timeout, config=config, data=data, **kwargs) as server:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        models = httpx.get(f"{server.url}/v1/models", headers=headers, trust_env=False).json()["data"]
        yield server, next(m["id"] for m in models if m["id"] != STUB_MODEL)


def rounds(until: float) -> Iterator[int]:
    """1, 2, 3, ... while time.monotonic() is before `until`: a client's requests."""
    return itertools.takewhile(lambda _: time.monotonic() < until, itertools.count(1))


def print_report(lines: list[tuple[str, Any]], goals: list[tuple[str, bool]]) -> bool:
    """The report's lines and its goals; whether every goal was met."""
    print("\n".join(f"  {name:<22} {value}" for name, value in lines))
    print("\n".join(launch.goal_lines(goals)))
    return all(ok for _, ok in goals)


def add_arguments(p: argparse.ArgumentParser) -> None:
    launch.options(p, minutes=10.0, seconds=None, model=None, max_tokens=32, out="soak-out", seed=0)
    p.add_argument("--concurrency", type=int, default=64, help="concurrent client streams")
    p.add_argument("--hostile-share", type=float, default=0.1)
    p.add_argument("--disconnect-share", type=float, default=0.1)
    p.add_argument("--external-share", type=float, default=0.1)
    p.add_argument("--telemetry-url", default=None, help="default: a fresh PostgreSQL database, else SQLite")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    soak = Soak(args, out)
    # Closed in turn on every way out: the gateway, the backend, the database's proxy, the database.
    with contextlib.ExitStack() as stack:
        url = db_url = args.telemetry_url or _database(stack, soak.run_id, out)
        if db_url.startswith("postgresql"):
            from specgate.gateway.telemetry import schema

            soak.proxy, url = behind_proxy(db_url)
            stack.callback(lambda: soak.proxy.stop() if soak.proxy is not None else None)
            schema.upgrade(db_url)
        soak.start_backend()
        stack.callback(lambda: launch.stop(soak.backend))
        server, model = stack.enter_context(gateway(out, soak.config(url), 300))
        soak.pid = server.proc.pid
        events = asyncio.run(soak.drive(server.url, model))
        never = sum(n for name, n in soak.tally.transport.items() if name in NEVER_SENT)
        sent = soak.tally.sent - never
        rows = len(launch.request_ids(db_url, f"{soak.run_id}-", sent, timeout=120))
        blocks = _kv_blocks_idle(server.url)
    t, rss = soak.tally, soak.rss
    growth = (rss["end"] - rss["warm"]) / rss["warm"] if rss.get("warm") else None
    report = {"run_id": soak.run_id, "seconds": soak.duration, "concurrency": args.concurrency}
    report |= {"requests": t.sent, "statuses": dict(sorted(t.statuses.items()))}
    other_5xx = sum(n for s, n in t.statuses.items() if s > 500)
    report |= {"responses_500": t.statuses.get(500, 0), "other_5xx": other_5xx}
    report |= {"stream_errors": dict(t.stream_errors), "client_disconnects": t.disconnects}
    report |= {"transport_errors": dict(t.transport), "telemetry_rows": rows}
    report["transport_failures"] = [{"id": i, "error": e} for i, e in t.failed_ids[:50]]
    # A request that never left this client (no connection from the pool, or refused) cannot have a
    # row; any other transport failure counts against the gateway.
    report |= {"never_sent": never, "rows_lost": sent - rows, "kv_blocks_held_when_idle": blocks}
    report |= {"rss_mb": {k: round(v / 2**20, 1) for k, v in rss.items()}, "events": events}
    report["rss_growth"] = None if growth is None else round(growth, 4)
    report["database"] = "postgresql (with an outage)" if soak.proxy is not None else db_url
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    print(f"soak {soak.run_id}: {soak.duration:.0f} s at {args.concurrency} concurrent streams")
    lines = [("requests sent", t.sent), ("answers by status", report["statuses"])]
    lines += [("500 responses", f"{report['responses_500']}  (other 5xx: {report['other_5xx']})")]
    lines += [("errors inside streams", report["stream_errors"]), ("client disconnects", t.disconnects)]
    lines += [("telemetry rows", f"{rows}  (lost: {report['rows_lost']})")]
    lines += [("transport errors", dict(t.transport)), ("KV blocks held idle", blocks)]
    lines += [("gateway RSS (MB)", report["rss_mb"])]
    lines += [("RSS growth", report["rss_growth"]), ("events", events)]
    goals = [("no answer 500", t.statuses.get(500, 0) == 0), ("no row lost", report["rows_lost"] <= 0)]
    return 0 if print_report(lines, [*goals, ("no KV block held once idle", blocks == 0)]) else 1


class Soak:
    """One run: its clients, the stub backend the timeline kills and restarts, the database proxy the
    timeline cuts and restores, the gateway's RSS."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out = args, out
        self.duration = args.seconds if args.seconds is not None else args.minutes * 60
        self.run_id = uuid.uuid4().hex[:8]
        self.tally, self.rss = Tally(), dict[str, int]()
        self.proxy: TcpProxy | None = None
        self.stub_port, self.pid = launch.free_port(), 0
        self.backend: subprocess.Popen[bytes]
        self.rng = random.Random(args.seed)

    def start_backend(self) -> None:
        """The stub backend, started (again) on its port; killed, not stopped, by the timeline."""
        cmd = stub.command(stub.PoolConfig(model=STUB_MODEL, canned=True), self.stub_port)
        with (self.out / "stub.log").open("ab") as log:
            self.backend = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        ready = f"http://127.0.0.1:{self.stub_port}/health"
        launch.wait_ready(self.backend, ready, self.out / "stub.log", 60)

    def config(self, url: str) -> dict[str, Any]:
        model = {"model": self.args.model} if self.args.model else {}
        stub_url = f"http://127.0.0.1:{self.stub_port}/v1"
        backend = {"name": "stub", "base_url": stub_url, "models": [STUB_MODEL], "max_retries": 1}
        backend |= {"health_interval": 1.0, "breaker_cooldown": 2.0}
        telemetry = {"url": url, "auto_upgrade": True, "retry_interval": 0.5, "connect_timeout": 2.0}
        telemetry |= {"statement_timeout": 5.0, "spool_dir": str(self.out / "spool")}
        # refused_rpm 0: every client here shares one address.
        config = {"log_requests": False, "refused_rpm": 0, "embedded": {"max_waiting": 4096, **model}}
        return {**config, "backends": [backend], "telemetry": telemetry}

    async def drive(self, url: str, model: str) -> dict[str, Any]:
        """Every client for the run's length, and the timeline of failures: what happened when."""
        from tqdm import tqdm

        start, d = time.monotonic(), self.duration
        events: dict[str, Any] = {}
        # (seconds in, event, action): the database away for a fifth of the run from a third in, the
        # backend killed halfway and started again a tenth later.
        timeline: list[tuple[float, str, Callable[[], Any]]] = [(d / 10, "", lambda: self.note_rss("warm"))]
        if self.proxy is not None:
            timeline += [(d / 3, "database_down_at_s", self.proxy.stop)]
            timeline += [(d / 3 + d / 5, "database_back_at_s", self._restore_database)]
        timeline += [(d / 2, "backend_killed_at_s", lambda: self.backend.kill())]
        timeline += [(d / 2 + d / 10, "backend_back_at_s", lambda: asyncio.to_thread(self.start_backend))]
        n = self.args.concurrency
        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n)
        bar = tqdm(total=round(d), desc="soak", unit="s")
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120, trust_env=False) as http:

            async def worker(w: int) -> None:
                for k in rounds(start + d):
                    await self.one(http, model, f"{self.run_id}-{w}-{k}")

            async def failures() -> None:
                while (now := time.monotonic() - start) < d:
                    bar.n = round(now)
                    bar.refresh()
                    while timeline and now >= timeline[0][0]:
                        _, name, action = timeline.pop(0)
                        if asyncio.iscoroutine(done := action()):
                            await done
                        if name:
                            events[name] = round(time.monotonic() - start, 1)
                    await asyncio.sleep(0.5)

            await asyncio.gather(failures(), *(worker(w) for w in range(n)))
        bar.close()
        self.note_rss("end")
        return events | ({"proxy_port": self.proxy.port} if self.proxy is not None else {})

    def note_rss(self, when: str) -> None:
        self.rss[when] = int(launch.usage(self.pid)[1] * 2**20)

    def _restore_database(self) -> None:
        assert self.proxy is not None
        self.proxy = self.proxy.restarted()

    async def one(self, http: httpx.AsyncClient, model: str, rid: str) -> None:
        """One request: hostile, to the stub backend, cut mid-stream or plain, as the dice fall."""
        args, rng, tally = self.args, self.rng, self.tally
        prompt = [{"role": "user", "content": rng.choice(PROMPTS)}]
        body: dict[str, Any] = {"model": model, "messages": prompt, "max_tokens": args.max_tokens}
        body |= {"stream": True, "temperature": rng.choice([0, 0, 0.7, 1.0])}
        roll, disconnect_after = rng.random(), None
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
        headers = {"x-request-id": rid, "content-type": "application/json"}
        try:
            async with http.stream("POST", "/v1/chat/completions", content=content, headers=headers) as r:
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
            tally.error(rid, exc)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")


def _database(stack: contextlib.ExitStack, run_id: str, out: Path) -> str:
    """The telemetry database: a fresh PostgreSQL one (dropped as `stack` closes), else SQLite."""
    name = f"specgate_soak_{run_id}"
    try:
        stack.enter_context(launch.postgres_database(PG_ADMIN, name))
    except Exception:
        return f"sqlite:///{Path(tempfile.mkdtemp(dir=out)) / 'telemetry.db'}"
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


def _kv_blocks_idle(base: str, timeout: float = 30) -> int:
    """The engine's KV blocks in use once the gateway is idle (-1: not reported)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = httpx.get(f"{base}/metrics", timeout=10, trust_env=False).text.splitlines()
        used = [x.split()[1] for x in lines if x.startswith("specgate_engine_kv_blocks_used ")]
        blocks = int(float(used[-1])) if used else -1
        if blocks == 0 or time.monotonic() > deadline:
            return blocks
        time.sleep(0.5)


# ---- `specgate bench exhaustion` ------------------------------------------------------------------


def add_exhaustion_arguments(p: argparse.ArgumentParser) -> None:
    launch.options(p, minutes=3.0, seconds=None, model=None, out="exhaustion-out")
    p.add_argument("--idle-requests", type=int, default=20, help="victim requests in the idle run")
    p.add_argument("--fd-limit", type=int, default=256, help="soft RLIMIT_NOFILE of the gateway")
    p.add_argument("--half-open", type=int, default=1500, help="slowloris connections held open")
    p.add_argument("--hog-factor", type=int, default=10, help="hog requests in flight per batch slot")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--victim-tokens", type=int, default=8, help="the victim's short requests")
    p.add_argument("--hog-tokens", type=int, default=256)
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"which attacks run, of {', '.join(ATTACKS)}")


def chat_body(model: str, prompt: str, tokens: int) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}


# ---- the attacker process ----------------------------------------------------------------------


@dataclass
class Attacker:
    port: int
    model: str
    args: dict[str, Any]  # half_open, hog_factor, max_num_seqs, hog_tokens, attacks
    until: float = 0.0
    tally: Tally = field(default_factory=Tally)
    slowloris_cut: int = 0

    def __call__(self, seconds: float, out: Any) -> None:
        """The attacker process's entry point: every attack at once for `seconds`, then its tally."""
        os.nice(10)
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # thousands of sockets
        self.until = time.monotonic() + seconds
        runs = {"hog": self.hog, "slowloris": self.slowloris, "trickle": self.trickle, "big": self.big_bodies}

        async def every() -> None:
            await asyncio.gather(*(runs[name]() for name in self.args["attacks"]))

        asyncio.run(every())
        out.send({**self.tally.shared(), "slowloris_cut": self.slowloris_cut})

    async def hog(self) -> None:
        """10x the engine's batch slots of long streams, kept-alive, again after a refusal's Retry-After."""
        slots = self.args["hog_factor"] * self.args["max_num_seqs"]
        limits = httpx.Limits(max_connections=slots, max_keepalive_connections=slots)
        transport = httpx.AsyncHTTPTransport(local_address=HOG_ADDRESS, limits=limits)
        body = {**chat_body(self.model, HOG_PROMPT, self.args["hog_tokens"]), "stream": True}
        base = f"http://127.0.0.1:{self.port}"
        client = httpx.AsyncClient(base_url=base, transport=transport, timeout=600, trust_env=False)

        async def slot(i: int) -> None:
            for n in rounds(self.until):
                rid, wait = f"hog-{i}-{n}", 1.0
                headers = {"authorization": f"Bearer {HOG}", "x-request-id": rid}
                try:
                    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                        self.tally.answer(rid, r.status_code)
                        async for _ in r.aiter_bytes():
                            if time.monotonic() > self.until:
                                break
                        wait = float(r.headers.get("retry-after", 0) or 0)
                except httpx.HTTPError as exc:
                    self.tally.error(rid, exc)
                await asyncio.sleep(wait)

        async with client:
            await asyncio.gather(*(slot(i) for i in range(slots)))

    async def slowloris(self) -> None:
        """Connections held open, half of them with a partial request head, each re-opened once cut."""

        async def hold(i: int) -> None:
            while time.monotonic() < self.until:
                try:
                    address = (SLOWLORIS_ADDRESS, 0)
                    reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=address)
                except OSError as exc:
                    self.tally.error("slowloris", exc)
                    await asyncio.sleep(0.5)
                    continue
                if i % 2:
                    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(reader.read(), timeout=max(0.1, self.until - time.monotonic()))
                writer.close()
                self.slowloris_cut += 1

        await asyncio.gather(*(hold(i) for i in range(self.args["half_open"])))

    async def raw(self, path: str, body: bytes, rid: str, trickle: float = 0.0) -> None:
        """One request on a fresh connection; its body at once, or a byte every `trickle` s till answered."""
        try:
            address = (HOG_ADDRESS, 0)
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=address)
        except OSError as exc:
            self.tally.error(rid, exc)
            return
        head = f"POST {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {HOG}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nx-request-id: {rid}\r\n"
        writer.write((head + "Connection: close\r\n\r\n").encode())
        status_line: asyncio.Future[bytes] = asyncio.ensure_future(reader.readline())
        try:
            for i in range(len(body)) if trickle else []:
                if status_line.done():
                    break
                writer.write(body[i : i + 1])
                await writer.drain()
                await asyncio.wait([status_line], timeout=trickle)
            if not trickle:
                writer.write(body)
                await writer.drain()
            if (status := await status_line).startswith(b"HTTP/1.1 "):
                self.tally.answer(rid, int(status.split()[1]))
            while await reader.read(65536):
                pass
        except (OSError, asyncio.IncompleteReadError) as exc:
            self.tally.error(rid, exc)
        finally:
            if not status_line.done():
                status_line.cancel()
            elif not status_line.cancelled():
                status_line.exception()  # seen: a reset while the body went out is a transport error above
            writer.close()

    async def trickle(self) -> None:
        """Bodies that trickle in, a byte every 3 s."""
        for n in rounds(self.until):
            await self.raw("/v1/chat/completions", b" " * 100_000, f"trickle-{n}", trickle=3.0)

    async def big_bodies(self) -> None:
        """3.7 MB chat bodies with their bulk in a tool call's arguments; 4 MiB completions of ids."""
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "a" * 3_700_000}}
        messages = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ]
        messages += [{"role": "tool", "tool_call_id": "c1", "content": "ok"}]
        chat = json.dumps({"model": self.model, "max_tokens": 4, "messages": messages}).encode()
        ids = b'{"model": "' + self.model.encode() + b'", "echo": true, "prompt": ['
        ids += b",".join([b"1"] * 2_000_000)
        ids = ids[: 4 * 2**20 - 16].rsplit(b",", 1)[0] + b"]}"
        for n in rounds(self.until):
            await self.raw("/v1/chat/completions", chat, f"big-chat-{n}")
            await self.raw("/v1/completions", ids, f"big-ids-{n}")
            await asyncio.sleep(0.5)


# ---- the victim, the probe, the sampler (this process) ------------------------------------------


@dataclass
class Victim:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    failed: Counter[str] = field(default_factory=Counter)

    async def stream(self, base: str, body: dict[str, Any], rid: str, tally: Tally) -> None:
        headers = {"authorization": f"Bearer {VICTIM}", "x-request-id": rid}
        start, times = time.perf_counter(), []
        try:
            async with (
                httpx.AsyncClient(timeout=120, trust_env=False) as client,
                client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r,
            ):
                tally.answer(rid, r.status_code)
                if r.status_code != 200:
                    self.failed[str(r.status_code)] += 1
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"content"' in line:
                        times.append(time.perf_counter())
        except httpx.HTTPError as exc:
            self.failed[type(exc).__name__] += 1
            return
        if times:
            self.ttft.append(times[0] - start)
        if len(times) > 1:
            self.tpot.append((times[-1] - times[0]) / (len(times) - 1))

    def summary(self) -> dict[str, Any]:
        out = {"requests": len(self.ttft) + sum(self.failed.values()), "failed": dict(self.failed)}
        for what, times in (("ttft", self.ttft), ("tpot", self.tpot)):
            ms = distribution(times)
            out |= {f"{what}_ms_{p}": None if (v := ms[p]) is None else round(v, 1) for p in ("p50", "p99")}
        return out


async def probe(base: str, until: float, waits: list[float]) -> int:
    """A load balancer's health check every 50 ms on a new connection: waits (ms); the failures."""
    failures = 0
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        while time.monotonic() < until:
            start = time.perf_counter()
            try:
                ok = (await client.get(f"{base}/healthz", headers={"connection": "close"})).status_code == 200
            except httpx.HTTPError:
                ok = False
            failures += not ok
            waits.append((time.perf_counter() - start) * 1e3)
            await asyncio.sleep(0.05)
    return failures


def processes(root: int) -> dict[str, int]:
    """The gateway's processes by name: the supervisor, its workers and the engine core."""
    out = {"supervisor": root}
    for pid in launch.process_tree(root)[1:]:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            if int(rest.split()[1]) == root and name.startswith("specgate"):
                out[name] = pid
    return out


async def hostile_run(
    base: str, body: dict[str, Any], seconds: float, root: int, tally: Tally
) -> tuple[Victim, list[float], int, list[dict[str, Any]]]:
    """The victim (after the hostile load has built up), the probe and a sampler of each gateway
    process's descriptors and RSS every 2 s, all for `seconds`."""
    t0 = time.monotonic()
    until, victim, waits = t0 + seconds, Victim(), list[float]()
    series: list[dict[str, Any]] = []

    async def victim_loop() -> None:
        await asyncio.sleep(min(20.0, seconds / 4))
        for n in rounds(until):
            await victim.stream(base, body, f"victim-hostile-{n}", tally)

    async def sampler() -> None:
        while time.monotonic() < until:
            row = {name: launch.usage(pid) for name, pid in processes(root).items()}
            series.append({"t_s": round(time.monotonic() - t0, 1), **row})
            await asyncio.sleep(2.0)

    _, failures, _ = await asyncio.gather(victim_loop(), probe(base, until, waits), sampler())
    return victim, waits, failures, series


def exhaustion(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    embedded: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    if model := models.resolve(args.model):
        embedded["model"] = model
    hog = {"key": HOG, "max_in_flight": args.hog_factor * args.max_num_seqs}
    config: dict[str, Any] = {"api_keys": [{**hog, "max_streams": hog["max_in_flight"]}, VICTIM]}
    config |= {"admin_key": ADMIN, "log_requests": False, "embedded": embedded}
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.fd_limit, hard))

    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    tally, idle = Tally(), Victim()
    with gateway(out, config, 900, key=VICTIM, preexec=limited) as (server, model):
        body = {**chat_body(model, VICTIM_PROMPT, args.victim_tokens), "stream": True}

        async def idle_run() -> None:
            for n in range(args.idle_requests):
                await idle.stream(server.url, body, f"victim-idle-{n}", tally)

        asyncio.run(idle_run())
        ctx = multiprocessing.get_context("spawn")
        theirs, ours = ctx.Pipe(duplex=False)
        options = {k: getattr(args, k) for k in ("half_open", "hog_factor", "max_num_seqs", "hog_tokens")}
        options["attacks"] = [a.strip() for a in args.attacks.split(",") if a.strip()]
        port = int(server.url.rsplit(":", 1)[1])
        attacker = ctx.Process(target=Attacker(port, model, options), args=(seconds, ours), daemon=True)
        attacker.start()
        hostile = hostile_run(server.url, body, seconds, server.proc.pid, tally)
        victim, waits, failures, series = asyncio.run(hostile)
        attacks = theirs.recv() if theirs.poll(120) else Tally().shared()
        attacker.join(30)
    tally.merge(attacks)
    rows = set(launch.request_ids(f"sqlite:///{out / 'gateway-data' / 'telemetry.db'}"))
    lost = [rid for rid in tally.answered if rid not in rows]
    healthz = {"probes": len(waits), "failures": failures, "p50_ms": round(percentile(waits, 50) or 0.0, 1)}
    healthz["p99_ms"] = round(percentile(waits, 99) or 0.0, 1)
    healthz["max_wait_ms"] = round(max(waits, default=0.0), 1)
    healthz["over_200ms"] = sum(w > 200 for w in waits)
    report = {"seconds": seconds, "idle": idle.summary(), "hostile": victim.summary(), "healthz": healthz}
    report |= {"attacks": options["attacks"], "statuses": dict(sorted(tally.statuses.items()))}
    report["attacker_transport_errors"] = attacks["transport"]
    report["slowloris_connections_cut"] = attacks.get("slowloris_cut", 0)
    report |= {"answered": len(tally.answered), "rows_lost": len(lost), "lost_ids": lost[:20]}
    report["series"] = series
    (out / "exhaustion.json").write_text(json.dumps(report, indent=2))
    return 0 if report_goals(report) else 1


def report_goals(r: dict[str, Any]) -> bool:
    """Print the report and its goals; whether every goal was met."""
    idle, hostile, h = r["idle"], r["hostile"], r["healthz"]

    def p50_p99(d: dict[str, Any], what: str) -> str:
        return f"{d[f'{what}_ms_p50']} / {d[f'{what}_ms_p99']}"

    lines = [
        (f"victim {w.upper()} ms p50/p99", f"idle {p50_p99(idle, w)}, under attack {p50_p99(hostile, w)}")
        for w in ("ttft", "tpot")
    ]
    lines += [("victim under attack", f"{hostile['requests']} requests, failed: {hostile['failed']}")]
    waits = f"{h['p50_ms']} / {h['p99_ms']} / {h['max_wait_ms']} ms, {h['over_200ms']} over 200 ms"
    lines += [("/healthz", f"{h['probes']} probes, {h['failures']} failed, p50 / p99 / max wait {waits}")]
    lines += [("answers", r["statuses"]), ("attacker transport errors", r["attacker_transport_errors"])]
    lines += [("slowloris connections cut by the gateway", r["slowloris_connections_cut"])]
    lines += [("telemetry rows", f"{r['answered'] - r['rows_lost']} of {r['answered']} answered requests")]
    series, flat = r["series"], True
    for name in [k for k in (series[0] if series else {}) if k != "t_s"]:
        fds, rss = zip(*(row[name] for row in series if name in row), strict=True)
        text = f"descriptors first/max/last {fds[0]}/{max(fds)}/{fds[-1]}, "
        lines.append((name, text + f"RSS MiB first/max/last {rss[0]}/{max(rss)}/{rss[-1]}"))
        # Flat: once the attack is at full strength (a quarter in), nothing keeps growing.
        q = max(1, len(fds) // 4)
        flat &= max(fds[3 * q :] or fds) <= max(fds[q : 2 * q] or fds) * 1.2 + 16
        flat &= max(rss[3 * q :] or rss) <= max(rss[q : 2 * q] or rss) * 1.1 + 16
    goals = [
        ("/healthz never waits more than 200 ms", h["max_wait_ms"] <= 200 and h["failures"] == 0),
        ("victim TTFT p99 under 2 s", (hostile["ttft_ms_p99"] or 1e9) < 2000 and not hostile["failed"]),
        ("0 rows lost", r["rows_lost"] == 0),
        ("descriptors and RSS flat over the run", flat),
    ]
    return print_report(lines, goals)
