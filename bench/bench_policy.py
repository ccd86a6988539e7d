"""The routing policy's benchmark: does learning from telemetry beat every static choice?

    python bench/bench_policy.py [--quick] [--train-per-category 6] [--eval-per-category 4]

One run, one gateway on the default model, a mixed workload (every class), prompts split into a
training set and a disjoint evaluation set:
  1. train: every training prompt under every static arm (plain, ngram, suffix), forced through
     the `spec` extension; the gateway records each as telemetry like any other request;
  2. retrain: POST /admin/policy/retrain (forced if its offline evaluation declines, and said so);
  3. evaluate: every evaluation prompt under each static arm and the learned policy, interleaved
     prompt by prompt so that drift on the machine hits every arm alike; then the rule policy
     (a rollback to version 1) on the same prompts;
  4. report goodput (output tokens per second of request time) per arm and per class, the best
     single static arm, and the per-class oracle (the best static arm of each class, measured here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve import datasets
from bench.serve.harness import start_local_gateway
from bench.serve.metrics import RequestResult
from bench.serve.runner import POLICY, send

ADMIN_KEY = "bench-policy-admin"


def split(reqs: list[datasets.BenchRequest], n_train: int) -> tuple[list, list]:
    seen: dict[str, int] = defaultdict(int)
    train, test = [], []
    for r in reqs:
        (train if seen[r.category] < n_train else test).append(r)
        seen[r.category] += 1
    return train, test


def goodput(results: list[RequestResult]) -> dict[str, float]:
    ok = [r for r in results if r.ok and r.e2e]
    tokens = sum(r.output_tokens for r in ok)
    seconds = sum(r.e2e or 0.0 for r in ok)
    return {
        "requests": len(ok),
        "failed": len(results) - len(ok),
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds else 0.0,  # request-time goodput
        "mean_request_tokens_per_s": sum(r.output_tokens / (r.e2e or 1) for r in ok) / max(1, len(ok)),
    }


async def run_phase(
    client: openai.AsyncOpenAI, model: str, reqs: list, arms: list[str], tag: str, temperature: float
) -> dict[str, list[RequestResult]]:
    """Each prompt under each arm in turn (sequential: one request in flight, batch size one)."""
    out: dict[str, list[RequestResult]] = defaultdict(list)
    run = uuid.uuid4().hex[:6]
    for i, req in enumerate(reqs):
        for arm in arms:
            res = await send(
                client, model, req, arm if arm != "learned" else POLICY, f"{tag}-{run}-{arm}-{i}", temperature
            )
            res.arm = arm
            out[arm].append(res)
        done = (i + 1) * len(arms)
        sys.stderr.write(f"\r{tag}: {done}/{len(reqs) * len(arms)} requests")
    sys.stderr.write("\n")
    return out


def admin(base: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
    r = httpx.request(
        method, f"{base}{path}", json=body, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=600
    )
    if r.status_code != 200:
        raise RuntimeError(f"{method} {path}: {r.status_code} {r.text}")
    return dict(r.json())


def report(evals: dict[str, list[RequestResult]], static: list[str]) -> dict[str, Any]:
    arms = {arm: goodput(rs) for arm, rs in evals.items()}
    classes = sorted({r.category for rs in evals.values() for r in rs})
    per_class = {
        c: {arm: goodput([r for r in rs if r.category == c]) for arm, rs in evals.items()} for c in classes
    }
    best_static = max(static, key=lambda a: arms[a]["tokens_per_s"])
    oracle_pick = {c: max(static, key=lambda a: per_class[c][a]["tokens_per_s"]) for c in classes}
    oracle = goodput([r for c in classes for r in evals[oracle_pick[c]] if r.category == c])
    learned = arms["learned"]["tokens_per_s"]
    routes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in evals["learned"]:
        routes[r.category][str(r.route.get("arm"))] += 1
    return {
        "arms": arms,
        "per_class": per_class,
        "best_static_arm": best_static,
        "oracle_pick": oracle_pick,
        "oracle": oracle,
        "learned_routes": {c: dict(v) for c, v in routes.items()},
        "ratios": {
            "learned_vs_plain": learned / arms["plain"]["tokens_per_s"],
            "learned_vs_ngram": learned / arms["ngram"]["tokens_per_s"] if "ngram" in arms else None,
            "learned_vs_best_static": learned / arms[best_static]["tokens_per_s"],
            "learned_vs_oracle": learned / oracle["tokens_per_s"],
            "rules_vs_best_static": arms["rules"]["tokens_per_s"] / arms[best_static]["tokens_per_s"],
        },
    }


def markdown(rep: dict[str, Any]) -> str:
    arms = list(rep["arms"])
    lines = [
        "| class | " + " | ".join(arms) + " | oracle pick | learned routes |",
        "|---" * (len(arms) + 3) + "|",
    ]
    for c, row in rep["per_class"].items():
        cells = " | ".join(f"{row[a]['tokens_per_s']:.2f}" for a in arms)
        routes = ", ".join(
            f"{k.split(':')[-1]} {v}" for k, v in sorted(rep["learned_routes"].get(c, {}).items())
        )
        lines.append(f"| {c} | {cells} | {rep['oracle_pick'][c]} | {routes} |")
    total = " | ".join(f"**{rep['arms'][a]['tokens_per_s']:.2f}**" for a in arms)
    lines.append(f"| all | {total} | oracle {rep['oracle']['tokens_per_s']:.2f} | |")
    lines.append("")
    lines.append("goodput = output tokens / request seconds (tok/s); ratios of the learned policy:")
    lines += [f"- {k}: {v:.3f}" for k, v in rep["ratios"].items() if v is not None]
    lines.append(f"- best static arm: {rep['best_static_arm']}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace, base: str, out: Path) -> int:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    per = args.train_per_category + args.eval_per_category
    train, test = split(datasets.shipped(per, args.max_tokens), args.train_per_category)
    static = args.arms.split(",")
    t0 = time.perf_counter()
    await run_phase(client, model, train, static, "train", args.temperature)
    n_rows = len(train) * len(static)
    admin(
        base,
        "PUT",
        "/admin/policy",
        {"min_train_rows": max(10, n_rows // 2), "min_arm_rows": 5, "note": "bench"},
    )
    retrain = admin(base, "POST", "/admin/policy/retrain", {})
    forced = not retrain["promoted"]
    if forced:
        retrain = admin(base, "POST", "/admin/policy/retrain", {"force": True})
    learned_version = retrain["version"]
    evals = dict(await run_phase(client, model, test, [*static, "learned"], "eval", args.temperature))
    admin(base, "POST", "/admin/policy/rollback/1", None)
    evals["rules"] = (await run_phase(client, model, test, [POLICY], "rules", args.temperature))[POLICY]
    for r in evals["rules"]:
        r.arm = "rules"
    rep = report(evals, static)
    rep["config"] = {
        "model": model,
        "train_requests": n_rows,
        "eval_prompts": len(test),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "static_arms": static,
        "learned_version": learned_version,
        "retrain_forced": forced,
        "retrain": {k: v for k, v in retrain.items() if k != "window"},
        "minutes": round((time.perf_counter() - t0) / 60, 1),
    }
    (out / "policy_bench.json").write_text(json.dumps(rep, indent=2, default=str))
    text = markdown(rep)
    (out / "policy_bench.md").write_text(text + "\n")
    sys.stdout.write(text + "\n")
    sys.stdout.write(
        f"retrain: promoted={not forced} ({retrain['reason']}); report: {out / 'policy_bench.md'}\n"
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-per-category", type=int, default=6)
    p.add_argument("--eval-per-category", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--arms", default="plain,ngram,suffix", help="static arms: plain or proposer names")
    p.add_argument("--model", default=None, help="embedded model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench-out/policy")
    p.add_argument("--quick", action="store_true", help="2 + 1 prompts per class, 32 tokens (a few minutes)")
    args = p.parse_args()
    if args.quick:
        args.train_per_category, args.eval_per_category, args.max_tokens = 2, 1, 32
    out = Path(args.out)
    shutil.rmtree(out / "gateway-data", ignore_errors=True)  # a fresh install: no earlier telemetry
    out.mkdir(parents=True, exist_ok=True)
    os.environ["SPECGATE_ADMIN_KEY"] = ADMIN_KEY
    os.environ["SPECGATE_POLICY__SEED"] = "0"
    server, base = start_local_gateway(args, out)
    try:
        return asyncio.run(main_async(args, base, out))
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    raise SystemExit(main())
