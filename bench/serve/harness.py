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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
from tqdm import tqdm

from specgate.bench.serve import arrivals, comparison, datasets, peer_arm, peer_server, report
from specgate.bench.serve.metrics import RequestResult, spec_summary
from specgate.bench.serve.runner import PLAIN, POLICY, Plan, measure, warm_up


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.per_category, args.max_tokens, args.concurrency, args.arms = 1, 32, "1", "policy,plain,ngram"
        args.rate = args.rate.split(",")[0]
    if args.ignore_eos is None:  # against a peer, every answer is max_tokens long on both sides
        args.ignore_eos = args.peer is not None
    if args.peer == "llama-server":  # its own run: every server up at once, arms interleaved
        from specgate.bench.serve import side_by_side

        return side_by_side.run(args, _workload(args)[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peer = peer_arm.settings(args) if args.peer else None
    reqs, trace = _workload(args)
    arms = args.arms.split(",")
    slos = {k: float(v) for k, v in (kv.split("=") for kv in args.slo.split(",") if kv)}
    plan = Plan(
        reqs,
        _points(args, len(reqs), trace),
        uuid.uuid4().hex[:8],
        args.temperature,
        args.max_concurrency,
        slos,
    )
    bar = tqdm(total=len(reqs) * (len(arms) + bool(peer)) * len(plan.points), desc="bench serve", unit="req")
    server, base_url = (None, args.base_url.rstrip("/")) if args.base_url else start_local_gateway(args, out)
    try:
        rep, runs = asyncio.run(_run(args, base_url, out, server is not None, plan, bar.update))
    finally:
        if server is not None:  # stopped before the peer starts: the two never share the machine
            server.terminate()
            server.wait(30)
    if peer is not None:
        try:
            runs += peer_arm.run(peer, plan, out, bar.update)
            rep["peer"] = {**peer, "table": comparison.table(runs)}
        except (RuntimeError, OSError) as exc:  # keep specgate's measurements: report, then fail
            rep["peer"] = {**peer, "error": str(exc)}
    bar.close()
    rep["runs"] = [{k: v for k, v in r.items() if k not in ("results", "t0")} for r in runs]
    rep["categories"] = by_category(
        [r for run in runs if run["point"] == runs[0]["point"] for r in run["results"]]
    )
    report.write(rep, out, with_plots=not args.no_plots)
    sys.stdout.write(report.markdown(rep) + f"\nreport: {out / 'report.md'}\n")
    failed = sum(r["summary"]["failed"] for r in rep["runs"])
    peer_failed = bool(rep.get("peer", {}).get("error"))
    return 1 if failed or peer_failed or (rep.get("telemetry") and not rep["telemetry"]["agree"]) else 0


def start_local_gateway(args: argparse.Namespace, out: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = peer_server.free_port()
    cmd = peer_server.gateway_command(
        port, {f: getattr(args, f) for f in ("model", "dtype", "threads", "compile")}
    )
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


def _workload(
    args: argparse.Namespace,
) -> tuple[list[datasets.BenchRequest], list[arrivals.TraceRequest] | None]:
    """The requests every arm gets, and the trace whose lengths and arrivals they follow (if any)."""
    if args.dataset_path:
        reqs = datasets.from_jsonl(args.dataset_path, args.max_tokens)
    else:
        reqs = datasets.shipped(args.per_category, args.max_tokens, args.categories.split(","))
    if not args.arrival.startswith("azure"):
        return reqs, None
    trace = arrivals.load_trace(args.arrival.split("-")[1], limit=len(reqs))
    wanted = [(t.context_tokens, t.generated_tokens) for t in trace]
    return datasets.match_lengths(reqs, wanted, args.trace_max_context, args.max_tokens), trace


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


async def _run(
    args: argparse.Namespace, base_url: str, out: Path, local: bool, plan: Plan, on_done: Callable[[], None]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """specgate's arms; the report's config and the checks that need the gateway up."""
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key=os.environ.get("OPENAI_API_KEY", "none"),
        max_retries=0,
        timeout=600,
    )
    model = args.model_name or (await client.models.list()).data[0].id
    extra = {"ignore_eos": True} if args.ignore_eos else None
    arms = args.arms.split(",")
    await warm_up(client, model, PLAIN, extra)
    runs = await measure(client, model, arms, plan, extra, on_done)
    rep: dict[str, Any] = {
        "config": {
            "model": model,
            "base_url": base_url,
            "num_requests": len(plan.reqs),
            "arms": arms,
            "arrivals": args.arrival
            + (f" {args.concurrency}" if args.arrival == "closed" else f" {args.rate}/s"),
            "max_tokens": args.max_tokens,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "slos_ms": plan.slos,
            "command": "specgate bench serve "
            + shlex.join(sys.argv[3:] if sys.argv[1:3] == ["bench", "serve"] else sys.argv[1:]),
        },
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

        rep["hf_baselines"] = hf_rows(args, list(plan.reqs))
    if local:
        sent = sum(len(run["results"]) for run in runs)
        rep["telemetry"] = _telemetry_check(out / "gateway-data" / "telemetry.db", plan.run_id, sent)
    return rep, runs


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
