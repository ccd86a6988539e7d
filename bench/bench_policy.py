"""The routing policy under production-like traffic: does it beat every static choice, with confidence?

    python bench/bench_policy.py [--quick] [--reps 3] [--arms plain,ngram,suffix,eagle]

One run on the default model, in four phases:
  1. A classifier for this run, retrained without the evaluation prompts: every group (source item
     and its rephrasings) of the classifier's dataset holding an evaluation prompt is left out, so
     the policy classifies prompts it never saw (the report names them).
  2. Training traffic: the training prompts at a light and a heavy load point, on a fresh gateway
     whose telemetry samples every verification step, routed by the rule policy exploring most of
     its traffic (--train-exploration), so every arm is covered and every decision's propensity is
     logged. Then POST /admin/policy/retrain: the gateway fits the goodput model and the step cost
     curve, and decides by its off-policy estimate whether to promote (a declined candidate is
     forced, and the report says so); exploration goes back to its defaults (5%, cap 10%).
  3. Evaluation: each arm on a fresh gateway process over a copy of that telemetry database (no
     arm sees another's answers or suffix caches), the arms in a rotated order in each of --reps
     repetitions. Arms: each static arm (forced with the `spec` extension), `rules` (the fresh
     install's rule policy, version 1: the constant batch guard) and `learned` (the retrained
     policy). The traffic: held-out prompts of every class, a share of them second turns of a
     conversation, a share sampled at temperature 0.7-1.0; a light point (one request at a time)
     and a heavy one (the Azure conversation trace's bursty arrivals, squeezed to --heavy-rate
     requests/s, at most --heavy-concurrency in flight): the batch from 1 to past where
     speculation stops paying on this machine.
  4. Report: goodput per request (output tokens / end-to-end seconds, queueing included) per arm
     and load point, with a 95% interval over the repetitions; the per-class oracle (the best
     static arm of each class and load point, measured here); and request by request, paired,
     the learned policy minus the best static arm, minus the oracle, and under heavy load minus
     `plain`, with 95% intervals. Last, the issue's goals with PASS or MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import openai

from specgate.bench.serve import arrivals, datasets
from specgate.bench.serve.harness import start_local_gateway
from specgate.bench.serve.metrics import RequestResult
from specgate.bench.serve.runner import POLICY, closed_loop, open_loop, send

ADMIN_KEY = "bench-policy-admin"
# Routed by the gateway's policy, not forced. `learned_greedy` is the same retrained policy with
# `deviation_z` 0: it leaves the rules' arm wherever the model predicts better, sure or not.
POLICY_ARMS = ("rules", "learned", "learned_greedy")
FOLLOW_UP = "Thanks. Now go one step further and be more specific."
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
Item = tuple[datasets.BenchRequest, float]  # a request and its temperature


def workload(args: argparse.Namespace) -> dict[str, list[Item]]:
    """Train, light and heavy requests: disjoint prompts, every class in each, seeded."""
    sizes = {"train": args.train_per_class, "light": args.light_per_class, "heavy": args.heavy_per_class}
    reqs = datasets.shipped(sum(sizes.values()), args.max_tokens)
    rng = random.Random(0)
    seen: dict[str, int] = defaultdict(int)
    out: dict[str, list[Item]] = {k: [] for k in sizes}
    for req in reqs:
        i = seen[req.category]
        seen[req.category] += 1
        part = "train" if i < sizes["train"] else "light" if i < sizes["train"] + sizes["light"] else "heavy"
        if not req.tools and rng.random() < args.multi_turn_share:
            answer = "Here is a first answer; ask if you want more detail."
            req.messages = [*req.messages, {"role": "assistant", "content": answer}, _user(FOLLOW_UP)]
        temperature = rng.uniform(0.7, 1.0) if rng.random() < args.sampled_share else 0.0
        out[part].append((req, temperature))
    return out


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def held_out_classifier(evaluation: list[Item], out: Path) -> tuple[Path, dict[str, Any]]:
    """A classifier trained without any dataset group that holds an evaluation prompt."""
    from specgate.policies.training import dataset
    from specgate.policies.training.classifier import train_and_save

    texts = [str(m["content"]) for r, _ in evaluation for m in r.messages if m["role"] == "user"]
    keys = [t.strip()[:200] for t in texts if t.strip() and t != FOLLOW_UP]
    rows = dataset.load()
    dropped = {r["group"] for r in rows if any(_same(k, r["text"]) for k in keys)}
    kept = [r for r in rows if r["group"] not in dropped]
    path = out / "classifier_heldout.npz"
    ev = train_and_save(kept, path)
    info = {"groups_left_out": len(dropped), "rows": len(kept), "heldout_accuracy": round(ev.accuracy, 4)}
    return path, info


def _same(key: str, text: str) -> bool:
    """Whether a dataset row is (part of) an evaluation prompt or holds one."""
    head = text.strip()[:200]
    return key in text or (len(head) >= 20 and head in key)


class Gateway:
    """`specgate serve` on the default model over a copy of a telemetry directory (or a new one)."""

    def __init__(self, args: argparse.Namespace, run_dir: Path, data: Path | None, env: dict[str, str]):
        run_dir.mkdir(parents=True, exist_ok=True)
        if data is not None:
            shutil.copytree(data, run_dir / "gateway-data", dirs_exist_ok=True)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self.server, self.url = start_local_gateway(args, run_dir)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def admin(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        r = httpx.request(method, f"{self.url}{path}", json=body, headers=headers, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text}")
        return dict(r.json())

    def stop(self) -> None:
        self.server.terminate()
        self.server.wait(60)


async def load_point(
    url: str, items: list[Item], arms: list[str], point: str, args: argparse.Namespace
) -> list[RequestResult]:
    """`items` at one load point, item i under arms[i]."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    run = uuid.uuid4().hex[:6]

    async def one(i: int) -> RequestResult:
        req, temperature = items[i]
        arm = POLICY if arms[i] in POLICY_ARMS else arms[i]
        res = await send(client, model, req, arm, f"{point}-{run}-{i}", temperature)
        res.arm = arms[i]
        return res

    def done() -> None:
        pass

    if point == "light":
        results = await closed_loop(one, len(items), 1, done)
    else:
        trace = arrivals.load_trace("conv", limit=len(items))
        offsets = arrivals.scale_trace(trace, args.heavy_rate)
        results = await open_loop(one, offsets, args.heavy_concurrency, done)
    await client.close()
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed at {point}: {failed[:3]}")
    return results


def goodput(r: RequestResult) -> float:
    return r.output_tokens / r.e2e if r.e2e else 0.0


def interval(values: list[float], t: float = 1.96) -> dict[str, float]:
    mean = statistics.fmean(values)
    half = t * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("inf")
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(values)}


def analyse(
    res: dict[str, list[list[RequestResult]]], items: dict[str, list[Item]], static: list[str]
) -> dict[str, Any]:
    """res[arm][rep]: results in item order, light then heavy."""
    points = ["light"] * len(items["light"]) + ["heavy"] * len(items["heavy"])
    classes = [r.category for r, _ in items["light"] + items["heavy"]]
    reps = len(next(iter(res.values())))
    g = {arm: [[goodput(r) for r in rr] for rr in runs] for arm, runs in res.items()}  # [arm][rep][i]

    def arm_ci(arm: str, mask: list[bool]) -> dict[str, float]:
        per_rep = [
            statistics.fmean(x for x, m in zip(g[arm][k], mask, strict=True) if m) for k in range(reps)
        ]
        return interval(per_rep, T95.get(reps - 1, 1.96))

    masks = {
        "all": [True] * len(points),
        "light": [p == "light" for p in points],
        "heavy": [p == "heavy" for p in points],
    }
    table = {arm: {name: arm_ci(arm, m) for name, m in masks.items()} for arm in res}
    best_static = max(static, key=lambda a: table[a]["all"]["mean"])
    # The per-class oracle: per class and load point, the static arm with the best mean goodput.
    oracle_pick: dict[tuple[str, str], str] = {}
    for c, p in set(zip(classes, points, strict=True)):
        idx = [i for i in range(len(points)) if classes[i] == c and points[i] == p]
        oracle_pick[(c, p)] = max(
            static, key=lambda a: statistics.fmean(g[a][k][i] for k in range(reps) for i in idx)
        )
    oracle = [
        [g[oracle_pick[(classes[i], points[i])]][k][i] for i in range(len(points))] for k in range(reps)
    ]

    def paired(
        a: list[list[float]], b: list[list[float]], mask: list[bool], relative: bool = False
    ) -> dict[str, float]:
        diffs = [a[k][i] - b[k][i] for k in range(reps) for i in range(len(points)) if mask[i]]
        base = statistics.fmean(b[k][i] for k in range(reps) for i in range(len(points)) if mask[i])
        ci = interval(diffs)
        return {k: v / base if relative and k != "n" else v for k, v in ci.items()} if relative else ci

    learned = g["learned"]
    return {
        "table": table,
        "best_static": best_static,
        "oracle_pick": {f"{c}@{p}": a for (c, p), a in sorted(oracle_pick.items())},
        "oracle": {
            name: statistics.fmean(oracle[k][i] for k in range(reps) for i in range(len(points)) if m[i])
            for name, m in masks.items()
        },
        "learned_minus_best_static": paired(learned, g[best_static], masks["all"], relative=True),
        "learned_minus_oracle": paired(learned, oracle, masks["all"], relative=True),
        "heavy_learned_minus_plain": paired(learned, g["plain"], masks["heavy"], relative=True),
        "rules_minus_best_static": paired(g["rules"], g[best_static], masks["all"], relative=True),
        "learned_minus_learned_greedy": paired(learned, g["learned_greedy"], masks["all"], relative=True),
        "learned_routes": _routes(res["learned"], points),
        "learned_greedy_routes": _routes(res["learned_greedy"], points),
    }


def _routes(runs: list[list[RequestResult]], points: list[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for rr in runs:
        for r, p in zip(rr, points, strict=True):
            out[f"{r.category}@{p}"][str(r.route.get("arm", "?")).split(":")[-1]] += 1
    return {k: dict(v) for k, v in sorted(out.items())}


def markdown(rep: dict[str, Any], arms: list[str]) -> str:
    lines = ["| arm | all | light | heavy |", "|---|---|---|---|"]
    for arm in arms:
        row = rep["table"][arm]
        cells = [
            f"{row[p]['mean']:.2f} [{row[p]['low']:.2f}, {row[p]['high']:.2f}]"
            for p in ("all", "light", "heavy")
        ]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    o = rep["oracle"]
    lines.append(f"| per-class oracle | {o['all']:.2f} | {o['light']:.2f} | {o['heavy']:.2f} |")
    lines.append("")
    lines.append("goodput per request, tok/s (mean over repetitions, [95% interval]); paired differences:")
    for key in (
        "learned_minus_best_static",
        "learned_minus_oracle",
        "heavy_learned_minus_plain",
        "rules_minus_best_static",
        "learned_minus_learned_greedy",
    ):
        d = rep[key]
        lines.append(
            f"- {key}: {d['mean']:+.1%} [{d['low']:+.1%}, {d['high']:+.1%}] over {d['n']} request pairs"
        )
    lines.append(f"- best static arm: {rep['best_static']}")
    goals = [
        (
            "learned >= 1.10x the best static arm, interval above zero",
            rep["learned_minus_best_static"]["mean"] >= 0.10 and rep["learned_minus_best_static"]["low"] > 0,
        ),
        ("learned within 5% of the per-class oracle", rep["learned_minus_oracle"]["mean"] >= -0.05),
        (
            "heavy load: interval of learned - plain above -3%",
            rep["heavy_learned_minus_plain"]["low"] > -0.03,
        ),
    ]
    lines += [f"{'PASS' if ok else 'MISS'}: {name}" for name, ok in goals]
    return "\n".join(lines)


def run(args: argparse.Namespace, out: Path) -> int:
    t0 = time.perf_counter()
    items = workload(args)
    evaluation = items["light"] + items["heavy"]
    clf, clf_info = held_out_classifier(evaluation, out)
    static = args.arms.split(",")
    env = {
        "SPECGATE_ADMIN_KEY": ADMIN_KEY,
        "SPECGATE_POLICY__SEED": "0",
        "SPECGATE_POLICY__CLASSIFIER_PATH": str(clf),
        "SPECGATE_TELEMETRY__SPEC_STEPS_SAMPLE_RATE": "1.0",
    }
    # 2. Training traffic, routed by the rule policy exploring heavily (the gateway logs each
    # decision's propensity), then the gateway's own retrain, then exploration back to normal.
    train = items["train"]
    half = len(train) // 2
    policy_arms = ["learned"] * len(train)  # unforced: the gateway's policy routes them
    gw = Gateway(args, out / "train", None, env)
    try:
        explore = {"exploration_rate": args.train_exploration, "exploration_cap": 1.0}
        bounds = {"min_train_rows": max(10, len(train) // 2), "min_arm_rows": 5}
        gw.admin("PUT", "/admin/policy", {**explore, **bounds, "note": "bench: training traffic"})
        asyncio.run(load_point(gw.url, train[:half], policy_arms[:half], "light", args))
        asyncio.run(load_point(gw.url, train[half:], policy_arms[half:], "heavy", args))
        retrain = gw.admin("POST", "/admin/policy/retrain", {})
        if not retrain["promoted"]:
            declined = retrain["reason"]
            retrain = {**gw.admin("POST", "/admin/policy/retrain", {"force": True}), "declined": declined}
        normal = {
            "exploration_rate": 0.05,
            "exploration_cap": 0.1,
            "note": "bench: exploration back to normal",
        }
        gw.admin("PUT", "/admin/policy", normal)
        policy = gw.admin("GET", "/admin/policy")
    finally:
        gw.stop()
    trained = out / "train" / "gateway-data"
    # 3. Evaluation: a fresh process per arm and repetition, arms rotated between repetitions.
    arms = [*static, *POLICY_ARMS]
    res: dict[str, list[list[RequestResult]]] = {a: [] for a in arms}
    for rep in range(args.reps):
        for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
            run_dir = out / f"eval-{rep}-{arm}"
            gw = Gateway(
                args, run_dir, trained, {**env, "SPECGATE_TELEMETRY__SPEC_STEPS_SAMPLE_RATE": "0.05"}
            )
            try:
                if arm == "rules":
                    gw.admin("POST", "/admin/policy/rollback/1")
                elif arm == "learned_greedy":
                    gw.admin("PUT", "/admin/policy", {"deviation_z": 0.0, "note": "bench: no margin"})
                light = asyncio.run(
                    load_point(gw.url, items["light"], [arm] * len(items["light"]), "light", args)
                )
                heavy = asyncio.run(
                    load_point(gw.url, items["heavy"], [arm] * len(items["heavy"]), "heavy", args)
                )
            finally:
                gw.stop()
                shutil.rmtree(run_dir / "gateway-data", ignore_errors=True)
            res[arm].append(light + heavy)
            sys.stderr.write(
                f"rep {rep + 1}/{args.reps} {arm}: done at {(time.perf_counter() - t0) / 60:.1f} min\n"
            )
    rep_ = analyse(res, items, static)
    rep_["config"] = {
        **{k: v for k, v in vars(args).items() if k != "out"},
        "classifier": clf_info,
        "retrain": {k: retrain.get(k) for k in ("version", "promoted", "reason", "declined", "off_policy")},
        "step_cost": policy.get("step_cost"),
        "minutes": round((time.perf_counter() - t0) / 60, 1),
    }
    (out / "policy_bench.json").write_text(json.dumps(rep_, indent=2, default=str))
    text = markdown(rep_, arms)
    (out / "policy_bench.md").write_text(text + "\n")
    how = f"declined ({retrain['declined']}), then forced" if "declined" in retrain else "promoted"
    sys.stdout.write(f"{text}\nclassifier: {clf_info}\nretrain: {how}: {retrain.get('reason')}\n")
    sys.stdout.write(f"crossover: {(policy.get('step_cost') or {}).get('crossover_batch')}\n")
    sys.stdout.write(f"{rep_['config']['minutes']} min; report: {out / 'policy_bench.md'}\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-per-class", type=int, default=8)
    p.add_argument("--light-per-class", type=int, default=2)
    p.add_argument("--heavy-per-class", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--sampled-share", type=float, default=0.3, help="requests at temperature 0.7-1.0")
    p.add_argument("--multi-turn-share", type=float, default=0.25, help="requests that are a second turn")
    p.add_argument("--heavy-rate", type=float, default=4.0, help="requests/s of the heavy point's trace")
    p.add_argument(
        "--heavy-concurrency", type=int, default=24, help="most requests in flight at the heavy point"
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--train-exploration", type=float, default=0.75, help="training traffic's exploration rate"
    )
    p.add_argument("--arms", default="plain,ngram,suffix,eagle", help="static arms: plain or proposer names")
    p.add_argument("--model", default=None, help="embedded model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", default=None)
    p.add_argument("--out", default="bench-out/policy")
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: 4 + 1 + 1 prompts per class, 32 tokens, 1 rep"
    )
    args = p.parse_args()
    if args.quick:
        args.train_per_class, args.light_per_class, args.heavy_per_class = 4, 1, 1
        args.max_tokens, args.reps = 32, 1
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    return run(args, out)


if __name__ == "__main__":
    raise SystemExit(main())
