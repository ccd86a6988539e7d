"""Latency the gateway adds over calling the same backend directly, one run, side by side.

    python bench/bench_gateway.py [--requests 500] [--concurrency 100] [--rounds 5] [--openai] [--quick]

Three processes: a stub OpenAI-compatible backend (bench/stub_backend.py: canned answers, no model),
`specgate serve` fronting it (embedded engine off), and this client (httpx.AsyncClient, keep-alive).
Every mode sends the same request to the stub directly and through specgate, interleaved: one by
one in turn for the sequential modes, in alternating rounds for the concurrent one, after a
warm-up; so drift and noise from other work on the machine hit both alike. Modes: sequential
(non-streaming end to end, and streaming time to first event), and --concurrency requests in
flight at once (closed loop). `added` is the difference of the two latency distributions'
quantiles; n is requests per target. Beside it: specgate's own `specgate_gateway_overhead_seconds`
histogram from /metrics (arrival to backend call, the request half only; quantiles from buckets).
specgate runs as served (`specgate serve`), its telemetry store on a throwaway SQLite file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent

from specgate.bench.stub_backend import MODEL, free_port, launch

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
ANCHORS = (
    "published, sequential on localhost: LiteLLM adds ~4 ms p50, TensorZero ~0.4 ms."
    " Goal: p50 < 1 ms, p99 < 5 ms."
)
Call = Callable[[], Awaitable[float]]  # one request; returns its latency in seconds


def httpx_call(client: httpx.AsyncClient, stream: bool) -> Call:
    url, body = "/v1/chat/completions", {**BODY, "stream": stream}

    async def call() -> float:
        start = time.perf_counter()
        if not stream:
            r = await client.post(url, json=body)
            r.raise_for_status()
            json.loads(r.content)
            return time.perf_counter() - start
        first = None  # time to the first event; the rest is read too, so the connection is kept
        async with client.stream("POST", url, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if first is None and line.startswith("data:"):
                    first = time.perf_counter() - start
        if first is None:
            raise RuntimeError("empty stream")
        return first

    return call


def openai_call(client: Any) -> Call:  # an openai.AsyncOpenAI
    async def call() -> float:
        start = time.perf_counter()
        await client.chat.completions.create(**BODY)
        return time.perf_counter() - start

    return call


async def sequential(calls: dict[str, list[Call]], n: int) -> dict[str, list[float]]:
    """n requests per target, one at a time, the targets taking turns (order flipped every other)."""
    out: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for i in range(n):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name].append(await calls[name][0]())
    return out


async def closed_loop(calls: list[Call], n: int) -> tuple[list[float], float]:
    """n requests, one worker per call (its own keep-alive connection) sending back to back."""
    out: list[float] = []
    left = n

    async def worker(call: Call) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            out.append(await call())

    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in calls))
    return out, len(out) / (time.perf_counter() - start)


async def concurrent(
    calls: dict[str, list[Call]], n: int, rnd: int, rates: dict[str, list[float]]
) -> dict[str, list[float]]:
    """One closed-loop burst per target, the first target alternating between rounds."""
    out = {}
    for name in list(calls) if rnd % 2 == 0 else list(calls)[::-1]:
        out[name], rate = await closed_loop(calls[name], n)
        rates[name].append(rate)
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def overhead_hist(gateway: str) -> tuple[dict[float, float], float, float]:
    """specgate_gateway_overhead_seconds for the chat endpoint: cumulative buckets, sum, count."""
    text = httpx.get(f"{gateway}/metrics", trust_env=False).text
    buckets: dict[float, float] = {}
    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name != "specgate_gateway_overhead_seconds":
            continue
        for s in fam.samples:
            if s.labels.get("endpoint") != "chat":
                continue
            if s.name.endswith("_bucket"):
                buckets[float(s.labels["le"])] = s.value
            elif s.name.endswith("_sum"):
                total = s.value
            elif s.name.endswith("_count"):
                count = s.value
    return buckets, total, count


def hist_summary(before: tuple, after: tuple) -> str:
    (b0, s0, c0), (b1, s1, c1) = before, after
    n = c1 - c0
    if n <= 0:
        return "n/a"
    cum = sorted((le, b1[le] - b0.get(le, 0.0)) for le in b1)

    def quantile(q: float) -> str:  # linear within the bucket, as Prometheus' histogram_quantile
        lo, seen = 0.0, 0.0
        for le, c in cum:
            if c >= q * n:
                if le == float("inf"):
                    return f">{lo * 1e3:g}"
                return f"{(lo + (le - lo) * (q * n - seen) / max(c - seen, 1e-9)) * 1e3:.2f}"
            lo, seen = le, c
        return "?"

    return f"{(s1 - s0) / n * 1e3:.2f} / {quantile(0.5)} / {quantile(0.99)}"


async def measure(
    label: str, calls: dict[str, list[Call]], args: argparse.Namespace, gateway: str
) -> list[str]:
    """One table row: warm-up, then --rounds interleaved rounds of this mode (sequential: one call each)."""
    conc = len(calls["direct"]) > 1
    n = max(1, (args.concurrent_requests if conc else args.requests) // args.rounds)
    rates: dict[str, list[float]] = {k: [] for k in calls}
    await (concurrent(calls, 2 * args.concurrency, 0, rates) if conc else sequential(calls, 30))
    rates = {k: [] for k in calls}
    before = overhead_hist(gateway)
    samples: dict[str, list[float]] = {k: [] for k in calls}
    per_round: list[float] = []  # added p50, per round
    for rnd in range(args.rounds):
        got = await (concurrent(calls, n, rnd, rates) if conc else sequential(calls, n))
        per_round.append(1e3 * (pct(got["specgate"], 0.5) - pct(got["direct"], 0.5)))
        for k, xs in got.items():
            samples[k].extend(xs)
    d, g = samples["direct"], samples["specgate"]
    ms = [1e3 * v for v in (pct(d, 0.5), pct(d, 0.99), pct(g, 0.5), pct(g, 0.99))]
    added_mean = 1e3 * (statistics.fmean(g) - statistics.fmean(d))
    rate = " / ".join(f"{statistics.fmean(rates[k]):.0f}" for k in ("direct", "specgate")) if conc else "-"
    print(f"  done: {label}", file=sys.stderr)
    cells = [f"{v:.2f}" for v in (*ms, ms[2] - ms[0], ms[3] - ms[1], added_mean)]
    spread = f"{min(per_round):.2f} … {max(per_round):.2f}"
    return [label, str(len(g)), *cells, spread, rate, hist_summary(before, overhead_hist(gateway))]


async def run(args: argparse.Namespace, urls: dict[str, str]) -> list[list[str]]:
    def client(url: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, timeout=60, trust_env=False)

    # One client, so one keep-alive connection, per concurrent worker: httpx's pool scans all its
    # connections on every request, which would make one 100-connection client the bottleneck.
    seq = {k: client(u) for k, u in urls.items()}
    pools = {k: [client(u) for _ in range(args.concurrency)] for k, u in urls.items()}
    rows = [
        ("sequential", {k: [httpx_call(c, False)] for k, c in seq.items()}),
        ("sequential, stream TTFT", {k: [httpx_call(c, True)] for k, c in seq.items()}),
    ]
    if args.openai:
        import openai

        sdk = {k: openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="-", max_retries=0) for k, u in urls.items()}
        rows.append(("sequential, openai SDK", {k: [openai_call(c)] for k, c in sdk.items()}))
    # Last: a burst leaves specgate's pool with many idle upstream connections, which slows it after.
    conc = {k: [httpx_call(c, False) for c in cs] for k, cs in pools.items()}
    rows.append((f"{args.concurrency} concurrent", conc))
    table = [await measure(label, calls, args, urls["specgate"]) for label, calls in rows]
    for c in [*seq.values(), *(c for cs in pools.values() for c in cs)]:
        await c.aclose()
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=500, help="sequential requests per target and mode")
    ap.add_argument("--concurrency", type=int, default=100, help="requests in flight in the concurrent mode")
    ap.add_argument("--concurrent-requests", type=int, default=3000, help="per target, concurrent mode")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per mode")
    ap.add_argument("--openai", action="store_true", help="add a sequential row with the openai SDK")
    ap.add_argument("--no-telemetry", action="store_true", help="turn specgate's telemetry store off")
    ap.add_argument("--quick", action="store_true", help="a short run: 100 sequential, 2 rounds")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.concurrent_requests, args.rounds = 100, 4 * args.concurrency, 2

    stub_port, gw_port = free_port(), free_port()
    stub, gateway = f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{gw_port}"
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        # As served by default but for the telemetry store, which writes to a throwaway SQLite file.
        telemetry = {"url": f"sqlite:///{tmp}/t.db", "auto_upgrade": True, "spool_path": f"{tmp}/spool"}
        config = {
            "port": gw_port,
            "embedded": {"enabled": False},
            "backends": [{"name": "stub", "base_url": f"{stub}/v1", "models": [MODEL], "health_interval": 0}],
            "telemetry": {"enabled": False} if args.no_telemetry else telemetry,
        }
        cfg = Path(tmp) / "specgate.json"
        cfg.write_text(json.dumps(config))
        try:
            stub_cmd = [sys.executable, str(ROOT / "bench" / "stub_backend.py"), "--port", str(stub_port)]
            procs.append(launch(stub_cmd, f"{stub}/v1/models"))
            gw_cmd = [sys.executable, "-m", "specgate.gateway.cli.main", "serve", "--config", str(cfg)]
            procs.append(launch(gw_cmd, f"{gateway}/readyz"))
            table = asyncio.run(run(args, {"direct": stub, "specgate": gateway}))
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)

    tel = "off" if args.no_telemetry else "on (SQLite)"
    print(f"\nstub backend vs specgate (telemetry {tel}), ms; {args.rounds} interleaved rounds per mode")
    head = ["mode", "n", "direct p50", "direct p99", "specgate p50", "specgate p99", "added p50"]
    head += ["added p99", "added mean", "added p50 per round", "req/s direct / specgate"]
    head += ["specgate-reported pre-dispatch overhead mean / p50 / p99"]
    for row in (head, ["---"] * len(head), *table):
        print("| " + " | ".join(row) + " |")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{ANCHORS}\nclient, stub and specgate share {os.cpu_count()} CPUs here; load average {load}")


if __name__ == "__main__":
    main()
