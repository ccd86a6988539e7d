"""What the gateway adds over calling the same backend directly, beside LiteLLM, one run, side by side.

    python bench/bench_gateway.py [--quick] [--requests 4000] [--concurrency 100] [--litellm PATH]
                                  [--baseline OTHER/.venv/bin/python] [--responses]

Targets, all fronting one stub OpenAI-compatible backend (bench/stub_backend.py: canned answers,
no model): `direct` (the stub itself), `specgate` (`specgate serve`, one worker, the default),
`specgate x2` (`--workers 2`: a supervisor and two worker processes) and `litellm` (the LiteLLM
proxy, one worker, when installed: --litellm, else `litellm` on PATH, else /work/litellm-venv).
specgate runs as served (routing policy on: it classifies every request) but for its embedded
engine (off) and its telemetry store (a throwaway SQLite file; --no-telemetry: off). Processes and
their CPU accounting: bench/gateway_targets.py. With --baseline, another build of specgate (the
interpreter of another checkout's venv) runs as `base` and `base x2` beside this one, and the
goals end with this build's figures over the baseline's.

The client is this process: httpx.AsyncClient with keep-alive, one client (one connection) per
concurrent worker, as in the issue's baseline. Modes: sequential (one request in flight), JSON and
streaming (time to the first event, and to the end), then --concurrency requests in flight (closed
loop), JSON and streaming. Each mode warms every target up, then runs rounds; in each round every
target gets a block of requests in turn, the order alternating between rounds, so that drift and
noise from other work on the machine hit all alike. `added` is a target's latency quantile minus
direct's; req/s at N in flight is the steady rate (the first and last N completions of a block
left out). CPU time per request of each process, from /proc/<pid>/stat over the blocks (the
target's whole process tree, the stub's) and time.process_time (this client): 10 ms ticks, so
take the smaller figures of --quick runs as rough. What limits the rate: the machine's cores when
they are 85% busy (ours, and other processes: /proc/stat), else a process at 85% of one core (an
event loop), else latency (one in flight). Last, the issue's goals, each with PASS or MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specgate.bench import gateway_targets as gt
from specgate.bench.stub_backend import MODEL

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
# The same question on the Responses API (`store` at its default, true: each answer is saved).
RESPONSES_BODY = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 8}
RESPONSES = "specgate responses"  # --responses: the `specgate` process, called on /v1/responses
ANCHORS = "published, sequential on localhost: LiteLLM adds ~4 ms p50, TensorZero ~0.4 ms."
Sample = tuple[float, float]  # seconds to the first event (JSON: the response), and to the end
Call = Callable[[], Awaitable[Sample]]
NCPU = os.cpu_count() or 1
CPU_KEYS = ("client", "stub", "gateway", "machine")  # machine: busy time of all the machine's cores


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
    overhead: str = "-"
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
    out: list[Sample] = []
    done: list[float] = []
    failed: list[str] = []
    left = n

    async def worker(call: Call) -> None:
        nonlocal left
        while left > 0:
            left -= 1
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
    return sum(int(x) for x in (user, nice, system, irq, softirq, steal)) * gt.TICK


async def measure_block(
    target: gt.Target, stub: gt.Target, calls: list[Call], n: int, cell: Cell
) -> list[float]:
    """One block of n requests to `target`, into `cell`; returns its latencies to the first event."""
    g0, s0 = target.snapshot(), stub.snapshot()
    m0, c0, t0 = machine_busy(), time.process_time(), time.perf_counter()
    samples, rate, failed = await block(calls, n)
    t1, c1, m1 = time.perf_counter(), time.process_time(), machine_busy()
    g1, s1 = gt.cpu_seconds(target.pids), gt.cpu_seconds(stub.pids)
    cell.wall += t1 - t0
    cell.cpu["client"] += c1 - c0
    cell.cpu["stub"] += sum(s1.get(p, v) - v for p, v in s0.items())
    if target is not stub:
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
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else math.nan


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


Hist = tuple[dict[float, float], float, float]


def overhead_hist(url: str) -> Hist:
    """specgate_gateway_overhead_seconds for the chat endpoint: cumulative buckets, sum, count."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", trust_env=False).text):
        if fam.name != "specgate_gateway_overhead_seconds":
            continue
        for s in fam.samples:
            if s.labels.get("endpoint") != "chat":
                continue
            if s.name.endswith("_bucket"):
                buckets[float(s.labels["le"])] = buckets.get(float(s.labels["le"]), 0.0) + s.value
            elif s.name.endswith("_sum"):
                total += s.value
            elif s.name.endswith("_count"):
                count += s.value
    return buckets, total, count


def hist_summary(before: Hist, after: Hist) -> str:
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
    mode: Mode, targets: list[gt.Target], calls: dict[str, list[Call]], warmup: int
) -> dict[str, Cell]:
    """Warm-up, then `mode.rounds` rounds: one block per target in turn, the order flipped every other."""
    stub = targets[0]
    for t in targets:
        await block(calls[t.name], warmup)
    hists = {t.name: overhead_hist(t.url) for t in targets if t.metrics}
    cells = {t.name: Cell() for t in targets}
    n = max(1, mode.requests // mode.rounds)
    for rnd in range(mode.rounds):
        p50: dict[str, float] = {}
        for t in targets if rnd % 2 == 0 else targets[::-1]:
            p50[t.name] = pct(await measure_block(t, stub, calls[t.name], n, cells[t.name]), 0.5)
        for name, v in p50.items():
            cells[name].round_p50.append(v - p50["direct"])
    for t in targets:
        if t.metrics:
            cells[t.name].overhead = hist_summary(hists[t.name], overhead_hist(t.url))
    print(f"  done: {mode.label}", file=sys.stderr)
    for name, cell in cells.items():
        if cell.failed:
            print(f"  {name}: {len(cell.failed)} failed, first: {cell.failed[0]}", file=sys.stderr)
    return cells


async def run(args: argparse.Namespace, targets: list[gt.Target]) -> list[tuple[Mode, dict[str, Cell]]]:
    def client(url: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, timeout=60, trust_env=False)

    # One client, so one keep-alive connection, per concurrent worker: httpx's pool scans all its
    # connections on every request, which would make one 100-connection client the bottleneck.
    seq = {t.name: [client(t.url)] for t in targets}
    pools = {t.name: [client(t.url) for _ in range(args.concurrency)] for t in targets}
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


def table(head: list[str], rows: list[list[str]]) -> None:
    for row in (head, ["---"] * len(head), *rows):
        print("| " + " | ".join(row) + " |")


def latency_table(results: list[tuple[Mode, dict[str, Cell]]]) -> None:
    head = ["mode", "target", "n", "p50", "p99", "added p50", "added p99", "added mean"]
    head += ["added p50 per round", "req/s", "specgate-reported pre-dispatch overhead mean / p50 / p99"]
    rows = []
    for mode, cells in results:
        kinds = [("first event", "first"), ("end", "end")] if mode.stream else [("", "end")]
        for kind, attr in kinds:
            base: list[float] = getattr(cells["direct"], attr)
            for name, cell in cells.items():
                xs: list[float] = getattr(cell, attr)
                ms = [1e3 * v for v in (pct(xs, 0.5), pct(xs, 0.99), pct(base, 0.5), pct(base, 0.99))]
                added = [ms[0] - ms[2], ms[1] - ms[3], 1e3 * (mean(xs) - mean(base))]
                spread = f"{1e3 * min(cell.round_p50):.2f} … {1e3 * max(cell.round_p50):.2f}"
                n = f"{len(xs)}" + (f" ({len(cell.failed)} failed)" if cell.failed else "")
                row = [f"{mode.label}, {kind}" if kind else mode.label, name, n]
                row += [f"{v:.2f}" for v in (ms[0], ms[1], *added)]
                if name == "direct":
                    row[5:8] = ["-"] * 3
                row += [spread if name != "direct" and (attr == "first" or not mode.stream) else "-"]
                row += [f"{cell.rate:.0f}" if attr == "end" else "-", cell.overhead if attr == "end" else "-"]
                rows.append(row)
    print("\nLatency, ms (added: minus direct's quantile)")
    table(head, rows)


def limit(mode: Mode, name: str, cell: Cell) -> str:
    """What bounds the rate: the machine's cores, one process's core (an event loop), or latency."""
    busy = {role: cell.cpu[role] / cell.wall for role in ("client", "stub", "gateway")}
    busy["other processes"] = max(
        0.0, cell.cpu["machine"] / cell.wall - sum(busy.values())
    )  # all else running
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
            gw = "-"
            if name != "direct":
                gw = f"{1e6 * cell.per_req('gateway'):.0f}"
                if len(cell.procs) > 1:
                    parts = (f"{cell.roles[p]} {1e6 * v / n:.0f}" for p, v in sorted(cell.procs.items()))
                    gw += " (" + ", ".join(parts) + ")"
            busy = [cell.cpu[r] / cell.wall for r in ("client", "stub", "gateway", "machine")]
            cores = " + ".join(f"{b:.2f}" for b in busy[:3]) + f" = {sum(busy[:3]):.2f} ({busy[3]:.2f})"
            row = [mode.label, name, f"{cell.rate:.0f}"]
            row += [f"{1e6 * cell.per_req(r):.0f}" for r in ("client", "stub")]
            rows.append([*row, gw, cores, limit(mode, name, cell)])
    print(f"\nCPU per request (µs), cores busy over the blocks, and what limits the rate ({NCPU} cores)")
    table(head, rows)


def goals(results: list[tuple[Mode, dict[str, Cell]]]) -> None:
    by = {mode.label: cells for mode, cells in results}
    seq, sseq = by["sequential"], by["sequential stream"]
    conc_modes = [(m, c) for m, c in results if m.inflight > 1]

    def mark(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    def added(cells: dict[str, Cell], name: str, attr: str, q: float) -> float:
        return 1e3 * (pct(getattr(cells[name], attr), q) - pct(getattr(cells["direct"], attr), q))

    print("\nGoals")
    p50, p99 = added(seq, "specgate", "end", 0.5), added(seq, "specgate", "end", 0.99)
    print(f"  {mark(p50 < 1.0)} specgate added p50, sequential: {p50:.2f} ms (goal < 1 ms)")
    print(f"  {mark(p99 < 2.0)} specgate added p99, sequential: {p99:.2f} ms (goal < 2 ms)")
    for mode, cells in conc_modes:
        r, r2 = (cells[k].rate / cells["direct"].rate for k in ("specgate", "specgate x2"))
        print(f"  {mark(r >= 0.6)} specgate req/s / direct's, {mode.label}: {100 * r:.0f}% (goal >= 60%)")
        print(
            f"  info specgate x2 req/s / direct's, {mode.label}: {100 * r2:.0f}% (2 workers: x{r2 / r:.2f})"
        )
    if RESPONSES in seq:
        for label, cells, attr in [
            ("sequential", seq, "end"),
            ("sequential stream, first event", sseq, "first"),
        ]:
            chat, resp = added(cells, "specgate", attr, 0.5), added(cells, RESPONSES, attr, 0.5)
            ok = resp <= chat * 1.1 or resp - chat < 0.1
            print(
                f"  {mark(ok)} /v1/responses added p50 / chat's, {label}: {resp:.2f} / {chat:.2f} ms "
                "(goal within 10%, or 0.1 ms)"
            )
    if "base" in seq:
        baseline(results, added)
    if "litellm" not in seq:
        print("  (no LiteLLM row: its goals not measured)")
        return
    for label, cells, attr in [("sequential", seq, "end"), ("sequential stream, first event", sseq, "first")]:
        ll, sg = added(cells, "litellm", attr, 0.5), added(cells, "specgate", attr, 0.5)
        ratio = f"{ll / sg:.1f}x" if sg > 0 else "inf (specgate adds <= 0)"
        ok = sg <= 0 or ll / sg >= 5
        print(
            f"  {mark(ok)} litellm added p50 / specgate's, {label}: {ll:.2f} / {sg:.2f} ms = {ratio}", end=""
        )
        print(" (goal >= 5x)")
    for mode, cells in conc_modes:
        r = cells["specgate"].rate / cells["litellm"].rate
        print(f"  {mark(r >= 5)} specgate req/s / litellm's, {mode.label}: {r:.1f}x (goal >= 5x)")


def baseline(
    results: list[tuple[Mode, dict[str, Cell]]], added: Callable[[dict[str, Cell], str, str, float], float]
) -> None:
    """This build beside the baseline build, measured in the same rounds."""
    for mode, cells in results:
        if mode.inflight == 1:
            for q in (0.5, 0.99):
                ours, base = added(cells, "specgate", "end", q), added(cells, "base", "end", q)
                label = f"added p{round(q * 100)}, {mode.label}"
                print(f"  info {label}: this build {ours:.2f} ms, the base build {base:.2f} ms")
        else:
            for name in ("specgate", "specgate x2"):
                other = name.replace("specgate", "base")
                r = cells[name].rate / cells[other].rate
                print(f"  info {name} req/s / the base build's, {mode.label}: {r:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4000, help="sequential requests per target and mode")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds per sequential mode")
    ap.add_argument("--concurrency", type=int, default=100, help="requests in flight in the concurrent modes")
    ap.add_argument("--concurrent-requests", type=int, default=6000, help="per target and concurrent mode")
    ap.add_argument("--concurrent-rounds", type=int, default=6, help="interleaved rounds per concurrent mode")
    ap.add_argument("--litellm", help="the LiteLLM proxy's `litellm` command (default: PATH, else the venv)")
    ap.add_argument("--no-litellm", action="store_true", help="leave the LiteLLM row out")
    ap.add_argument("--no-telemetry", action="store_true", help="turn specgate's telemetry store off")
    ap.add_argument("--quick", action="store_true", help="a short run, about two minutes")
    ap.add_argument("--baseline", metavar="PYTHON", help="another build's interpreter, run beside this one")
    ap.add_argument(
        "--responses", action="store_true", help="also call the one-worker gateway on /v1/responses"
    )
    args = ap.parse_args()
    if args.quick:
        args.requests, args.rounds = 400, 4
        args.concurrent_requests, args.concurrent_rounds = 10 * args.concurrency, 2

    litellm = None if args.no_litellm else gt.find_litellm(args.litellm)
    skipped = (
        "--no-litellm" if args.no_litellm else "no `litellm` on PATH nor /work/litellm-venv (--litellm PATH)"
    )
    targets: list[gt.Target] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        try:
            targets.append(gt.start_stub(tmp))
            stub = targets[0].url
            telemetry = not args.no_telemetry
            targets.append(gt.start_specgate("specgate", stub, tmp, 1, telemetry))
            if args.responses:  # the same process as `specgate`, measured in its own blocks
                targets.append(dataclasses.replace(targets[-1], name=RESPONSES))
            targets.append(gt.start_specgate("specgate x2", stub, tmp, 2, telemetry))
            if args.baseline:
                targets.append(gt.start_specgate("base", stub, tmp, 1, telemetry, args.baseline))
                targets.append(gt.start_specgate("base x2", stub, tmp, 2, telemetry, args.baseline))
            if litellm:
                try:
                    targets.append(gt.start_litellm(litellm, stub, tmp))
                except (OSError, RuntimeError) as exc:
                    print(f"  litellm did not start, no row for it: {exc}", file=sys.stderr)
                    litellm, skipped = None, "it did not start (its error above)"
            for t in targets:
                print(f"  {t.name}: ready in {t.started_in:.1f} s, {len(t.pids)} processes", file=sys.stderr)
            results = asyncio.run(run(args, targets))
        finally:
            errors = {t.name: t.log_errors() for t in targets}
            for t in reversed(targets):
                t.stop()

    tel = "off" if args.no_telemetry else "on (SQLite)"
    also = " and through LiteLLM" if litellm else ""
    print(f"\nStub backend direct, through specgate (telemetry {tel}; 1 and 2 workers){also};")
    print("client: httpx.AsyncClient, keep-alive, one client per concurrent worker (the issue's baseline)")
    rounds = f"{args.rounds} sequential, {args.concurrent_rounds} concurrent"
    print(f"rounds per mode: {rounds}, the targets interleaved (order alternating between rounds)")
    if not litellm:
        print(f"no LiteLLM row: {skipped}")
    else:
        print(f"LiteLLM {gt.litellm_version(litellm)} ({litellm}), one uvicorn worker, no master key")
    latency_table(results)
    cpu_table(results)
    goals(results)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{ANCHORS}\nstarted in: " + ", ".join(f"{t.name} {t.started_in:.1f} s" for t in targets))
    print(f"{NCPU} CPUs; load average {load}; error lines in logs: {errors}")


if __name__ == "__main__":
    main()
