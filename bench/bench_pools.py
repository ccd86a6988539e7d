"""External pools as routing arms: a learned policy across a speculative and a plain pool, and
prefix-aware replica choice, each against its alternatives side by side in one run.

    python bench/bench_pools.py [--part pools|prefix|both] [--time-scale 1.0] [--out FILE.json]
        [--max-tokens 64] [--light 2] [--heavy 24] [--light-batches 3] [--heavy-batches 2]
        [--train-levels 2,12,32] [--train-per-level 60,72,96] [--train-exploration 0.5]
        [--families 12] [--questions 8] [--prefix-concurrency 6] [--replica-cache-blocks 512]
        [--affinity KEY=VALUE] [--no-scrape] [--no-split] [--keep]

Every server is a scripted-cost stub (bench/stub_pool.py: it sleeps as a batching server would,
speculation paying on copyable prompts at a small batch and losing at a large one), each in its own
process, behind `specgate serve` processes (embedded engine off). Arms run one after another on the
same machine, batch by batch with the same prompts, in a rotated order; ratios are paired by prompt.

1. Two pools. Stubs `spec` (speculative, `speculative = "ngram"` in the gateway's config) and
   `plain` (`speculative = "off"`) serve one model, without prefix caches (this part is about
   speculation and load, not cache hits), behind one gateway (telemetry in a temporary SQLite
   file, policy on) that serves every arm, so that all of them pay the same gateway: `learned`
   asks for the model both pools serve (the policy picks the pool); `spec` and `plain` are pinned
   by asking for a model name that only one pool serves (`models = {"<model>-spec": "<model>"}`
   on that backend; the gateway has no request field that picks a backend, and a model route
   `routes.<model>.backends` would pin the policy's own model too); `split` asks for a name served
   by both pools again as one `replica_group` (`affinity.mode = "session"`: each request to the
   pool its prompt hashes to, loads bounded): the capacity of both pools without a policy, so that
   the report tells what the policy adds beyond having two pools. Workload: Spec-Bench and
   HumanEval prompts (specgate.bench.workloads) of copy-heavy classes (code, summarization, rag)
   and others (qa; open chat: writing, roleplay, humanities, stem), half of each class's prompts
   for training, the other half for evaluation.
   Phase 1 (explore): the admin API (`PUT /admin/policy`) sets `across_backends`,
   exploration `--train-exploration` (cap 1), `max_batch_for_spec` 0 (so that exploration covers
   the speculative pool at every batch) and low retrain thresholds; training prompts go through at
   the `--train-levels` concurrencies as `learned`; `POST /admin/policy/retrain` (forced if it
   declines; nothing retrains after it, so the evaluation's own rows change nothing); the
   report says whether a learned policy with both arms modelled is active. Exploration then goes
   back to the defaults (5%, cap 10%) and `max_batch_for_spec` to 16. Phase 2 (evaluate): per load
   level (light: `--light` requests in flight, heavy: `--heavy`), batches of evaluation prompts
   through `learned`, `spec`, `plain` and `split` in a rotated order, closed loop.
   Goodput: a request's output tokens / its end-to-end seconds at the client (queueing and prefill
   included): the policy's own reward. Reported per level and class group: the share of `learned`
   requests routed to `spec`, mean goodput per arm, p50 TTFT, throughput (output tokens / the
   arm's busy seconds), learned / the better single pool (by mean goodput) with a 95% bootstrap
   interval over prompts (the better pool chosen again in each resample), and learned / split.
2. Shared prefix over 3 replicas. Per arm, three plain stubs (prefix caches of
   `--replica-cache-blocks` blocks of 16 tokens, prefill `--prefix-prefill-ms` per token) in one
   `replica_group`, behind a gateway with `affinity.mode = "prefix"` or `"session"`. Workload:
   `--families` families, each a long system prompt (a Spec-Bench document) with different user
   questions; the first `--shared-families` families begin with one short common preamble; a
   share of the first turns get a follow-up turn (the first turn, its answer and a new question) in
   the next round. Rounds (one question per family, plus the follow-ups) go through both arms in a
   rotated order, `--prefix-concurrency` in flight, no `user` field. Reported per arm: cached
   share (sum of usage cached_tokens / sum of prompt_tokens), median TTFT and the ratio (with a 95%
   bootstrap interval, paired by request), requests per replica and the busiest / mean.

Output: the tables, the issue's goals with PASS or MISS, and one line of JSON (also --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from specgate.bench import gateway_targets as gt
from specgate.bench.stub_pool import PoolConfig, free_port, launch_pool
from specgate.bench.workloads import category_texts

MODEL = "pool-model"
# The model name each arm of part 1 asks for: the policy's choice, or one pool (or both) pinned.
ARM_MODELS = {"learned": MODEL, "spec": f"{MODEL}-spec", "plain": f"{MODEL}-plain", "split": f"{MODEL}-split"}
ADMIN_KEY = "bench-pools-admin-key-0123456789"
COPY_HEAVY = ("code", "summarization", "rag")
OTHERS = ("qa", "open_chat")
SPEC_ARM, PLAIN_ARM = "spec:upstream-ngram", "plain:upstream"
FOLLOW_UP = "Thanks. Can you go into more detail on that, with an example?"
PREAMBLE = (
    "You are a careful assistant deployed by Northwind Analytics. Answer in plain English, cite the "
    "reference below when you use it, never invent figures, keep answers short unless asked for "
    "more, and say so when the reference does not cover the question. "
) * 2


# ---- requests --------------------------------------------------------------------------------


@dataclass
class Result:
    """One request as the client saw it (times: perf_counter seconds)."""

    key: str  # what pairs it with the other arms' same request
    group: str  # the class group or the family
    sent: float = 0.0
    first: float | None = None
    end: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    route: dict[str, Any] = field(default_factory=dict)
    busy_s: float = 0.0  # its batch's wall time over the batch's requests (for throughput)
    error: str | None = None

    @property
    def e2e(self) -> float:
        return max(1e-9, self.end - self.sent)

    @property
    def goodput(self) -> float:
        return self.completion_tokens / self.e2e

    @property
    def ttft(self) -> float:
        return (self.first if self.first is not None else self.end) - self.sent


async def send(
    client: httpx.AsyncClient,
    messages: list[dict[str, str]],
    max_tokens: int,
    key: str,
    group: str,
    model: str = MODEL,
) -> Result:
    """One streamed chat request through a gateway, timed at the client."""
    res = Result(key, group, sent=time.perf_counter())
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"{r.status_code} {(await r.aread())[:300]!r}"
                res.end = time.perf_counter()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if res.first is None:
                            res.first = time.perf_counter()
                        text.append(content)
                usage = chunk.get("usage")
                if usage:
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
                route = (chunk.get("metrics") or {}).get("route")
                if isinstance(route, dict):
                    res.route = route
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.end = time.perf_counter()
    res.text = "".join(text)
    return res


async def closed_loop(jobs: Sequence[Callable[[], Awaitable[Result]]], concurrency: int) -> list[Result]:
    """The jobs with at most `concurrency` in flight, results in job order."""
    out: list[Result | None] = [None] * len(jobs)
    queue = iter(range(len(jobs)))

    async def worker() -> None:
        for i in queue:
            out[i] = await jobs[i]()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(jobs)))))
    return [r for r in out if r is not None]


# ---- servers ---------------------------------------------------------------------------------


class Gateway:
    """`specgate serve` on a JSON config of its own, its output in the run's directory."""

    def __init__(self, name: str, config: dict[str, Any], tmp: Path) -> None:
        self.name, self.tmp = name, tmp
        self.port = free_port()
        path = tmp / f"{name}.json"
        path.write_text(json.dumps({"port": self.port, "admin_key": ADMIN_KEY, **config}))
        self.cmd = [sys.executable, "-m", "specgate.gateway.cli.main", "serve", "--config", str(path)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.target: gt.Target | None = None

    def start(self) -> Gateway:
        self.target = gt.start(self.name, self.cmd, self.url, "/readyz", self.tmp)
        return self

    def admin(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        r = httpx.request(method, self.url + path, json=body, headers=headers, timeout=600, trust_env=False)
        if r.status_code != 200:
            raise RuntimeError(f"{self.name}: {method} {path}: {r.status_code} {r.text[:500]}")
        return dict(r.json())

    def client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        return httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits, trust_env=False)

    def stop(self) -> None:
        if self.target is not None:
            self.target.stop()


def start_all(gateways: list[Gateway]) -> None:
    """Start gateways side by side (each start is mostly imports: CPU the others can overlap)."""
    with ThreadPoolExecutor(len(gateways)) as pool:
        list(pool.map(Gateway.start, gateways))


class Stubs:
    """Stub pools as processes; stopped together."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Any] = []
        self.urls: dict[str, str] = {}

    def launch(self, configs: list[PoolConfig]) -> None:
        with ThreadPoolExecutor(len(configs)) as pool:
            started = list(pool.map(lambda c: launch_pool(c, log=self.tmp / f"stub-{c.name}.log"), configs))
        for c, (proc, url) in zip(configs, started, strict=True):
            self.procs.append(proc)
            self.urls[c.name] = url

    def stats(self, name: str) -> dict[str, Any]:
        return dict(httpx.get(self.urls[name] + "/stats", timeout=10, trust_env=False).json())

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except Exception:
                p.kill()


def backend(name: str, url: str, **extra: Any) -> dict[str, Any]:
    # Scraped and probed every second: the load the policy reads is at most a second old.
    return {"name": name, "base_url": f"{url}/v1", "models": [MODEL], "health_interval": 1.0, **extra}


# ---- statistics ------------------------------------------------------------------------------


def bootstrap(
    stat: Callable[[np.ndarray], float], n: int, seed: int, draws: int = 2000
) -> tuple[float, float]:
    """95% percentile interval of `stat(indices)` over resamples of n paired units."""
    rng = np.random.default_rng(seed)
    values = sorted(stat(rng.integers(0, n, n)) for _ in range(draws))
    return float(values[int(0.025 * draws)]), float(values[int(0.975 * draws) - 1])


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ---- part 1: two pools -------------------------------------------------------------------------


def pool_prompts(seed: int) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Per class: training prompts and evaluation prompts (disjoint halves, shuffled with `seed`)."""
    texts = category_texts()
    rng = random.Random(seed)
    train, evaluate = {}, {}
    for cat in (*COPY_HEAVY, *OTHERS):
        items = list(texts[cat])
        rng.shuffle(items)
        half = len(items) // 2
        train[cat], evaluate[cat] = items[:half], items[half:]
    return train, evaluate


def round_robin(prompts: dict[str, list[str]], n: int, offset: int = 0) -> list[tuple[str, str]]:
    """n (class, prompt) pairs, the classes alternating, each class's prompts cycled."""
    cats = list(prompts)
    out = []
    for i in range(n):
        cat = cats[i % len(cats)]
        j = (offset + i // len(cats)) % len(prompts[cat])
        out.append((cat, prompts[cat][j]))
    return out


def group_of(cat: str) -> str:
    return "copy-heavy" if cat in COPY_HEAVY else "others"


def run_pools(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    stubs = Stubs(tmp)
    common = {"model": MODEL, "time_scale": args.time_scale, "cache_blocks": 0, "seed": args.seed}
    stubs.launch([PoolConfig(name="spec", speculative=True, **common), PoolConfig(name="plain", **common)])
    spec_url, plain_url = stubs.urls["spec"], stubs.urls["plain"]
    # One gateway serves every arm (the same process and overheads for all; arms never overlap in
    # time): the model routes by policy; each pinned arm is a model name that one pool alone serves.
    backends = [
        backend("spec", spec_url, speculative="ngram", models={MODEL: MODEL, ARM_MODELS["spec"]: MODEL}),
        backend("plain", plain_url, speculative="off", models={MODEL: MODEL, ARM_MODELS["plain"]: MODEL}),
    ]
    if args.split:
        # The same two servers again as one replica group under a model name of its own.
        split = {"replica_group": "both", "models": {ARM_MODELS["split"]: MODEL}}
        backends += [
            backend("spec-g", spec_url, speculative="ngram", **split),
            backend("plain-g", plain_url, speculative="off", **split),
        ]
    d = tmp / "learned-data"
    d.mkdir()
    store = {"url": f"sqlite:///{d}/telemetry.db", "auto_upgrade": True, "spool_dir": str(d / "spool")}
    config = {
        "embedded": {"enabled": False},
        "backends": backends,
        "policy": {"seed": args.seed},
        "telemetry": store,
        # Affinity only matters for the split arm's group: the prompt's hash picks its pool.
        "affinity": {"mode": "session"},
    }
    gw = Gateway("pools", config, tmp)
    t0 = time.perf_counter()
    try:
        gw.start()
        log(f"pools: 2 stubs and the gateway up in {time.perf_counter() - t0:.0f} s")
        train_prompts, eval_prompts = pool_prompts(args.seed)
        training = explore_and_retrain(args, gw, train_prompts)
        arms = ["learned", "spec", "plain", *(["split"] if args.split else [])]
        results = evaluate(args, gw, arms, eval_prompts)
    finally:
        gw.stop()
        stubs.stop()
    report = analyse_pools(results, args, training.get("pool_crossovers") or {})
    report["training"] = training
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def explore_and_retrain(
    args: argparse.Namespace, gw: Gateway, prompts: dict[str, list[str]]
) -> dict[str, Any]:
    levels = [int(x) for x in args.train_levels.split(",")]
    counts = [int(x) for x in args.train_per_level.split(",")]
    if len(counts) == 1:
        counts *= len(levels)
    total = sum(counts)
    gw.admin(
        "PUT",
        "/admin/policy",
        {
            "across_backends": True,
            "exploration_rate": args.train_exploration,
            "exploration_cap": 1.0,
            "max_batch_for_spec": 0,
            "min_train_rows": max(10, total // 2),
            "min_arm_rows": max(5, min(20, total // 8)),
            "note": "bench_pools: training traffic",
        },
    )
    routed: dict[str, int] = {}
    t0 = time.perf_counter()
    for level, n in zip(levels, counts, strict=True):
        items = round_robin(prompts, n, offset=level)
        results = asyncio.run(_batch(gw, items, level, args.max_tokens, f"train{level}"))
        failed = [r.error for r in results if r.error]
        if failed:
            raise RuntimeError(f"{len(failed)} training requests failed: {failed[:3]}")
        for r in results:
            arm = str(r.route.get("arm", "?"))
            routed[arm] = routed.get(arm, 0) + 1
    log(f"pools: {total} training requests at {levels} in flight, {time.perf_counter() - t0:.0f} s: {routed}")
    time.sleep(2.0)  # the telemetry writer flushes every 0.2 s; leave it a few rounds
    retrain = gw.admin("POST", "/admin/policy/retrain", {})
    declined = None
    if not retrain.get("promoted"):
        declined = retrain.get("reason")
        retrain = gw.admin("POST", "/admin/policy/retrain", {"force": True})
    gw.admin(
        "PUT",
        "/admin/policy",
        {
            "exploration_rate": args.eval_exploration,
            "exploration_cap": max(0.1, args.eval_exploration),
            "max_batch_for_spec": 16,
            "note": "bench_pools: exploration back to normal",
        },
    )
    policy = gw.admin("GET", "/admin/policy")
    modelled = policy.get("modelled_arms") or []
    ok = policy.get("kind") == "learned" and SPEC_ARM in modelled and PLAIN_ARM in modelled
    out = {
        "requests": total,
        "levels": levels,
        "routed": routed,
        "retrain": {k: retrain.get(k) for k in ("version", "promoted", "reason", "train_rows", "off_policy")},
        "declined": declined,
        "active_kind": policy.get("kind"),
        "modelled_arms": modelled,
        "pool_crossovers": policy.get("pool_crossovers"),
        "learned_with_both_arms": ok,
    }
    log(
        f"pools: retrain {'promoted' if declined is None else f'declined ({declined}), forced'}; "
        f"active {policy.get('kind')} v{policy.get('version')}, modelled {modelled}"
    )
    if not ok:
        log("pools: WARNING: no learned policy with both arms modelled is active; evaluating anyway")
    return out


async def _batch(
    gw: Gateway, items: list[tuple[str, str]], concurrency: int, max_tokens: int, tag: str, model: str = MODEL
) -> list[Result]:
    async with gw.client() as client:

        def job(i: int, cat: str, prompt: str) -> Callable[[], Awaitable[Result]]:
            messages = [{"role": "user", "content": prompt}]
            return lambda: send(client, messages, max_tokens, f"{tag}-{i}", cat, model)

        return await closed_loop([job(i, c, p) for i, (c, p) in enumerate(items)], concurrency)


def evaluate(
    args: argparse.Namespace, gw: Gateway, arms: list[str], prompts: dict[str, list[str]]
) -> dict[str, dict[str, list[Result]]]:
    """results[level][arm]: the level's requests in the same order for every arm."""
    levels = {
        "light": (args.light, args.light_batch, args.light_batches),
        "heavy": (args.heavy, args.heavy_batch or 2 * args.heavy, args.heavy_batches),
    }
    out: dict[str, dict[str, list[Result]]] = {}
    k = 0
    for level, (concurrency, size, batches) in levels.items():
        out[level] = {a: [] for a in arms}
        items = round_robin(prompts, size * batches, offset=7 if level == "heavy" else 0)
        for b in range(batches):
            batch = items[b * size : (b + 1) * size]
            order = arms[k % len(arms) :] + arms[: k % len(arms)]
            k += 1
            for arm in order:
                t0 = time.perf_counter()
                tag = f"{level}{b}"
                res = asyncio.run(_batch(gw, batch, concurrency, args.max_tokens, tag, ARM_MODELS[arm]))
                wall = time.perf_counter() - t0
                failed = [r.error for r in res if r.error]
                if failed:
                    raise RuntimeError(f"{len(failed)} requests failed ({arm}, {level}): {failed[:3]}")
                for r in res:
                    r.busy_s = wall / len(res)
                out[level][arm] += res
            log(f"pools: {level} batch {b + 1}/{batches}: {len(batch)} requests, {concurrency} in flight")
    return out


def _group_stats(rows: dict[str, list[Result]], idx: list[int], seed: int) -> dict[str, Any]:
    arms = list(rows)
    g = {a: np.array([rows[a][i].goodput for i in idx]) for a in arms}  # [requests]
    means = {a: float(g[a].mean()) for a in arms}
    best = max(("spec", "plain"), key=lambda a: means[a])

    def ratio(sample: np.ndarray) -> float:
        return float(g["learned"][sample].mean() / max(g["spec"][sample].mean(), g["plain"][sample].mean()))

    low, high = bootstrap(ratio, len(idx), seed)
    n = len(idx)
    learned = [rows["learned"][i] for i in idx]
    to_spec = sum(r.route.get("backend") == "spec" for r in learned) / n
    split: dict[str, Any] = {}
    if "split" in rows:

        def vs_split(sample: np.ndarray) -> float:
            return float(g["learned"][sample].mean() / g["split"][sample].mean())

        split_low, split_high = bootstrap(vs_split, len(idx), seed + 1)
        split = {
            "split_to_spec": round(
                sum(str(rows["split"][i].route.get("backend")).startswith("spec") for i in idx) / n, 3
            ),
            "vs_split": round(means["learned"] / means["split"], 3),
            "vs_split_ci95": [round(split_low, 3), round(split_high, 3)],
        }
    return {
        "n": len(idx),
        "learned_to_spec": round(to_spec, 3),
        "explored": sum(bool(r.route.get("explored")) for r in learned),
        "goodput": {a: round(means[a], 2) for a in arms},
        "ttft_p50_ms": {a: round(pct([rows[a][i].ttft * 1e3 for i in idx], 50), 1) for a in arms},
        "throughput": {
            a: round(
                sum(rows[a][i].completion_tokens for i in idx) / sum(rows[a][i].busy_s for i in idx),
                1,
            )
            for a in arms
        },
        "best_single": best,
        "ratio": round(means["learned"] / means[best], 3),
        "ci95": [round(low, 3), round(high, 3)],
        **split,
    }


def past_crossover(
    results: dict[str, dict[str, list[Result]]], crossovers: dict[str, float], constant: int = 16
) -> dict[str, Any]:
    """The learned arm's requests at each level split by whether the speculative pool's own batch
    (metrics.route.pool_batches) had passed the class's measured crossover (else the rules'
    constant) when the policy decided: how many went to `spec` on each side."""
    out: dict[str, Any] = {}
    for level, rows in results.items():
        before = past = before_spec = past_spec = 0
        for r in rows["learned"]:
            batches = r.route.get("pool_batches") or {}
            spec_key = next((k for k in batches if k.startswith("spec:")), None)
            if spec_key is None:
                continue
            limit = crossovers.get(f"{r.route.get('workload_class')}:{spec_key}", constant)
            to_spec = r.route.get("backend") == "spec"
            if batches[spec_key] >= limit:
                past, past_spec = past + 1, past_spec + to_spec
            else:
                before, before_spec = before + 1, before_spec + to_spec
        out[level] = {
            "before": before,
            "before_to_spec": round(before_spec / before, 3) if before else None,
            "past": past,
            "past_to_plain": round(1 - past_spec / past, 3) if past else None,
        }
    return out


def analyse_pools(
    results: dict[str, dict[str, list[Result]]], args: argparse.Namespace, crossovers: dict[str, float]
) -> dict[str, Any]:
    table: dict[str, dict[str, Any]] = {}
    for level, rows in results.items():
        n = len(rows["learned"])
        for grp in ("copy-heavy", "others", "all"):
            idx = [i for i in range(n) if grp == "all" or group_of(rows["learned"][i].group) == grp]
            if idx:
                table[f"{level}/{grp}"] = _group_stats(rows, idx, args.seed)
    # Both levels together: every request once, each arm's mean goodput over all of them.
    merged = {a: [r for level in results.values() for r in level[a]] for a in next(iter(results.values()))}
    table["both/all"] = _group_stats(merged, list(range(len(merged["learned"]))), args.seed)
    light_copy = table.get("light/copy-heavy")
    overall = table["both/all"]
    crossing = past_crossover(results, crossovers)
    heavy_past = crossing.get("heavy", {})
    goals = {
        "light load: learned sends >= 75% of copy-heavy requests to spec": bool(
            light_copy and light_copy["learned_to_spec"] >= 0.75
        ),
        # With two pools the plain one cannot take all the heavy traffic without becoming the
        # bottleneck: the policy turns to it as the speculative pool's own batch passes the
        # class's crossover, which is what "plain under heavy load" asks of a per-request choice.
        "heavy load: past the spec pool's crossover, learned sends >= 75% to plain": bool(
            heavy_past.get("past") and (heavy_past.get("past_to_plain") or 0.0) >= 0.75
        ),
        "learned >= 1.10x the better single pool, interval above 1": overall["ratio"] >= 1.10
        and overall["ci95"][0] > 1.0,
    }
    return {"table": table, "goals": goals, "crossing": crossing}


# ---- part 2: shared prefix over replicas ---------------------------------------------------------


@dataclass
class Turn:
    key: str
    family: int
    question: int  # the first turn's question (an index into the question pool)
    follow_of: str | None = None  # a follow-up: the key of the first turn it continues


def families(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """System prompts (one per family) and the question pool."""
    texts = category_texts()
    docs = [t for t in texts["summarization"] + texts["rag"] if len(t) >= args.system_chars // 2]
    systems = []
    for f in range(args.families):
        lead = PREAMBLE if f < args.shared_families else ""
        doc = docs[f % len(docs)][: args.system_chars]
        systems.append(f"{lead}You are the help desk of team {f}. Reference document {f}:\n\n{doc}")
    return systems, texts["qa"] + texts["open_chat"]


def prefix_rounds(args: argparse.Namespace, n_questions: int) -> list[list[Turn]]:
    """Round r: question r of every family (families in a shuffled order), and the follow-ups of
    some of round r-1's first turns."""
    rng = random.Random(args.seed)
    rounds: list[list[Turn]] = []
    previous: list[Turn] = []
    for r in range(args.questions + 1):
        turns: list[Turn] = []
        if r < args.questions:
            order = list(range(args.families))
            rng.shuffle(order)
            for f in order:
                q = (f * 7 + r * 3) % n_questions
                turns.append(Turn(f"f{f}-q{r}", f, q))
        follows = [t for t in previous if rng.random() < args.follow_up_share]
        turns += [Turn(t.key + "-follow", t.family, t.question, t.key) for t in follows]
        rng.shuffle(turns)
        rounds.append(turns)
        previous = [t for t in turns if t.follow_of is None]
    return [r for r in rounds if r]


def run_prefix(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    modes = ("prefix", "session")
    stubs = Stubs(tmp)
    configs = [
        PoolConfig(
            name=f"{mode}-r{i}",
            model=MODEL,
            time_scale=args.time_scale,
            cache_blocks=args.replica_cache_blocks,
            prefill_ms_per_token=args.prefix_prefill_ms,
            seed=args.seed,
        )
        for mode in modes
        for i in range(3)
    ]
    t0 = time.perf_counter()
    stubs.launch(configs)
    gateways = {}
    for mode in modes:
        replicas = [
            backend(
                f"{mode}-r{i}",
                stubs.urls[f"{mode}-r{i}"],
                replica_group="replicas",
                speculative="off",
                scrape_metrics=args.scrape,
            )
            for i in range(3)
        ]
        config = {
            "embedded": {"enabled": False},
            "backends": replicas,
            "affinity": {"mode": mode, **dict(kv.split("=", 1) for kv in args.affinity)},
            "telemetry": {"enabled": False},
            "policy": {"seed": args.seed},
        }
        gateways[mode] = Gateway(f"affinity-{mode}", config, tmp)
    systems, questions = families(args)
    rounds = prefix_rounds(args, len(questions))
    results: dict[str, list[Result]] = {m: [] for m in modes}
    try:
        start_all(list(gateways.values()))
        log(f"prefix: 6 stubs and 2 gateways up in {time.perf_counter() - t0:.0f} s")
        answers: dict[str, dict[str, str]] = {m: {} for m in modes}
        for k, turns in enumerate(rounds):
            for mode in modes[k % 2 :] + modes[: k % 2]:
                res = asyncio.run(
                    _prefix_round(args, gateways[mode], turns, systems, questions, answers[mode])
                )
                failed = [r.error for r in res if r.error]
                if failed:
                    raise RuntimeError(f"{len(failed)} requests failed ({mode}): {failed[:3]}")
                results[mode] += res
        stats = {name: stubs.stats(name) for name in stubs.urls}
    finally:
        for g in gateways.values():
            g.stop()
        stubs.stop()
    report = analyse_prefix(results, stats, args)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["rounds"] = len(rounds)
    return report


async def _prefix_round(
    args: argparse.Namespace,
    gw: Gateway,
    turns: list[Turn],
    systems: list[str],
    questions: list[str],
    answers: dict[str, str],
) -> list[Result]:
    def messages(t: Turn) -> list[dict[str, str]]:
        out = [
            {"role": "system", "content": systems[t.family]},
            {"role": "user", "content": questions[t.question]},
        ]
        if t.follow_of is not None:  # the first turn, the answer this arm got, a new question
            out += [
                {"role": "assistant", "content": answers[t.follow_of]},
                {"role": "user", "content": FOLLOW_UP},
            ]
        return out

    async with gw.client() as client:

        def job(t: Turn) -> Callable[[], Awaitable[Result]]:
            return lambda: send(client, messages(t), args.prefix_max_tokens, t.key, f"family{t.family}")

        res = await closed_loop([job(t) for t in turns], args.prefix_concurrency)
    for t, r in zip(turns, res, strict=True):
        if t.follow_of is None:
            answers[t.key] = r.text
    return res


def analyse_prefix(
    results: dict[str, list[Result]], stats: dict[str, dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, rows in results.items():
        per_replica: dict[str, int] = {}
        for r in rows:
            name = str(r.route.get("backend", "?"))
            per_replica[name] = per_replica.get(name, 0) + 1
        counts = [per_replica.get(f"{mode}-r{i}", 0) for i in range(3)]
        # Why the gateway chose each replica (prefix mode: "prefix", "load" or "no match").
        reasons: dict[str, int] = {}
        for r in rows:
            why = str((r.route.get("affinity") or {}).get("prefix_reason") or "session key")
            reasons[why] = reasons.get(why, 0) + 1
        out[mode] = {
            "requests": len(rows),
            "cached_share": round(
                sum(r.cached_tokens for r in rows) / max(1, sum(r.prompt_tokens for r in rows)), 4
            ),
            "ttft_p50_ms": round(pct([r.ttft * 1e3 for r in rows], 50), 1),
            "ttft_p90_ms": round(pct([r.ttft * 1e3 for r in rows], 90), 1),
            # The median sits on the knee of a two-humped distribution (cached: tens of ms,
            # uncached: hundreds): the mean moves less from run to run.
            "ttft_mean_ms": round(1e3 * sum(r.ttft for r in rows) / len(rows), 1),
            "per_replica": counts,
            "busiest_over_mean": round(max(counts) / (sum(counts) / 3), 3) if sum(counts) else None,
            "stub_requests": [stats[f"{mode}-r{i}"]["requests"] for i in range(3)],
            "affinity_reasons": reasons,
        }
    pre, ses = results["prefix"], results["session"]
    by_key = {r.key: r for r in ses}
    paired = [(p.ttft, by_key[p.key].ttft) for p in pre if p.key in by_key]
    a = np.array([x for x, _ in paired])  # [pairs] prefix TTFT
    b = np.array([y for _, y in paired])  # [pairs] session TTFT

    def ratio(sample: np.ndarray) -> float:
        return float(np.median(b[sample]) / np.median(a[sample]))

    low, high = bootstrap(ratio, len(paired), args.seed)
    cut = 1.0 - out["prefix"]["ttft_p50_ms"] / out["session"]["ttft_p50_ms"]
    out["ttft_p50_session_over_prefix"] = round(float(np.median(b) / np.median(a)), 3)
    out["ttft_ratio_ci95"] = [round(low, 3), round(high, 3)]
    out["ttft_p50_cut"] = round(cut, 3)
    out["goals"] = {
        "prefix raises the cached share": out["prefix"]["cached_share"] > out["session"]["cached_share"],
        "prefix cuts median TTFT by >= 30%": cut >= 0.30,
        "prefix: busiest replica <= 1.25x mean": (out["prefix"]["busiest_over_mean"] or 99) <= 1.25,
    }
    return out


# ---- report ----------------------------------------------------------------------------------


def log(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def pools_table(rep: dict[str, Any]) -> str:
    arms = list(next(iter(rep["table"].values()))["goodput"])
    names = "/".join(arms)
    lines = [
        "Two pools: a learned policy across `spec` (speculative) and `plain`, vs each pool alone"
        + (", vs both pools split by prompt hash without a policy (`split`)" if "split" in arms else ""),
        "goodput: mean over requests of output tokens / end-to-end s; tok/s total: output tokens / busy s",
        f"{'load/group':17s} {'n':>3s} {'->spec':>6s}  {'goodput tok/s ' + names:>39s}  "
        f"{'TTFT p50 ms ' + names:>36s}  {'tok/s total ' + names:>36s}  "
        f"{'learned/best pool [95%]':>29s}" + ("  learned/split [95%]" if "split" in arms else ""),
    ]
    for key, row in rep["table"].items():
        g, t, th = row["goodput"], row["ttft_p50_ms"], row["throughput"]
        lo, hi = row["ci95"]
        line = (
            f"{key:17s} {row['n']:3d} {row['learned_to_spec']:6.0%}  "
            + " ".join(f"{g[a]:9.1f}" for a in arms)
            + "  "
            + " ".join(f"{t[a]:8.0f}" for a in arms)
            + "  "
            + " ".join(f"{th[a]:8.0f}" for a in arms)
            + f"  {row['ratio']:5.2f}x {row['best_single']:5s} [{lo:.2f}, {hi:.2f}]"
        )
        if "vs_split" in row:
            slo, shi = row["vs_split_ci95"]
            line += f"  {row['vs_split']:5.2f}x [{slo:.2f}, {shi:.2f}]"
        lines.append(line)
    tr = rep["training"]
    how = "promoted" if tr["declined"] is None else f"declined ({tr['declined']}), forced"
    lines.append(
        f"training: {tr['requests']} requests at {tr['levels']} in flight, routed {tr['routed']}; "
        f"retrain {how}; active {tr['active_kind']}, modelled {tr['modelled_arms']}; "
        f"crossovers {tr['pool_crossovers']}"
    )
    for level, c in rep.get("crossing", {}).items():
        lines.append(
            f"{level}: learned requests with the spec pool's batch before its class crossover: "
            f"{c['before']} ({c['before_to_spec'] if c['before_to_spec'] is not None else '-'} to spec); "
            f"past it: {c['past']} ({c['past_to_plain'] if c['past_to_plain'] is not None else '-'} to plain)"
        )
    lines += [f"{'PASS' if ok else 'MISS'}: {name}" for name, ok in rep["goals"].items()]
    return "\n".join(lines)


def prefix_table(rep: dict[str, Any]) -> str:
    lines = [
        "Shared prefix over 3 replicas: affinity.mode prefix vs session",
        f"{'mode':8s} {'requests':>8s} {'cached share':>12s} {'TTFT p50 ms':>11s} {'TTFT p90 ms':>11s} "
        f"{'TTFT mean ms':>12s} {'per replica':>14s} {'busiest/mean':>12s}  why this replica",
    ]
    for mode in ("prefix", "session"):
        r = rep[mode]
        lines.append(
            f"{mode:8s} {r['requests']:8d} {r['cached_share']:12.1%} {r['ttft_p50_ms']:11.0f} "
            f"{r['ttft_p90_ms']:11.0f} {r['ttft_mean_ms']:12.0f} {r['per_replica']!s:>14s} "
            f"{r['busiest_over_mean']:12.2f}  {r['affinity_reasons']}"
        )
    lo, hi = rep["ttft_ratio_ci95"]
    lines.append(
        f"median TTFT session / prefix: {rep['ttft_p50_session_over_prefix']:.2f}x [{lo:.2f}, {hi:.2f}] "
        f"(prefix cuts it by {rep['ttft_p50_cut']:.0%}); mean TTFT session / prefix: "
        f"{rep['session']['ttft_mean_ms'] / rep['prefix']['ttft_mean_ms']:.2f}x"
    )
    lines += [f"{'PASS' if ok else 'MISS'}: {name}" for name, ok in rep["goals"].items()]
    return "\n".join(lines)


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs, {model}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("pools", "prefix", "both"), default="both")
    p.add_argument("--time-scale", type=float, default=1.0, help="the stubs' durations multiplied by this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON report here")
    p.add_argument("--keep", action="store_true", help="keep the run's directory (logs, telemetry)")
    g = p.add_argument_group("two pools")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--train-levels", default="2,12,32", help="training concurrencies")
    g.add_argument("--train-per-level", default="60,72,96", help="training requests per level (or one count)")
    g.add_argument("--train-exploration", type=float, default=0.5)
    g.add_argument("--eval-exploration", type=float, default=0.05)
    g.add_argument("--light", type=int, default=2, help="requests in flight at the light level")
    g.add_argument("--light-batch", type=int, default=10)
    g.add_argument("--light-batches", type=int, default=3)
    g.add_argument("--heavy", type=int, default=24, help="requests in flight at the heavy level")
    g.add_argument("--heavy-batch", type=int, default=0, help="0: twice --heavy")
    g.add_argument("--heavy-batches", type=int, default=2)
    g.add_argument("--no-split", dest="split", action="store_false", help="leave out the `split` arm")
    g = p.add_argument_group("shared prefix")
    g.add_argument("--families", type=int, default=12)
    g.add_argument("--shared-families", type=int, default=4, help="families that share one preamble")
    g.add_argument("--questions", type=int, default=8, help="first-turn questions per family")
    g.add_argument("--follow-up-share", type=float, default=0.3)
    g.add_argument("--system-chars", type=int, default=6000)
    g.add_argument("--prefix-concurrency", type=int, default=6)
    g.add_argument("--prefix-max-tokens", type=int, default=24)
    g.add_argument("--replica-cache-blocks", type=int, default=512)
    g.add_argument("--prefix-prefill-ms", type=float, default=0.2, help="prefill ms per uncached token")
    g.add_argument(
        "--affinity",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an affinity setting for both gateways (e.g. tokens_per_request=128); repeatable",
    )
    g.add_argument(
        "--no-scrape",
        dest="scrape",
        action="store_false",
        help="replicas' load: the gateway's own requests in flight, not their /metrics",
    )
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-pools-"))
    t0 = time.perf_counter()
    report: dict[str, Any] = {"machine": machine(), "config": vars(args)}
    try:
        if args.part in ("pools", "both"):
            report["pools"] = run_pools(args, tmp)
        if args.part in ("prefix", "both"):
            report["prefix"] = run_prefix(args, tmp)
    except BaseException:
        log(f"bench_pools: failed; logs kept in {tmp}")
        raise
    report["minutes"] = round((time.perf_counter() - t0) / 60, 2)
    text = [f"bench_pools on {report['machine']}, {report['minutes']} min"]
    if "pools" in report:
        text += ["", pools_table(report["pools"])]
    if "prefix" in report:
        text += ["", prefix_table(report["prefix"])]
    sys.stdout.write("\n".join(text) + "\n\n" + json.dumps(report, separators=(",", ":"), default=str) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    if args.keep:
        log(f"bench_pools: run directory kept: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
