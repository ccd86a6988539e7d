"""The routing policy's benchmark: does learning from telemetry beat every static choice?

    python bench/bench_policy.py [--quick] [--train-per-category 6] [--eval-per-category 4]

One run, one gateway on the default model, a mixed workload (every class), prompts split into a
training set and a disjoint evaluation set:
  1. train: every training prompt once, under one of the static arms (plain, ngram, suffix) in
     rotation, forced through the `spec` extension; the gateway records each as telemetry;
  2. retrain: POST /admin/policy/retrain (forced if its offline evaluation declines, and said so);
  3. evaluate: every evaluation prompt under the learned policy, each static arm, and the rule
     policy (a rollback to version 1);
  Each pass runs on a fresh gateway process over the same telemetry database (the learned policy
  warm-starts from it), so no arm sees another arm's answers to the same prompts;
  4. report goodput (output tokens per second of request time) per arm and per class, the best
     single static arm, and the per-class oracle (the best static arm of each class, measured here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import openai

from specgate.bench.serve import datasets
from specgate.bench.serve.harness import start_local_gateway
from specgate.bench.serve.metrics import RequestResult
from specgate.bench.serve.runner import POLICY, send

ADMIN_KEY = "bench-policy-admin"
LEARNED_ARMS = ("learned", "rules")  # routed by the gateway's policy, not forced


def split(
    reqs: list[datasets.BenchRequest], n_train: int
) -> tuple[list[datasets.BenchRequest], list[datasets.BenchRequest]]:
    seen: dict[str, int] = defaultdict(int)
    train: list[datasets.BenchRequest] = []
    test: list[datasets.BenchRequest] = []
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


async def run_pass(
    base: str, reqs: list, arms: str | list[str], tag: str, temperature: float | list[float]
) -> list[RequestResult]:
    """Every prompt once, sequentially (one request in flight, batch size one), under `arms` (one
    arm, or one per prompt)."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    run = uuid.uuid4().hex[:6]
    out = []
    for i, req in enumerate(reqs):
        arm = arms if isinstance(arms, str) else arms[i]
        forced = POLICY if arm in LEARNED_ARMS else arm
        temp = temperature if isinstance(temperature, float) else temperature[i]
        res = await send(client, model, req, forced, f"{tag}-{run}-{arm}-{i}", temp)
        res.arm = arm
        out.append(res)
        sys.stderr.write(f"\r{tag}: {i + 1}/{len(reqs)} requests")
    sys.stderr.write("\n")
    await client.close()
    return out


def rotate(reqs: list[datasets.BenchRequest], arms: list[str]) -> list[str]:
    """One arm per prompt, rotating within each class, so every class sees every arm and the arms
    interleave in time (as exploration interleaves them in production)."""
    seen: dict[str, int] = defaultdict(int)
    classes = sorted({r.category for r in reqs})
    out = []
    for r in reqs:
        out.append(arms[(seen[r.category] + classes.index(r.category)) % len(arms)])
        seen[r.category] += 1
    return out


def on_fresh_gateway(args: argparse.Namespace, out: Path, work: Any) -> Any:
    """Run `work(base_url)` on a newly started gateway process over the same telemetry database.

    A fresh process per pass: the suffix proposer's shared cache of recent outputs would otherwise
    hand later arms the very answers earlier arms produced for the same prompt.
    """
    server, base = start_local_gateway(args, out)
    try:
        return asyncio.run(work(base))
    finally:
        server.terminate()
        server.wait(30)


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


def run_all(args: argparse.Namespace, out: Path) -> int:
    per = args.train_per_category + args.eval_per_category
    train, test = split(datasets.shipped(per, args.max_tokens), args.train_per_category)
    static = args.arms.split(",")

    def temps(reqs: list) -> list[float]:
        """Per request: the base temperature, or for a seeded `--hot-share` of them the hot one."""
        rng = random.Random(len(reqs))
        return [args.hot_temperature if rng.random() < args.hot_share else args.temperature for _ in reqs]

    t0 = time.perf_counter()
    # Training: each prompt once, under one arm (a prompt answered twice would let the suffix
    # proposer's shared cache replay the first answer to the second arm).
    arms_of = rotate(train, static)
    on_fresh_gateway(args, out, lambda base: run_pass(base, train, arms_of, "train", temps(train)))
    n_rows = len(train)
    retrain: dict[str, Any] = {}
    evals: dict[str, list[RequestResult]] = {}

    async def learned(base: str) -> list[RequestResult]:
        patch = {"min_train_rows": max(10, n_rows // 2), "min_arm_rows": 5, "note": "bench"}
        admin(base, "PUT", "/admin/policy", patch)
        retrain.update(admin(base, "POST", "/admin/policy/retrain", {}))
        if not retrain["promoted"]:
            retrain.update(
                admin(base, "POST", "/admin/policy/retrain", {"force": True}), declined=retrain["reason"]
            )
        return await run_pass(base, test, "learned", "eval", temps(test))

    async def rules(base: str) -> list[RequestResult]:
        admin(base, "POST", "/admin/policy/rollback/1", None)
        return await run_pass(base, test, "rules", "eval", temps(test))

    evals["learned"] = on_fresh_gateway(args, out, learned)
    for arm in static:
        evals[arm] = on_fresh_gateway(
            args, out, lambda base, arm=arm: run_pass(base, test, arm, "eval", temps(test))
        )
    evals["rules"] = on_fresh_gateway(args, out, rules)
    evals = {a: evals[a] for a in [*static, "learned", "rules"]}
    rep = report(evals, static)
    rep["config"] = {
        "train_requests": n_rows,
        "eval_prompts": len(test),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "hot_share": args.hot_share,
        "static_arms": static,
        "learned_version": retrain.get("version"),
        "retrain_forced": "declined" in retrain,
        "retrain": {k: v for k, v in retrain.items() if k != "window"},
        "minutes": round((time.perf_counter() - t0) / 60, 1),
    }
    (out / "policy_bench.json").write_text(json.dumps(rep, indent=2, default=str))
    text = markdown(rep)
    (out / "policy_bench.md").write_text(text + "\n")
    sys.stdout.write(text + "\n")
    how = f"declined ({retrain['declined']}), then forced" if "declined" in retrain else "promoted"
    sys.stdout.write(f"retrain: {how}: {retrain.get('reason')}\nreport: {out / 'policy_bench.md'}\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-per-category", type=int, default=12)
    p.add_argument("--eval-per-category", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--hot-share", type=float, default=0.0, help="share of requests sampled at --hot-temperature instead"
    )
    p.add_argument("--hot-temperature", type=float, default=1.0)
    p.add_argument("--arms", default="plain,ngram,suffix", help="static arms: plain or proposer names")
    p.add_argument("--model", default=None, help="embedded model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench-out/policy")
    p.add_argument("--quick", action="store_true", help="6 + 1 prompts per class, 32 tokens (a few minutes)")
    args = p.parse_args()
    if args.quick:
        args.train_per_category, args.eval_per_category, args.max_tokens = 6, 1, 32
    out = Path(args.out)
    shutil.rmtree(out / "gateway-data", ignore_errors=True)  # a fresh install: no earlier telemetry
    out.mkdir(parents=True, exist_ok=True)
    os.environ["SPECGATE_ADMIN_KEY"] = ADMIN_KEY
    os.environ["SPECGATE_POLICY__SEED"] = "0"
    return run_all(args, out)


if __name__ == "__main__":
    raise SystemExit(main())
