"""`specgate bench serve`: one run = every arm x every load point over the same requests."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
import openai
from tqdm import tqdm

from specgate.bench.serve import arrivals, datasets, report
from specgate.bench.serve.metrics import RequestResult, spec_summary, summarize
from specgate.bench.serve.runner import POLICY, closed_loop, open_loop, send


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.per_category, args.max_tokens, args.concurrency, args.arms = 1, 32, "1", "policy,plain,ngram"
        args.rate = args.rate.split(",")[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server, base_url = (None, args.base_url.rstrip("/")) if args.base_url else start_local_gateway(args, out)
    try:
        return asyncio.run(_run(args, base_url, out, server is not None))
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)


def start_local_gateway(args: argparse.Namespace, out: Path) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specgate.gateway.cli.main", "serve", "--port", str(port)]
    for flag in ("model", "dtype", "threads"):
        if getattr(args, flag):
            cmd += [f"--{flag}", str(getattr(args, flag))]
    env = {**os.environ, "SPECGATE_DATA_DIR": str((out / "gateway-data").resolve())}
    log = (out / "specgate.gateway.log").open("wb")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the gateway exited; see {out / 'specgate.gateway.log'}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise RuntimeError("the gateway did not become ready in 10 minutes")


def _requests(args: argparse.Namespace) -> list[datasets.BenchRequest]:
    if args.dataset_path:
        return datasets.from_jsonl(args.dataset_path, args.max_tokens)
    return datasets.shipped(args.per_category, args.max_tokens, args.categories.split(","))


def _points(
    args: argparse.Namespace, n: int, trace: list[arrivals.TraceRequest] | None
) -> list[tuple[str, list[float] | int]]:
    """(label, offsets or concurrency) per load point."""
    if args.arrival == "closed":
        return [(f"c={c}", int(c)) for c in args.concurrency.split(",")]
    out: list[tuple[str, list[float] | int]] = []
    for rate in (float(r) for r in args.rate.split(",")):
        if trace is not None:
            out.append((f"{args.arrival}@{rate}/s", arrivals.scale_trace(trace, rate)))
        else:
            burst = 1.0 if args.arrival == "poisson" else args.burstiness
            out.append((f"{args.arrival}@{rate}/s", arrivals.gamma(rate, n, burst, seed=0)))
    return out


async def _run(args: argparse.Namespace, base_url: str, out: Path, local: bool) -> int:
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key=os.environ.get("OPENAI_API_KEY", "none"),
        max_retries=0,
        timeout=600,
    )
    model = args.model_name or (await client.models.list()).data[0].id
    reqs = _requests(args)
    trace = None
    if args.arrival.startswith("azure"):
        trace = arrivals.load_trace(args.arrival.split("-")[1], limit=len(reqs))
        reqs = datasets.match_lengths(
            reqs,
            [(t.context_tokens, t.generated_tokens) for t in trace],
            args.trace_max_context,
            args.max_tokens,
        )
    arms = args.arms.split(",")
    points = _points(args, len(reqs), trace)
    slos = {k: float(v) for k, v in (kv.split("=") for kv in args.slo.split(",") if kv)}
    run_id = uuid.uuid4().hex[:8]
    bar = tqdm(total=len(reqs) * len(arms) * len(points), desc="bench serve", unit="req")
    runs: list[dict[str, Any]] = []
    all_results: list[RequestResult] = []
    for label, point in points:
        for arm in arms:

            def make(i: int, arm: str = arm, label: str = label) -> Any:
                rid = f"{run_id}-{arm}-{label}-{i}".replace("/", "_").replace("=", "")
                return send(client, model, reqs[i], arm, rid, args.temperature)

            t0 = time.perf_counter()
            if isinstance(point, int):
                results = await closed_loop(make, len(reqs), point, bar.update)
            else:
                results = await open_loop(make, point, args.max_concurrency, bar.update)
            duration = time.perf_counter() - t0
            all_results += results
            runs.append(
                {
                    "arm": arm,
                    "point": label,
                    "summary": summarize(results, duration, slos),
                    "errors": sorted({r.error for r in results if r.error})[:5],
                    "t0": t0,
                    "results": results,
                }
            )
    bar.close()
    rep: dict[str, Any] = {
        "config": {
            "model": model,
            "base_url": base_url,
            "num_requests": len(reqs),
            "arms": arms,
            "arrivals": args.arrival
            + (f" {args.concurrency}" if args.arrival == "closed" else f" {args.rate}/s"),
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "slos_ms": slos,
            "command": "specgate bench serve "
            + shlex.join(sys.argv[3:] if sys.argv[1:3] == ["bench", "serve"] else sys.argv[1:]),
        },
        "runs": [{k: v for k, v in r.items() if k not in ("results", "t0")} for r in runs],
        "categories": by_category(
            [r for run in runs if run["point"] == runs[0]["point"] for r in run["results"]]
        ),
        "route_timeline": [
            (round(r.sent_at - run["t0"], 3), (r.route.get("spec") or {}).get("method") or "off")
            for run in runs
            if run["arm"] == POLICY
            for r in run["results"]
            if r.ok
        ],
    }
    if args.hf_baselines and local:
        from specgate.bench.serve.hf_baselines import hf_rows

        rep["hf_baselines"] = hf_rows(args, reqs)
    if local:
        rep["telemetry"] = _telemetry_check(out / "gateway-data" / "telemetry.db", run_id, len(all_results))
    report.write(rep, out, with_plots=not args.no_plots)
    sys.stdout.write(report.markdown(rep) + f"\nreport: {out / 'report.md'}\n")
    failed = sum(r["summary"]["failed"] for r in rep["runs"])
    return 1 if failed or (rep.get("telemetry") and not rep["telemetry"]["agree"]) else 0


def by_category(results: list[RequestResult]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per category and arm: mean per-request tokens/s, accepted length and rate, the route mix."""
    groups: dict[tuple[str, str], list[RequestResult]] = defaultdict(list)
    for r in results:
        if r.ok and r.e2e:
            groups[(r.category, r.arm)].append(r)
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (cat, arm), rs in groups.items():
        spec = spec_summary(rs)
        out[cat][arm] = {
            "requests": len(rs),
            "tokens_per_s": sum(r.output_tokens / r.e2e for r in rs if r.e2e) / len(rs),
            "mean_acceptance_length": spec["mean_acceptance_length"],
            "acceptance_rate": spec["acceptance_rate"],
            "route_mix": dict(Counter((r.route.get("spec") or {}).get("method") or "off" for r in rs)),
        }
    return dict(out)


def _telemetry_check(db: Path, run_id: str, sent: int) -> dict[str, Any]:
    """The gateway's own rows for this run must number exactly the requests sent."""
    import sqlite3

    rows = -1
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the writer flushes every 0.2 s
        if db.exists():
            with sqlite3.connect(db) as conn:
                rows = conn.execute(
                    "SELECT COUNT(*) FROM requests WHERE client_request_id LIKE ?", (f"{run_id}-%",)
                ).fetchone()[0]
        if rows == sent:
            break
        time.sleep(0.2)
    return {"database": str(db), "rows": rows, "sent": sent, "agree": rows == sent}
