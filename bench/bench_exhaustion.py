"""`specgate bench exhaustion`: a victim tenant streams while other clients try to exhaust the gateway.

    specgate bench exhaustion --minutes 3

Starts `specgate serve` (the embedded default model, or --model; two API keys; SQLite telemetry in a
fresh data directory) with a soft limit of --fd-limit open files (256, as in a shell whose `ulimit
-n` was lowered: where 300 half-open heads used to exhaust a worker). First the victim streams alone
(the idle run). Then, for the hostile run, an attacker process (at nice 10: its clients stand for
machines elsewhere, whose CPU is not the gateway's; on two shared cores it still takes a good part
of them) runs at the same time, each attack from its own loopback address:
- a hog tenant (127.0.0.2, its key allowed that many) keeps 10x the engine's batch slots of long
  streaming requests in flight, on kept-alive connections, sending again after any refusal's
  Retry-After;
- a slowloris client (127.0.0.3) keeps 1,500 connections open, half of them with a partial request
  head, re-opening each one the gateway closes;
- requests whose bodies trickle in (a byte every 3 s), 3.7 MB chat bodies with their bulk in a tool
  call's arguments, and 4 MiB completions of token ids (127.0.0.2);
while the victim (127.0.0.1) streams short requests one after another and a load balancer's probe
asks /healthz every 50 ms on a new connection. Reported: the victim's TTFT and TPOT p50 / p99 idle
and under attack, /healthz's longest wait, open descriptors and RSS of each gateway process over
time, and every answered request's telemetry row (by its x-request-id).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import resource
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from specgate.bench.models import resolve
from specgate.bench.stub_backend import free_port

HOG, VICTIM = "sk-bench-hog-000000", "sk-bench-victim-000"
ADMIN = "adm-bench-exhaustion-000"
HOG_ADDRESS, SLOWLORIS_ADDRESS = "127.0.0.2", "127.0.0.3"
VICTIM_PROMPT = "Write a Python function that returns the square of a number."
HOG_PROMPT = "Write a long story about a lighthouse keeper and the sea, in many chapters."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=3.0, help="length of the hostile run")
    p.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    p.add_argument("--idle-requests", type=int, default=20, help="victim requests in the idle run")
    p.add_argument("--model", default=None, help="embedded model: a GGUF path or a bench model name")
    p.add_argument("--fd-limit", type=int, default=256, help="soft RLIMIT_NOFILE of the gateway")
    p.add_argument("--half-open", type=int, default=1500, help="slowloris connections held open")
    p.add_argument("--hog-factor", type=int, default=10, help="hog requests in flight per batch slot")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--victim-tokens", type=int, default=8, help="the victim's short requests")
    p.add_argument("--hog-tokens", type=int, default=256)
    p.add_argument(
        "--attacks",
        default="hog,slowloris,trickle,big",
        help="which attacks run (comma-separated): hog, slowloris, trickle, big",
    )
    p.add_argument("--out", default="exhaustion-out")


@dataclass
class Tally:
    answered: list[str] = field(default_factory=list)  # x-request-ids that got a status line
    statuses: Counter[int] = field(default_factory=Counter)
    transport: Counter[str] = field(default_factory=Counter)
    slowloris_cut: int = 0

    def answer(self, rid: str, status: int) -> None:
        self.answered.append(rid)
        self.statuses[status] += 1

    def error(self, exc: BaseException) -> None:
        self.transport[type(exc).__name__] += 1


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def chat_body(model: str, prompt: str, tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


# ---- the attacker process ----------------------------------------------------------------------


def attack(port: int, model: str, options: dict[str, Any], seconds: float, out: Any) -> None:
    """The attacker process's entry point: every attack at once for `seconds`, then its tally."""
    os.nice(10)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # thousands of sockets
    tally = Tally()
    until = time.monotonic() + seconds
    asyncio.run(_attacks(port, model, options, until, tally))
    out.send(
        {
            "answered": tally.answered,
            "statuses": dict(tally.statuses),
            "transport": dict(tally.transport),
            "slowloris_cut": tally.slowloris_cut,
        }
    )


async def _attacks(port: int, model: str, o: dict[str, Any], until: float, tally: Tally) -> None:
    runs = {
        "hog": lambda: _hog(port, model, o, until, tally),
        "slowloris": lambda: _slowloris(port, o["half_open"], until, tally),
        "trickle": lambda: _trickle(port, until, tally),
        "big": lambda: _big_bodies(port, model, until, tally),
    }
    await asyncio.gather(*(runs[name]() for name in o["attacks"]))


async def _hog(port: int, model: str, o: dict[str, Any], until: float, tally: Tally) -> None:
    slots = o["hog_factor"] * o["max_num_seqs"]
    limits = httpx.Limits(max_connections=slots, max_keepalive_connections=slots)
    transport = httpx.AsyncHTTPTransport(local_address=HOG_ADDRESS, limits=limits)
    body = chat_body(model, HOG_PROMPT, o["hog_tokens"])
    headers = {"authorization": f"Bearer {HOG}"}
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", transport=transport, timeout=600, trust_env=False
    ) as client:

        async def slot(i: int) -> None:
            n = 0
            while time.monotonic() < until:
                n += 1
                rid = f"hog-{i}-{n}"
                wait = 0.0
                try:
                    async with client.stream(
                        "POST", "/v1/chat/completions", json=body, headers={**headers, "x-request-id": rid}
                    ) as r:
                        tally.answer(rid, r.status_code)
                        async for _ in r.aiter_bytes():
                            if time.monotonic() > until:
                                break
                        wait = float(r.headers.get("retry-after", 0) or 0)
                except httpx.HTTPError as exc:
                    tally.error(exc)
                    wait = 1.0
                await asyncio.sleep(wait)

        await asyncio.gather(*(slot(i) for i in range(slots)))


async def _slowloris(port: int, n: int, until: float, tally: Tally) -> None:
    async def hold(i: int) -> None:
        while time.monotonic() < until:
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(SLOWLORIS_ADDRESS, 0)
                )
            except OSError as exc:
                tally.error(exc)
                await asyncio.sleep(0.5)
                continue
            if i % 2:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reader.read(), timeout=max(0.1, until - time.monotonic()))
            writer.close()
            tally.slowloris_cut += 1

    await asyncio.gather(*(hold(i) for i in range(n)))


def _head(path: str, length: int, rid: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {HOG}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\nx-request-id: {rid}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()


async def _raw(port: int, path: str, body: bytes, rid: str, tally: Tally, trickle: float = 0.0) -> None:
    """One request on a fresh connection; its body at once, or a byte every `trickle` seconds until
    the gateway answers."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(HOG_ADDRESS, 0))
    except OSError as exc:
        tally.error(exc)
        return
    try:
        writer.write(_head(path, len(body), rid))
        status_line: asyncio.Future[bytes] = asyncio.ensure_future(reader.readline())
        if trickle:
            for i in range(len(body)):
                if status_line.done():
                    break
                writer.write(body[i : i + 1])
                await writer.drain()
                await asyncio.wait([status_line], timeout=trickle)
        else:
            writer.write(body)
            await writer.drain()
        status = await status_line
        if status.startswith(b"HTTP/1.1 "):
            tally.answer(rid, int(status.split()[1]))
        while await reader.read(65536):
            pass
    except (OSError, asyncio.IncompleteReadError) as exc:
        tally.error(exc)
    finally:
        if not status_line.done():
            status_line.cancel()
        elif not status_line.cancelled():
            status_line.exception()  # seen: a reset while the body went out is a transport error above
        writer.close()


async def _trickle(port: int, until: float, tally: Tally) -> None:
    n = 0
    while time.monotonic() < until:
        n += 1
        await _raw(port, "/v1/chat/completions", b" " * 100_000, f"trickle-{n}", tally, trickle=3.0)


async def _big_bodies(port: int, model: str, until: float, tally: Tally) -> None:
    tool_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "a" * 3_700_000}}
    chat = json.dumps(
        {
            "model": model,
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
        }
    ).encode()
    ids = b'{"model": "' + model.encode() + b'", "echo": true, "prompt": [' + b",".join([b"1"] * 2_000_000)
    ids = ids[: 4 * 2**20 - 16].rsplit(b",", 1)[0] + b"]}"
    n = 0
    while time.monotonic() < until:
        n += 1
        await _raw(port, "/v1/chat/completions", chat, f"big-chat-{n}", tally)
        await _raw(port, "/v1/completions", ids, f"big-ids-{n}", tally)
        await asyncio.sleep(0.5)


# ---- the victim, the probe, the sampler (this process) ------------------------------------------


@dataclass
class Victim:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    failed: Counter[str] = field(default_factory=Counter)


async def victim_stream(base: str, body: dict[str, Any], rid: str, v: Victim, tally: Tally) -> None:
    headers = {"authorization": f"Bearer {VICTIM}", "x-request-id": rid}
    start = time.perf_counter()
    first = last = None
    n = 0
    try:
        async with (
            httpx.AsyncClient(timeout=120, trust_env=False) as client,
            client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r,
        ):
            tally.answer(rid, r.status_code)
            if r.status_code != 200:
                v.failed[str(r.status_code)] += 1
                return
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    last = time.perf_counter()
                    first = first or last
                    n += 1
    except httpx.HTTPError as exc:
        v.failed[type(exc).__name__] += 1
        return
    if first is not None:
        v.ttft.append(first - start)
        if n > 1 and last is not None:
            v.tpot.append((last - first) / (n - 1))


@dataclass
class Probe:
    probes: int = 0
    failures: int = 0
    max_ms: float = 0.0
    waits: list[float] = field(default_factory=list)  # ms


async def probe(base: str, until: float, p: Probe) -> None:
    """A load balancer's health check: a new connection each time (`connection: close`)."""
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        while time.monotonic() < until:
            start = time.perf_counter()
            try:
                r = await client.get(f"{base}/healthz", headers={"connection": "close"})
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            p.probes += 1
            p.failures += not ok
            p.waits.append((time.perf_counter() - start) * 1e3)
            p.max_ms = max(p.max_ms, p.waits[-1])
            await asyncio.sleep(0.05)


def processes(root: int) -> dict[str, int]:
    """The gateway's processes by name: the supervisor, its workers and the engine core."""
    out = {"supervisor": root}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        if int(rest.split()[1]) == root and name.startswith("specgate"):
            out[name] = int(entry)
    return out


def usage(pid: int) -> tuple[int, float]:
    """(open descriptors, RSS in MiB) of a process."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0, 0.0
    return fds, round(rss, 1)


async def sampler(root: int, until: float, series: list[dict[str, Any]], t0: float) -> None:
    while time.monotonic() < until:
        row: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1)}
        for name, pid in processes(root).items():
            row[name] = usage(pid)
        series.append(row)
        await asyncio.sleep(2.0)


def summary(v: Victim) -> dict[str, Any]:
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 1)

    return {
        "requests": len(v.ttft) + sum(v.failed.values()),
        "failed": dict(v.failed),
        "ttft_ms_p50": ms(pct(v.ttft, 0.5)),
        "ttft_ms_p99": ms(pct(v.ttft, 0.99)),
        "tpot_ms_p50": ms(pct(v.tpot, 0.5)),
        "tpot_ms_p99": ms(pct(v.tpot, 0.99)),
    }


async def hostile_run(
    base: str, body: dict[str, Any], seconds: float, root: int, tally: Tally
) -> tuple[Victim, Probe, list[dict[str, Any]]]:
    t0 = time.monotonic()
    until = t0 + seconds
    victim, p = Victim(), Probe()
    series: list[dict[str, Any]] = []

    async def victim_loop() -> None:
        await asyncio.sleep(min(20.0, seconds / 4))  # the hostile load builds up first
        n = 0
        while time.monotonic() < until:
            n += 1
            await victim_stream(base, body, f"victim-hostile-{n}", victim, tally)

    await asyncio.gather(victim_loop(), probe(base, until, p), sampler(root, until, series, t0))
    return victim, p, series


def rows_of(db: Path) -> set[str]:
    con = sqlite3.connect(db)
    try:
        return {r[0] for r in con.execute("SELECT client_request_id FROM requests") if r[0]}
    finally:
        con.close()


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="exhaustion-", dir=out))
    port = free_port()
    config = out / "exhaustion-config.json"
    embedded: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    model_path = resolve(args.model)
    if model_path:
        embedded["model"] = model_path
    hog_key = {"key": HOG, "max_in_flight": args.hog_factor * args.max_num_seqs}
    hog_key["max_streams"] = hog_key["max_in_flight"]
    settings = {
        "api_keys": [hog_key, VICTIM],
        "admin_key": ADMIN,
        "log_requests": False,
        "embedded": embedded,
    }
    config.write_text(json.dumps({**settings, "port": port}))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = args.fd_limit

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))

    gateway = subprocess.Popen(
        [sys.executable, "-m", "specgate.gateway.cli.main", "serve", "--config", str(config)],
        env={**os.environ, "SPECGATE_DATA_DIR": str(data)},
        preexec_fn=limited,
    )
    base = f"http://127.0.0.1:{port}"
    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    tally = Tally()
    try:
        deadline = time.monotonic() + 900
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                    break
            if gateway.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the gateway did not become ready")
            time.sleep(1)
        models = httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {VICTIM}"}).json()
        model = models["data"][0]["id"]
        body = chat_body(model, VICTIM_PROMPT, args.victim_tokens)
        idle = Victim()

        async def idle_run() -> None:
            for n in range(args.idle_requests):
                await victim_stream(base, body, f"victim-idle-{n}", idle, tally)

        asyncio.run(idle_run())
        ctx = multiprocessing.get_context("spawn")
        theirs, ours = ctx.Pipe(duplex=False)
        options = {k: getattr(args, k) for k in ("half_open", "hog_factor", "max_num_seqs", "hog_tokens")}
        options["attacks"] = [a.strip() for a in args.attacks.split(",") if a.strip()]
        attacker = ctx.Process(target=attack, args=(port, model, options, seconds, ours), daemon=True)
        attacker.start()
        victim, p, series = asyncio.run(hostile_run(base, body, seconds, gateway.pid, tally))
        attacks = theirs.recv() if theirs.poll(120) else {"answered": [], "statuses": {}, "transport": {}}
        attacker.join(30)
    finally:
        gateway.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            gateway.wait(60)
        if gateway.poll() is None:
            gateway.kill()
    answered = [*tally.answered, *attacks["answered"]]
    rows = rows_of(data / "telemetry.db")
    lost = [rid for rid in answered if rid not in rows]
    statuses = Counter(tally.statuses) + Counter({int(k): v for k, v in attacks["statuses"].items()})
    report = {
        "seconds": seconds,
        "idle": summary(idle),
        "hostile": summary(victim),
        "healthz": {
            "probes": p.probes,
            "failures": p.failures,
            "p50_ms": round(pct(p.waits, 0.5) or 0.0, 1),
            "p99_ms": round(pct(p.waits, 0.99) or 0.0, 1),
            "max_wait_ms": round(p.max_ms, 1),
            "over_200ms": sum(w > 200 for w in p.waits),
        },
        "attacks": options["attacks"],
        "statuses": dict(sorted(statuses.items())),
        "attacker_transport_errors": attacks["transport"],
        "slowloris_connections_cut": attacks.get("slowloris_cut", 0),
        "answered": len(answered),
        "rows_lost": len(lost),
        "lost_ids": lost[:20],
        "series": series,
    }
    (out / "exhaustion.json").write_text(json.dumps(report, indent=2))
    return 0 if print_report(report) else 1


def print_report(r: dict[str, Any]) -> bool:
    """Print the report and its goals; whether every goal was met."""
    idle, hostile = r["idle"], r["hostile"]
    for what in ("ttft", "tpot"):
        print(
            f"victim {what.upper()} ms p50/p99: idle {idle[what + '_ms_p50']} / {idle[what + '_ms_p99']}, "
            f"under attack {hostile[what + '_ms_p50']} / {hostile[what + '_ms_p99']}"
        )
    print(f"victim requests under attack: {hostile['requests']}, failed: {hostile['failed']}")
    h = r["healthz"]
    print(
        f"/healthz: {h['probes']} probes, {h['failures']} failed, p50 / p99 / max wait "
        f"{h['p50_ms']} / {h['p99_ms']} / {h['max_wait_ms']} ms, {h['over_200ms']} over 200 ms"
    )
    print(f"answers: {r['statuses']}; attacker transport errors: {r['attacker_transport_errors']}")
    print(f"slowloris connections cut by the gateway: {r['slowloris_connections_cut']}")
    print(
        f"rows: {r['answered'] - r['rows_lost']} of {r['answered']} answered requests ({r['rows_lost']} lost)"
    )
    series = r["series"]
    flat = True
    for name in [k for k in (series[0] if series else {}) if k != "t_s"]:
        fds = [row[name][0] for row in series if name in row]
        rss = [row[name][1] for row in series if name in row]
        print(
            f"{name}: descriptors first/max/last {fds[0]}/{max(fds)}/{fds[-1]}, "
            f"RSS MiB first/max/last {rss[0]}/{max(rss)}/{rss[-1]}"
        )
        # Flat: once the attack is at full strength (a quarter in), nothing keeps growing.
        q = max(1, len(fds) // 4)
        early_fds, late_fds = max(fds[q : 2 * q] or fds), max(fds[3 * q :] or fds)
        early_rss, late_rss = max(rss[q : 2 * q] or rss), max(rss[3 * q :] or rss)
        flat &= late_fds <= early_fds * 1.2 + 16 and late_rss <= early_rss * 1.1 + 16
    goals = [
        ("/healthz never waits more than 200 ms", h["max_wait_ms"] <= 200 and h["failures"] == 0),
        ("victim TTFT p99 under 2 s", (hostile["ttft_ms_p99"] or 1e9) < 2000 and not hostile["failed"]),
        ("0 rows lost", r["rows_lost"] == 0),
        ("descriptors and RSS flat over the run", flat),
    ]
    for text, ok in goals:
        print(f"{'PASS' if ok else 'MISS'}: {text}")
    return all(ok for _, ok in goals)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add_arguments(p)
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
