"""`specgate bench gateway`: what the gateway adds over calling the same backend directly, beside
LiteLLM, one run, the targets interleaved. (bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specgate.bench import launch, stub
from specgate.bench.stats import percentile, table

MODEL = "stub-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
# The same question on the Responses API (`store` at its default, true: each answer is saved).
RESPONSES_BODY = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 8}
RESPONSES = "specgate responses"  # --responses: the `specgate` process, called on /v1/responses
ANCHORS = "published, sequential on localhost: LiteLLM adds ~4 ms p50, TensorZero ~0.4 ms."
Sample = tuple[float, float]  # seconds to the first event (JSON: the response), and to the end
Call = Callable[[], Awaitable[Sample]]
NCPU = os.cpu_count() or 1
CPU_KEYS = ("client", "stub", "gateway", "machine")  # machine: busy time of all the machine's cores


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=4000, help="sequential requests per target and mode")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds per sequential mode")
    p.add_argument("--concurrency", type=int, default=100, help="requests in flight in the concurrent modes")
    p.add_argument("--concurrent-requests", type=int, default=6000, help="per target and concurrent mode")
    p.add_argument("--concurrent-rounds", type=int, default=6, help="interleaved rounds per concurrent mode")
    p.add_argument("--litellm", help="the LiteLLM proxy's `litellm` command (default: PATH, else the venv)")
    p.add_argument("--no-litellm", action="store_true", help="leave the LiteLLM row out")
    p.add_argument("--no-telemetry", action="store_true", help="turn specgate's telemetry store off")
    p.add_argument("--quick", action="store_true", help="a short run, about two minutes")
    p.add_argument("--responses", action="store_true", help="also call the 1-worker gateway's /v1/responses")


def httpx_call(client: httpx.AsyncClient, stream: bool, responses: bool = False) -> Call:
    url, body = ("/v1/responses", RESPONSES_BODY) if responses else ("/v1/chat/completions", BODY)
    body = {**body, "stream": stream}

    async def call() -> Sample:
        start = time.perf_counter()
        if not stream:
            r = await client.post(url, json=body)
            r.raise_for_status()
            r.json()
            end = time.perf_counter() - start
            return end, end
        first = None
        async with client.stream("POST", url, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if first is None and line.startswith("data:"):
                    first = time.perf_counter() - start
        if first is None:
            raise RuntimeError("empty stream")
        return first, time.perf_counter() - start

    return call


@dataclass
class Mode:
    label: str
    stream: bool
    inflight: int
    requests: int  # per target
    rounds: int


@dataclass
class Cell:
    """One target in one mode: latencies, wall and CPU time over the measured blocks."""

    first: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    round_p50: list[float] = field(default_factory=list)  # per round, of `first` (TTFT or response)
    rates: list[float] = field(default_factory=list)  # per block
    wall: float = 0.0
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CPU_KEYS, 0.0))
    procs: dict[int, float] = field(default_factory=dict)  # gateway pid -> CPU seconds
    roles: dict[int, str] = field(default_factory=dict)  # gateway pid -> main, worker, ...
    failed: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return statistics.fmean(self.rates) if self.rates else math.nan

    def per_req(self, role: str) -> float:
        return self.cpu[role] / max(len(self.end), 1)


async def block(calls: list[Call], n: int) -> tuple[list[Sample], float, list[str]]:
    """n requests, one worker per call (its own keep-alive connection) sending back to back. Returns
    the samples, the rate (successes / wall time with one worker, else the steady rate: the first and
    the last len(calls) completions, ramp-up and drain, left out) and the failures."""
    out, done, failed = list[Sample](), list[float](), list[str]()
    todo = iter(range(n))  # shared by the workers

    async def worker(call: Call) -> None:
        for _ in todo:
            try:
                out.append(await call())
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                failed.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            done.append(time.perf_counter())

    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in calls))
    k, m = len(calls), len(done)
    if k == 1 or m < 3 * k:
        return out, m / (done[-1] - start) if m else 0.0, failed
    return out, (m - 2 * k) / (done[m - k - 1] - done[k - 1]), failed


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = Path("/proc/stat").read_text().split()[1:9]
    return sum(int(x) for x in (user, nice, system, irq, softirq, steal)) * launch.TICK


async def measure_block(
    name: str, target: launch.Server, stub: launch.Server, calls: list[Call], n: int, cell: Cell
) -> list[float]:
    """One block of n requests to `target`, into `cell`; returns its latencies to the first event."""
    g0, s0 = target.snapshot(), stub.snapshot()
    m0, c0, t0 = machine_busy(), time.process_time(), time.perf_counter()
    samples, rate, failed = await block(calls, n)
    t1, c1, m1 = time.perf_counter(), time.process_time(), machine_busy()
    g1, s1 = launch.cpu_seconds(target.pids), launch.cpu_seconds(stub.pids)
    cell.wall += t1 - t0
    cell.cpu["client"] += c1 - c0
    cell.cpu["stub"] += sum(s1.get(p, v) - v for p, v in s0.items())
    if name != "direct":
        for pid, v in g0.items():
            cell.procs[pid] = cell.procs.get(pid, 0.0) + g1.get(pid, v) - v
            cell.roles.setdefault(pid, target.role(pid))
        cell.cpu["gateway"] = sum(cell.procs.values())
    cell.cpu["machine"] += m1 - m0
    cell.first += [s[0] for s in samples]
    cell.end += [s[1] for s in samples]
    cell.rates.append(rate)
    cell.failed += failed
    return [s[0] for s in samples]


def pct(xs: list[float], q: float) -> float:
    v = percentile(xs, 100 * q)
    return math.nan if v is None else v


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


async def measure(
    mode: Mode, targets: dict[str, launch.Server], calls: dict[str, list[Call]], warmup: int
) -> dict[str, Cell]:
    """Warm-up, then `mode.rounds` rounds: one block per target in turn, the order flipped every other."""
    for name in targets:
        await block(calls[name], warmup)
    cells = {name: Cell() for name in targets}
    n = max(1, mode.requests // mode.rounds)
    for rnd in range(mode.rounds):
        p50: dict[str, float] = {}
        for name in list(targets) if rnd % 2 == 0 else list(targets)[::-1]:
            first = await measure_block(name, targets[name], targets["direct"], calls[name], n, cells[name])
            p50[name] = pct(first, 0.5)
        for name, v in p50.items():
            cells[name].round_p50.append(v - p50["direct"])
    launch.log(f"done: {mode.label}")
    for name, cell in cells.items():
        if cell.failed:
            launch.log(f"{name}: {len(cell.failed)} failed, first: {cell.failed[0]}")
    return cells


async def measure_all(
    args: argparse.Namespace, targets: dict[str, launch.Server]
) -> list[tuple[Mode, dict[str, Cell]]]:
    def client(url: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, timeout=60, trust_env=False)

    # One client, so one keep-alive connection, per concurrent worker: httpx's pool scans all its
    # connections on every request, which would make one 100-connection client the bottleneck.
    seq = {name: [client(t.url)] for name, t in targets.items()}
    pools = {name: [client(t.url) for _ in range(args.concurrency)] for name, t in targets.items()}
    c, seq_n, conc_n = args.concurrency, args.requests, args.concurrent_requests
    modes = [
        (Mode("sequential", False, 1, seq_n, args.rounds), seq),
        (Mode("sequential stream", True, 1, seq_n, args.rounds), seq),
        # Last: a burst leaves a gateway's pool with many idle upstream connections.
        (Mode(f"{c} concurrent", False, c, conc_n, args.concurrent_rounds), pools),
        (Mode(f"{c} concurrent stream", True, c, conc_n, args.concurrent_rounds), pools),
    ]
    out = []
    for mode, clients in modes:
        calls = {k: [httpx_call(cl, mode.stream, k == RESPONSES) for cl in cs] for k, cs in clients.items()}
        out.append((mode, await measure(mode, targets, calls, warmup=30 if mode.inflight == 1 else 3 * c)))
    for cl in [*(x for cs in seq.values() for x in cs), *(x for cs in pools.values() for x in cs)]:
        await cl.aclose()
    return out


def latency_table(results: list[tuple[Mode, dict[str, Cell]]]) -> None:
    head = ["mode", "target", "n", "p50", "p99", "added p50", "added p99", "added mean"]
    rows = []
    for mode, cells in results:
        for kind, attr in [("first event", "first"), ("end", "end")] if mode.stream else [("", "end")]:
            base: list[float] = getattr(cells["direct"], attr)
            for name, cell in cells.items():
                xs: list[float] = getattr(cell, attr)
                ms = [1e3 * v for v in (pct(xs, 0.5), pct(xs, 0.99), pct(base, 0.5), pct(base, 0.99))]
                added = [ms[0] - ms[2], ms[1] - ms[3], 1e3 * (mean(xs) - mean(base))]
                n = f"{len(xs)}" + (f" ({len(cell.failed)} failed)" if cell.failed else "")
                row = [f"{mode.label}, {kind}" if kind else mode.label, name, n]
                row += [f"{v:.2f}" for v in (ms[0], ms[1], *(added if name != "direct" else []))]
                row += ["-"] * 3 if name == "direct" else []
                spread = f"{1e3 * min(cell.round_p50):.2f} … {1e3 * max(cell.round_p50):.2f}"
                row += [spread if name != "direct" and (attr == "first" or not mode.stream) else "-"]
                rows.append([*row, f"{cell.rate:.0f}" if attr == "end" else "-"])
    print("\nLatency, ms (added: minus direct's quantile)")
    print("\n".join(table([*head, "added p50 per round", "req/s"], rows)))


def limit(mode: Mode, name: str, cell: Cell) -> str:
    """What bounds the rate: the machine's cores, one process's core (an event loop), or latency."""
    busy = {role: cell.cpu[role] / cell.wall for role in ("client", "stub", "gateway")}
    busy["other processes"] = max(0.0, cell.cpu["machine"] / cell.wall - sum(busy.values()))  # all else
    procs = {"client": busy["client"], "stub": busy["stub"]}
    procs |= {f"{name} {cell.roles[p]}": v / cell.wall for p, v in cell.procs.items()}
    top, hot = max(busy, key=lambda k: busy[k]), max(procs, key=lambda k: procs[k])
    total = sum(busy.values())
    if total >= 0.85 * NCPU:
        return f"CPU: {total:.2f} of {NCPU} cores busy, most by {top} ({100 * busy[top] / total:.0f}%)"
    if procs[hot] >= 0.85:
        return f"{hot}'s one core ({procs[hot]:.2f} busy)"
    return "latency: one in flight" if mode.inflight == 1 else "none saturated"


def cpu_table(results: list[tuple[Mode, dict[str, Cell]]]) -> None:
    head = ["mode", "target", "req/s", "client µs/req", "stub µs/req", "gateway µs/req (per process)"]
    head += ["cores busy: client + stub + gateway (machine)", "what limits the rate"]
    rows = []
    for mode, cells in results:
        for name, cell in cells.items():
            n = max(len(cell.end), 1)
            gw = "-" if name == "direct" else f"{1e6 * cell.per_req('gateway'):.0f}"
            if name != "direct" and len(cell.procs) > 1:
                parts = (f"{cell.roles[p]} {1e6 * v / n:.0f}" for p, v in sorted(cell.procs.items()))
                gw += " (" + ", ".join(parts) + ")"
            busy = [cell.cpu[r] / cell.wall for r in CPU_KEYS]
            cores = " + ".join(f"{b:.2f}" for b in busy[:3]) + f" = {sum(busy[:3]):.2f} ({busy[3]:.2f})"
            row = [mode.label, name, f"{cell.rate:.0f}"]
            row += [f"{1e6 * cell.per_req(r):.0f}" for r in ("client", "stub")]
            rows.append([*row, gw, cores, limit(mode, name, cell)])
    print(f"\nCPU per request (µs), cores busy over the blocks, and what limits the rate ({NCPU} cores)")
    print("\n".join(table(head, rows)))


def goals(results: list[tuple[Mode, dict[str, Cell]]]) -> list[tuple[str, bool | None]]:
    """The goals, each met, missed, or None: a figure given for information."""
    by = {mode.label: cells for mode, cells in results}
    seq, sseq = by["sequential"], by["sequential stream"]
    firsts = [("sequential", seq, "end"), ("sequential stream, first event", sseq, "first")]
    concurrent = [(m, c) for m, c in results if m.inflight > 1]

    def added(cells: dict[str, Cell], name: str, attr: str, q: float) -> float:
        return 1e3 * (pct(getattr(cells[name], attr), q) - pct(getattr(cells["direct"], attr), q))

    p50, p99 = added(seq, "specgate", "end", 0.5), added(seq, "specgate", "end", 0.99)
    out: list[tuple[str, bool | None]] = [
        (f"specgate added p50, sequential: {p50:.2f} ms (goal < 1 ms)", p50 < 1.0),
        (f"specgate added p99, sequential: {p99:.2f} ms (goal < 2 ms)", p99 < 2.0),
    ]
    for mode, cells in concurrent:
        r, r2 = (cells[k].rate / cells["direct"].rate for k in ("specgate", "specgate x2"))
        out.append((f"specgate req/s / direct's, {mode.label}: {100 * r:.0f}% (goal >= 60%)", r >= 0.6))
        two = f"specgate x2 req/s / direct's, {mode.label}: {100 * r2:.0f}% (2 workers: x{r2 / r:.2f})"
        out.append((two, None))
    for label, cells, attr in firsts if RESPONSES in seq else []:
        chat, resp = added(cells, "specgate", attr, 0.5), added(cells, RESPONSES, attr, 0.5)
        text = f"/v1/responses added p50 / chat's, {label}: {resp:.2f} / {chat:.2f} ms"
        text += " (goal within 10%, or 0.1 ms)"
        out.append((text, resp <= chat * 1.1 or resp - chat < 0.1))
    for label, cells, attr in firsts if "litellm" in seq else []:
        ll, sg = added(cells, "litellm", attr, 0.5), added(cells, "specgate", attr, 0.5)
        ratio = f"{ll / sg:.1f}x" if sg > 0 else "inf (specgate adds <= 0)"
        text = f"litellm added p50 / specgate's, {label}: {ll:.2f} / {sg:.2f} ms = {ratio} (goal >= 5x)"
        out.append((text, sg <= 0 or ll / sg >= 5))
    for mode, cells in concurrent if "litellm" in seq else []:
        r = cells["specgate"].rate / cells["litellm"].rate
        out.append((f"specgate req/s / litellm's, {mode.label}: {r:.1f}x (goal >= 5x)", r >= 5))
    return out


@contextlib.contextmanager
def targets(
    args: argparse.Namespace, tmp: Path
) -> Iterator[tuple[dict[str, launch.Server], str | None, str]]:
    """Every target up; the LiteLLM binary used (None: no row) and why not."""
    litellm = None if args.no_litellm else launch.find_litellm(args.litellm)
    skipped = "no `litellm` on PATH nor /work/litellm-venv (--litellm PATH)"
    skipped = "--no-litellm" if args.no_litellm else skipped
    with contextlib.ExitStack() as stack:
        port = launch.free_port()
        cmd = stub.command(stub.PoolConfig(model=MODEL, name="direct", canned=True), port)
        direct = launch.running(cmd, tmp / "direct.log", f"http://127.0.0.1:{port}/health", 180, cwd=tmp)
        out = {"direct": stack.enter_context(direct)}
        for workers in (1, 2):
            # As served (routing policy on) but for the embedded engine (off), the stub as its one
            # backend, the telemetry store on a throwaway SQLite file (or off).
            name = "specgate" if workers == 1 else "specgate x2"
            (d := tmp / name.replace(" ", "_")).mkdir()
            backend = {"name": "stub", "base_url": f"{out['direct'].url}/v1", "models": [MODEL]}
            store = {"url": f"sqlite:///{d}/t.db", "auto_upgrade": True, "spool_dir": str(d / "spool")}
            config = {"embedded": {"enabled": False}, "backends": [{**backend, "health_interval": 0}]}
            config["telemetry"] = {"enabled": False} if args.no_telemetry else store
            extra = ["--workers", str(workers)]
            gateway = launch.specgate(d / "specgate.log", None, 180, config=config, extra=extra, cwd=tmp)
            out[name] = stack.enter_context(gateway)
            if args.responses and workers == 1:  # the same process, measured in its own blocks
                out[RESPONSES] = out[name]
        if litellm:
            port = launch.free_port()
            cmd = launch.litellm_command(litellm, port, out["direct"].url, MODEL, tmp)
            ready = f"http://127.0.0.1:{port}/health/readiness"
            proxy = launch.running(cmd, tmp / "litellm.log", ready, 180, launch.LITELLM_ENV, cwd=tmp)
            try:
                out["litellm"] = stack.enter_context(proxy)
            except (OSError, RuntimeError) as exc:
                launch.log(f"litellm did not start, no row for it: {exc}")
                litellm, skipped = None, "it did not start (its error above)"
        yield out, litellm, skipped


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.requests, args.rounds = 400, 4
        args.concurrent_requests, args.concurrent_rounds = 10 * args.concurrency, 2
    with tempfile.TemporaryDirectory() as tmp_name, targets(args, Path(tmp_name)) as (up, litellm, skipped):
        for name, server in up.items():
            launch.log(f"{name}: ready in {server.started_in:.1f} s, {len(server.pids)} processes")
        results = asyncio.run(measure_all(args, up))
        errors = {name: server.log_errors() for name, server in up.items()}
    tel, also = "off" if args.no_telemetry else "on (SQLite)", " and through LiteLLM" if litellm else ""
    rounds = f"{args.rounds} sequential, {args.concurrent_rounds} concurrent"
    peer = (
        f"LiteLLM {launch.litellm_version(litellm)}, one worker" if litellm else f"no LiteLLM row: {skipped}"
    )
    print(f"\nStub backend direct, through specgate (telemetry {tel}; 1 and 2 workers){also};")
    print("client: httpx.AsyncClient, keep-alive, one client per concurrent worker")
    print(f"rounds per mode: {rounds}, targets interleaved\n{peer}")
    latency_table(results)
    cpu_table(results)
    print("\nGoals")
    for text, ok in goals(results):
        print(f"  {'info' if ok is None else 'PASS' if ok else 'MISS'} {text}")
    if "litellm" not in up:
        print("  (no LiteLLM row: its goals not measured)")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{ANCHORS}\nstarted in: " + ", ".join(f"{name} {s.started_in:.1f} s" for name, s in up.items()))
    print(f"{NCPU} CPUs; load average {load}; error lines in logs: {errors}")
    return 0
