"""`specgate bench serve`: every arm at every load point over the same requests, through a live gateway
(one it starts, or --base-url), reported as vLLM's `bench serve` reports: TTFT, TPOT, ITL and
end-to-end latency, request and output throughput, goodput under --slo; per category tokens/s,
accepted length, acceptance rate and route mix; report.json and report.md in --out.
(bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specgate.bench import launch, workload
from specgate.bench.client import PLAIN, POLICY, OnDone, RequestResult, closed_loop, send, warm_up
from specgate.bench.stats import distribution, number, table
from specgate.bench.workload import BenchRequest


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="a running gateway (default: start one here)")
    launch.options(p, model=None, dtype=None, threads=None, compile=None, max_tokens=128, out="bench-out")
    p.add_argument("--model-name", default=None, help="model to request (default: the first /v1/models)")
    p.add_argument("--categories", default=",".join(workload.CATEGORIES))
    p.add_argument("--dataset-path", default=None, help="JSONL of prompts instead of the shipped categories")
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="--peer, --temperature > 0: prompt i's is SEED+i")
    p.add_argument("--arms", default="policy,plain,ngram,suffix", help="policy, plain, a method, METHOD:kN")
    p.add_argument("--concurrency", default="1,4", help="load points: requests in flight (with --peer: 1, N)")
    p.add_argument("--slo", default="", help="goodput SLOs in ms, e.g. ttft=1000,tpot=100")
    peers = ["llama-server", "llama-cpp"]
    p.add_argument("--peer", choices=peers, help="llama.cpp on the same GGUF beside the arms, interleaved")
    p.add_argument("--peer-n-ctx", type=int, default=4096, help="the peer's context size (at least)")
    p.add_argument("--llama-server", default=None, metavar="PATH", help=f"default ${launch.LLAMA_SERVER_ENV}")
    flags = "llama-server's speculating arm, written with '=' (default %(default)s; empty: no such arm)"
    p.add_argument("--peer-spec", default=launch.SPEC_DEFAULT, metavar="FLAGS", help=flags)
    p.add_argument("--requests-in-flight", type=int, metavar="N", help="--peer: requests a phase")
    eos = "decode exactly max_tokens in every answer (default: on with --peer, off without)"
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, help=eos)
    p.add_argument("--quick", action="store_true", help="about a minute: 1 prompt a category, short answers")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.per_category, args.max_tokens, args.concurrency, args.arms = 1, 32, "1", "policy,plain,ngram"
    if args.ignore_eos is None:  # against a peer, every answer is max_tokens long on both sides
        args.ignore_eos = args.peer is not None
    if args.dataset_path:
        reqs = workload.from_jsonl(args.dataset_path, args.max_tokens)
    else:
        reqs = workload.shipped(args.per_category, args.max_tokens, args.categories.split(","))
    if args.peer:
        from specgate.bench import interleaved

        return interleaved.run_peers(args, reqs)
    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:8]
    data = out / "gateway-data"
    gateway = launch.specgate(out / "specgate.gateway.log", launch.serve_options(args), data=data)
    points = [int(c) for c in args.concurrency.split(",")]
    n = len(reqs) * len(args.arms.split(",")) * len(points)
    with (
        tqdm(total=n, desc="bench serve", unit="req") as bar,
        contextlib.nullcontext() if args.base_url else gateway as server,
    ):
        url = args.base_url.rstrip("/") if server is None else server.url
        rep, runs = asyncio.run(_measure(args, url, reqs, points, run_id, bar.update))
        if server is not None:  # the gateway's own rows for this run must number the requests sent
            sent = sum(len(run["results"]) for run in runs)
            db = f"sqlite:///{data / 'telemetry.db'}"
            rows = len(launch.request_ids(db, f"{run_id}-", sent, timeout=15))
            rep["telemetry"] = {"database": db, "rows": rows, "sent": sent, "agree": rows == sent}
    rep["runs"] = [{k: v for k, v in r.items() if k != "results"} for r in runs]
    rep["categories"] = by_category([r for x in runs if x["point"] == runs[0]["point"] for r in x["results"]])
    (out / "report.json").write_text(json.dumps(rep, indent=2, default=str))
    (out / "report.md").write_text(markdown(rep))
    sys.stdout.write(markdown(rep) + f"\nreport: {out / 'report.md'}\n")
    failed = sum(r["summary"]["failed"] for r in rep["runs"])
    return 1 if failed or (rep.get("telemetry") and not rep["telemetry"]["agree"]) else 0


async def _measure(
    args: argparse.Namespace, url: str, reqs: list[BenchRequest], points: list[int], run_id: str, done: OnDone
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every arm at every load point (each with a prefix cache of its own), and the report's config."""
    import openai

    key = os.environ.get("OPENAI_API_KEY", "none")
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
    model = args.model_name or (await client.models.list()).data[0].id
    extra = {"ignore_eos": True} if args.ignore_eos else None
    slos = {k: float(v) for k, v in (kv.split("=") for kv in args.slo.split(",") if kv)}
    await warm_up(client, model, PLAIN, extra)
    runs: list[dict[str, Any]] = []
    for point in points:
        for arm in args.arms.split(","):
            tag = f"{run_id}-{arm}-c{point}"

            def make(i: int, arm: str = arm, tag: str = tag) -> Any:
                return send(client, model, reqs[i], arm, f"{tag}-{i}", args.temperature, extra, tag)

            t0 = time.perf_counter()
            results = await closed_loop(make, len(reqs), point, done)
            summary = summarize(results, time.perf_counter() - t0, slos)
            errors = sorted({r.error for r in results if r.error})[:5]
            runs.append({"arm": arm, "point": f"c={point}", "summary": summary, "errors": errors})
            runs[-1]["results"] = results
    await client.close()
    config = {"model": model, "base_url": url, "num_requests": len(reqs), "arms": args.arms.split(",")}
    config |= {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    config |= {"temperature": args.temperature, "slos_ms": slos, "command": launch.command_line()}
    return {"config": config}, runs


def summarize(
    results: Sequence[RequestResult], duration: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """One arm's results at one load point. `slos` in ms: {"ttft": 500, "tpot": 50, "e2e": 10000}."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if meets(r, slos or {})]
    rate = 1 / duration if duration > 0 else None
    out: dict[str, Any] = {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok)}
    out |= {"duration_s": duration, "request_throughput": len(ok) * rate if rate else None}
    out |= {"output_throughput": out_tokens * rate if rate else None, "total_output_tokens": out_tokens}
    out["total_prompt_tokens"] = sum(r.prompt_tokens for r in ok)
    out["goodput"] = len(good) * rate if rate and slos else None
    out |= {"ttft_ms": distribution(r.ttft for r in ok), "tpot_ms": distribution(r.tpot for r in ok)}
    out |= {"itl_ms": distribution(x for r in ok for x in r.itls), "e2e_ms": distribution(r.e2e for r in ok)}
    return {**out, "spec": spec_summary(ok)}


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    """Within every SLO; a one-token answer has no TPOT to miss."""
    values = {name: getattr(r, name) for name in slos}
    return all(v * 1e3 <= slos[k] if v is not None else k == "tpot" for k, v in values.items())


def spec_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Mean accepted length and acceptance rate over the requests that speculated, per position too."""
    steps = drafted = accepted = 0
    by_pos: list[int] = []
    for r in results:
        steps += r.spec.get("num_drafts") or 0
        drafted += r.spec.get("num_draft_tokens") or 0
        accepted += r.spec.get("num_accepted_tokens") or 0
        for i, c in enumerate(r.spec.get("num_accepted_tokens_per_pos") or []):
            by_pos += [0] * (i + 1 - len(by_pos))
            by_pos[i] += c
    out: dict[str, Any] = {"num_drafts": steps, "draft_tokens": drafted, "accepted_tokens": accepted}
    out["mean_acceptance_length"] = (accepted + steps) / steps if steps else None
    out["acceptance_rate"] = accepted / drafted if drafted else None
    # Share of verification steps whose i-th draft token was accepted.
    return {**out, "acceptance_by_position": [c / steps for c in by_pos] if steps else []}


def by_category(results: list[RequestResult]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per category and arm: mean per-request tokens/s, accepted length and rate, the route mix."""
    groups: dict[tuple[str, str], list[RequestResult]] = defaultdict(list)
    for r in results:
        if r.ok and r.e2e:
            groups[(r.category, r.arm)].append(r)
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (cat, arm), rs in groups.items():
        spec = spec_summary(rs)
        routes = Counter((r.route.get("spec") or {}).get("method") or "off" for r in rs)
        out[cat][arm] = {"requests": len(rs), "tokens_per_s": sum(r.goodput for r in rs) / len(rs)}
        out[cat][arm] |= {k: spec[k] for k in ("mean_acceptance_length", "acceptance_rate")}
        out[cat][arm]["route_mix"] = dict(routes)
    return dict(out)


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        "# specgate bench serve",
        "",
        f"Model `{cfg['model']}` at {cfg['base_url']}; {cfg['num_requests']} requests per arm; in flight: "
        f"{cfg['concurrency']}; max_tokens {cfg['max_tokens']}; temperature {cfg['temperature']}.",
        f"Command: `{cfg['command']}`",
        "",
        "## Arms",
        "",
    ]
    head = ["arm", "point", "done", "req/s", "out tok/s", "goodput", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms"]
    head += ["ITL p50 ms", "E2E p50 / p99 ms", "accepted len", "accept rate"]
    rows = []
    for run in report["runs"]:
        s = run["summary"]
        t, p, e, sp = s["ttft_ms"], s["tpot_ms"], s["e2e_ms"], s["spec"]
        row = [run["arm"], run["point"], f"{s['completed']}/{s['requests']}"]
        row += [number(s["request_throughput"], 2), number(s["output_throughput"]), number(s["goodput"], 2)]
        row += [f"{number(t['p50'])} / {number(t['p99'])}", f"{number(p['p50'])} / {number(p['p99'])}"]
        row += [number(s["itl_ms"]["p50"]), f"{number(e['p50'], 0)} / {number(e['p99'], 0)}"]
        rows.append([*row, number(sp["mean_acceptance_length"], 2), number(sp["acceptance_rate"], 2)])
    lines += table(head, rows)
    cats = report.get("categories") or {}
    arms = sorted({a for per in cats.values() for a in per})
    if cats:
        lines += ["", "## Per category (tokens/s per request; ratio to plain; accepted length / rate)", ""]
    rows = []
    for cat, per in cats.items():
        base = (per.get(PLAIN) or {}).get("tokens_per_s")
        cells = []
        for c in (per.get(a) or {} for a in arms):
            tps, acc, rate = c.get("tokens_per_s"), c.get("mean_acceptance_length"), c.get("acceptance_rate")
            ratio = f" ({tps / base:.2f}x)" if tps and base else ""
            spec = f", len {acc:.2f} / {rate:.0%}" if acc and rate is not None else ""
            cells.append(f"{number(tps)}{ratio}{spec}")
        mix = (per.get(POLICY) or {}).get("route_mix") or {}
        rows.append([cat, *cells, ", ".join(f"{k} {v}" for k, v in mix.items())])
    lines += table(["category", *arms, "route mix (policy arm)"], rows) if cats else []
    if tel := report.get("telemetry"):
        agree = "agree" if tel["agree"] else "DISAGREE"
        lines += ["", f"Telemetry cross-check: {tel['rows']} rows for {tel['sent']} requests sent ({agree})."]
    return "\n".join([*lines, ""])
