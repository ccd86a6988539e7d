"""`specgate bench pools`: external pools as routing arms, each against its alternatives in one run.
(bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from specgate.bench import launch, stub, workload
from specgate.bench.client import POLICY, ByArm, RequestResult, closed_loop, send
from specgate.bench.stats import bootstrap_interval, distribution, percentile, table, times
from specgate.bench.stub import PoolConfig

MODEL = "pool-model"
# The model name each arm of part 1 asks for: the policy's choice, or one pool (or both) pinned.
ARM_MODELS = {"learned": MODEL, "spec": f"{MODEL}-spec", "plain": f"{MODEL}-plain", "split": f"{MODEL}-split"}
ADMIN_KEY = "bench-pools-admin-key-0123456789"
COPY_HEAVY = ("code", "summarization", "rag")
OTHERS = ("qa", "open_chat")
SPEC_ARM, PLAIN_ARM = "spec:upstream-ngram", "plain:upstream"
MODES = ("prefix", "session", "off")  # affinity modes of part 2; off: affinity disabled
FOLLOW_UP = "Thanks. Can you go into more detail on that, with an example?"
PREAMBLE = (
    "You are a careful assistant deployed by Northwind Analytics. Answer in plain English, cite the "
    "reference below when you use it, never invent figures, keep answers short unless asked for "
    "more, and say so when the reference does not cover the question. "
) * 2
Job = tuple[str, str, list[dict[str, str]]]  # request id, group (its class or family), messages
ByLevel = dict[str, ByArm]  # [level][arm]: the same requests for every arm
Rows = list[tuple[float, ...]]  # per request, a value for each arm (paired rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=("pools", "prefix", "both"), default="both")
    p.add_argument("--time-scale", type=float, default=1.0, help="the stubs' durations multiplied by this")
    launch.options(p, seed=0, out=None)
    p.add_argument("--keep", action="store_true", help="keep the run's directory (logs, telemetry)")
    g = p.add_argument_group("two pools")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--train-levels", default="2,12,32", help="training concurrencies")
    g.add_argument("--train-per-level", default="60,72,96", help="training requests per level (or one count)")
    g.add_argument("--light", type=int, default=2, help="requests in flight at the light level")
    g.add_argument("--light-batch", type=int, default=10)
    g.add_argument("--light-batches", type=int, default=3)
    g.add_argument("--heavy", type=int, default=24, help="requests in flight at the heavy level")
    g.add_argument("--heavy-batches", type=int, default=2)
    g = p.add_argument_group("shared prefix")
    g.add_argument("--families", type=int, default=12)
    g.add_argument("--shared-families", type=int, default=4, help="families that share one preamble")
    g.add_argument("--questions", type=int, default=8, help="first-turn questions per family")
    g.add_argument("--follow-up-share", type=float, default=0.3)
    g.add_argument("--system-chars", type=int, default=6000)
    g.add_argument("--prefix-concurrency", type=int, default=6)
    g.add_argument("--prefix-max-tokens", type=int, default=24)
    g.add_argument("--replica-cache-blocks", type=int, default=512)


def run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="bench-pools-"))
    t0 = time.perf_counter()
    config = {k: v for k, v in vars(args).items() if k != "func"}
    report: dict[str, Any] = {"machine": launch.machine(), "config": config}
    try:
        if args.part in ("pools", "both"):
            report["pools"] = run_pools(args, tmp)
        if args.part in ("prefix", "both"):
            report["prefix"] = run_prefix(args, tmp)
    except BaseException:
        launch.log(f"pools: failed; logs kept in {tmp}")
        raise
    report["minutes"] = round((time.perf_counter() - t0) / 60, 2)
    text = [f"bench pools on {report['machine']}, {report['minutes']} min"]
    text += ["", *pools_table(report["pools"])] if "pools" in report else []
    text += ["", *prefix_table(report["prefix"])] if "prefix" in report else []
    sys.stdout.write("\n".join(text) + "\n\n" + json.dumps(report, separators=(",", ":"), default=str) + "\n")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    if args.keep:
        launch.log(f"pools: run directory kept: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


# ---- servers ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def stubs(configs: Sequence[PoolConfig], tmp: Path) -> Iterator[dict[str, str]]:
    """Stub processes by name: their URLs; stopped together."""
    with contextlib.ExitStack() as stack:
        urls = {}
        for c in configs:
            port = launch.free_port()
            urls[c.name] = f"http://127.0.0.1:{port}"
            log = tmp / f"stub-{c.name}.log"
            stack.enter_context(launch.running(stub.command(c, port), log, f"{urls[c.name]}/health"))
        yield urls


def gateway(name: str, config: dict[str, Any], tmp: Path) -> contextlib.AbstractContextManager[launch.Server]:
    return launch.specgate(tmp / f"{name}.log", config={"admin_key": ADMIN_KEY, **config}, timeout=180)


def backend(name: str, url: str, **extra: Any) -> dict[str, Any]:
    # Scraped and probed every second: the load the policy reads is at most a second old.
    return {"name": name, "base_url": f"{url}/v1", "models": [MODEL], "health_interval": 1.0, **extra}


async def batch(
    url: str, jobs: Sequence[Job], concurrency: int, max_tokens: int, model: str = MODEL
) -> list[RequestResult]:
    """Jobs with at most `concurrency` in flight, results in job order."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

    def make(i: int) -> Any:
        key, group, messages = jobs[i]
        return send(client, model, workload.BenchRequest(group, messages, max_tokens), POLICY, key, 0.0)

    try:
        results = await closed_loop(make, len(jobs), concurrency)
    finally:
        await client.close()
    if failed := [r.error for r in results if not r.ok]:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    return results


def ttft(r: RequestResult) -> float:
    return r.ttft if r.ttft is not None else r.e2e or 0.0


def ratio_interval(pairs: Rows, stat: Callable[[Rows], float], seed: int) -> list[float]:
    """95% bootstrap interval of `stat` over resamples of the paired rows."""
    low, high = bootstrap_interval([pairs], lambda g: stat(g[0]), seed=seed) or (0.0, 0.0)
    return [round(low, 3), round(high, 3)]


# ---- part 1: two pools -------------------------------------------------------------------------------


def pool_prompts(seed: int) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Per class: training prompts and evaluation prompts (disjoint halves, shuffled with `seed`)."""
    texts, rng = workload.category_texts(), random.Random(seed)
    train, evaluate = {}, {}
    for cat in (*COPY_HEAVY, *OTHERS):
        items = list(texts[cat])
        rng.shuffle(items)
        train[cat], evaluate[cat] = items[: len(items) // 2], items[len(items) // 2 :]
    return train, evaluate


def round_robin(prompts: dict[str, list[str]], n: int, offset: int, prefix: str) -> list[Job]:
    """n jobs, the classes alternating, each class's prompts cycled."""
    cats, out = list(prompts), []
    for i in range(n):
        cat = cats[i % len(cats)]
        text = prompts[cat][(offset + i // len(cats)) % len(prompts[cat])]
        out.append((f"{prefix}-{i}", cat, workload.user(text)))
    return out


def run_pools(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    common = {"model": MODEL, "time_scale": args.time_scale, "cache_blocks": 0, "seed": args.seed}
    configs = [PoolConfig(name="spec", speculative=True, **common), PoolConfig(name="plain", **common)]
    t0 = time.perf_counter()
    with stubs(configs, tmp) as urls:
        # One gateway serves every arm (the same overheads for all; arms never overlap in time): the
        # model routes by policy; each pinned arm is a model name that one pool alone serves.
        spec = {"speculative": "ngram", "models": {MODEL: MODEL, ARM_MODELS["spec"]: MODEL}}
        plain = {"speculative": "off", "models": {MODEL: MODEL, ARM_MODELS["plain"]: MODEL}}
        backends = [backend("spec", urls["spec"], **spec), backend("plain", urls["plain"], **plain)]
        # `split`: the same two servers again, as one replica group under a model name of its own.
        split = {"replica_group": "both", "models": {ARM_MODELS["split"]: MODEL}}
        backends += [backend("spec-g", urls["spec"], speculative="ngram", **split)]
        backends += [backend("plain-g", urls["plain"], speculative="off", **split)]
        (d := tmp / "learned-data").mkdir()
        store = {"url": f"sqlite:///{d}/telemetry.db", "auto_upgrade": True, "spool_dir": str(d / "spool")}
        config = {"embedded": {"enabled": False}, "backends": backends, "policy": {"seed": args.seed}}
        # Affinity only matters for the split arm's group: the prompt's hash picks its pool.
        config |= {"telemetry": store, "affinity": {"mode": "session"}}
        with gateway("pools", config, tmp) as server:
            launch.log(f"pools: 2 stubs and the gateway up in {time.perf_counter() - t0:.0f} s")
            train_prompts, eval_prompts = pool_prompts(args.seed)
            training = explore_and_retrain(args, server.url, train_prompts)
            results, busy = evaluate(args, server.url, list(ARM_MODELS), eval_prompts)
    report = analyse_pools(results, busy, args.seed, training.get("pool_crossovers") or {})
    return {**report, "training": training, "seconds": round(time.perf_counter() - t0, 1)}


def explore_and_retrain(args: argparse.Namespace, url: str, prompts: dict[str, list[str]]) -> dict[str, Any]:
    """Training traffic explored at every batch, the gateway's retrain (forced if it declines), then
    exploration back to normal: whether a learned policy with both pools modelled is active."""
    admin = functools.partial(launch.admin, url, key=ADMIN_KEY)
    levels = [int(x) for x in args.train_levels.split(",")]
    counts = [int(x) for x in args.train_per_level.split(",")]
    counts = counts * len(levels) if len(counts) == 1 else counts
    total = sum(counts)
    explore = {"across_backends": True, "exploration_rate": 0.5, "exploration_cap": 1.0}
    bounds = {"min_train_rows": max(10, total // 2), "min_arm_rows": max(5, min(20, total // 8))}
    training = {**explore, **bounds, "max_batch_for_spec": 0, "note": "bench: training"}
    admin("PUT", "/admin/policy", training)
    routed: Counter[str] = Counter()
    for level, n in zip(levels, counts, strict=True):
        jobs = round_robin(prompts, n, level, f"train{level}")
        results = asyncio.run(batch(url, jobs, level, args.max_tokens))
        routed.update(str(r.route.get("arm", "?")) for r in results)
    launch.log(f"pools: {total} training requests at {levels} in flight: {dict(routed)}")
    time.sleep(2.0)  # the telemetry writer flushes every 0.2 s; leave it a few rounds
    retrain = admin("POST", "/admin/policy/retrain", {})
    declined = None if retrain.get("promoted") else retrain.get("reason")
    if declined is not None:
        retrain = admin("POST", "/admin/policy/retrain", {"force": True})
    normal = {"exploration_rate": 0.05, "exploration_cap": 0.1, "max_batch_for_spec": 16}
    admin("PUT", "/admin/policy", {**normal, "note": "bench: exploration back"})
    policy = admin("GET", "/admin/policy")
    modelled = policy.get("modelled_arms") or []
    ok = policy.get("kind") == "learned" and SPEC_ARM in modelled and PLAIN_ARM in modelled
    launch.log(f"pools: retrain {'promoted' if declined is None else f'declined ({declined}), forced'}")
    if not ok:
        launch.log("pools: WARNING: no learned policy with both arms modelled is active; evaluating anyway")
    kept = ("version", "promoted", "reason", "train_rows", "off_policy")
    out = {"requests": total, "levels": levels, "routed": dict(routed), "declined": declined}
    out |= {"retrain": {k: retrain.get(k) for k in kept}, "active_kind": policy.get("kind")}
    out["modelled_arms"] = modelled
    return {**out, "pool_crossovers": policy.get("pool_crossovers"), "learned_with_both_arms": ok}


def evaluate(
    args: argparse.Namespace, url: str, arms: list[str], prompts: dict[str, list[str]]
) -> tuple[ByLevel, dict[str, float]]:
    """results[level][arm]: the level's requests in the same order for every arm; and per request
    its batch's wall time over the batch's requests (for throughput)."""
    levels = {
        "light": (args.light, args.light_batch, args.light_batches),
        "heavy": (args.heavy, 2 * args.heavy, args.heavy_batches),
    }
    out: ByLevel = {}
    busy: dict[str, float] = {}
    k = 0
    for level, (concurrency, size, batches) in levels.items():
        out[level] = {a: [] for a in arms}
        items = round_robin(prompts, size * batches, 7 if level == "heavy" else 0, "")
        for b in range(batches):
            for arm in arms[k % len(arms) :] + arms[: k % len(arms)]:
                part = items[b * size : (b + 1) * size]
                jobs = [(f"{level}{b}-{arm}-{i}", c, m) for i, (_, c, m) in enumerate(part)]
                t0 = time.perf_counter()
                res = asyncio.run(batch(url, jobs, concurrency, args.max_tokens, ARM_MODELS[arm]))
                busy.update({r.request_id: (time.perf_counter() - t0) / len(res) for r in res})
                out[level][arm] += res
            k += 1
            launch.log(f"pools: {level} batch {b + 1}/{batches}: {size} requests, {concurrency} in flight")
    return out, busy


def _group_stats(rows: ByArm, idx: list[int], busy: dict[str, float], seed: int) -> dict[str, Any]:
    arms = list(rows)
    g = {a: [rows[a][i].goodput for i in idx] for a in arms}
    means = {a: sum(g[a]) / len(idx) for a in arms}
    best = max(("spec", "plain"), key=lambda a: means[a])
    learned = [rows["learned"][i] for i in idx]
    pairs = list(zip(*(g[a] for a in arms), strict=True))
    col = {a: k for k, a in enumerate(arms)}

    def avg(sample: Rows, arm: str) -> float:
        return sum(p[col[arm]] for p in sample) / len(sample)

    def throughput(a: str) -> float:
        seconds = sum(busy[rows[a][i].request_id] for i in idx)
        return round(sum(rows[a][i].output_tokens for i in idx) / seconds, 1)

    out: dict[str, Any] = {"n": len(idx), "explored": sum(bool(r.route.get("explored")) for r in learned)}
    out["learned_to_spec"] = round(sum(r.route.get("backend") == "spec" for r in learned) / len(idx), 3)
    out["goodput"] = {a: round(means[a], 2) for a in arms}
    p50s = {a: percentile([ttft(rows[a][i]) * 1e3 for i in idx], 50) for a in arms}
    out["ttft_p50_ms"] = {a: round(p50 or 0.0, 1) for a, p50 in p50s.items()}
    out |= {"throughput": {a: throughput(a) for a in arms}, "best_single": best}
    out["ratio"] = round(means["learned"] / means[best], 3)
    out["ci95"] = ratio_interval(
        pairs, lambda s: avg(s, "learned") / max(avg(s, "spec"), avg(s, "plain")), seed
    )
    split = sum(str(rows["split"][i].route.get("backend")).startswith("spec") for i in idx)
    out["split_to_spec"] = round(split / len(idx), 3)
    out["vs_split"] = round(means["learned"] / means["split"], 3)
    out["vs_split_ci95"] = ratio_interval(pairs, lambda s: avg(s, "learned") / avg(s, "split"), seed + 1)
    return out


def past_crossover(results: ByLevel, crossovers: dict[str, float], constant: int = 16) -> dict[str, Any]:
    """The learned arm's requests at each level split by whether the speculative pool's own batch
    (metrics.route.pool_batches) had passed the class's measured crossover (else the rules'
    constant) when the policy decided: how many went to `spec` on each side."""
    out: dict[str, Any] = {}
    for level, rows in results.items():
        counts = {True: [0, 0], False: [0, 0]}  # past: [requests, to spec]
        for r in rows["learned"]:
            batches = r.route.get("pool_batches") or {}
            if (key := next((k for k in batches if k.startswith("spec:")), None)) is not None:
                past = batches[key] >= crossovers.get(f"{r.route.get('workload_class')}:{key}", constant)
                counts[past][0] += 1
                counts[past][1] += r.route.get("backend") == "spec"
        (before, before_spec), (past_n, past_spec) = counts[False], counts[True]
        out[level] = {"before": before, "before_to_spec": round(before_spec / before, 3) if before else None}
        out[level] |= {"past": past_n, "past_to_plain": round(1 - past_spec / past_n, 3) if past_n else None}
    return out


def analyse_pools(
    results: ByLevel, busy: dict[str, float], seed: int, crossovers: dict[str, float]
) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for level, by_arm in results.items():
        for grp in ("copy-heavy", "others", "all"):
            heavy = [(r.category in COPY_HEAVY) == (grp == "copy-heavy") for r in by_arm["learned"]]
            if idx := [i for i, yes in enumerate(heavy) if grp == "all" or yes]:
                rows[f"{level}/{grp}"] = _group_stats(by_arm, idx, busy, seed)
    # Both levels together: every request once, each arm's mean goodput over all of them.
    merged = {a: [r for level in results.values() for r in level[a]] for a in next(iter(results.values()))}
    rows["both/all"] = _group_stats(merged, list(range(len(merged["learned"]))), busy, seed)
    light, overall = rows.get("light/copy-heavy"), rows["both/all"]
    crossing = past_crossover(results, crossovers)
    heavy = crossing.get("heavy", {})
    to_spec = bool(light and light["learned_to_spec"] >= 0.75)
    to_plain = bool(heavy.get("past") and (heavy.get("past_to_plain") or 0.0) >= 0.75)
    beats = overall["ratio"] >= 1.10 and overall["ci95"][0] > 1.0
    goals = {
        "light load: learned sends >= 75% of copy-heavy requests to spec": to_spec,
        # With two pools the plain one cannot take all the heavy traffic without becoming the
        # bottleneck: the policy turns to it as the speculative pool's own batch passes the class's
        # crossover, which is what "plain under heavy load" asks of a per-request choice.
        "heavy load: past the spec pool's crossover, learned sends >= 75% to plain": to_plain,
        "learned >= 1.10x the better single pool, interval above 1": beats,
    }
    return {"table": rows, "goals": goals, "crossing": crossing}


# ---- part 2: shared prefix over replicas -----------------------------------------------------------


@dataclass(slots=True)
class Turn:
    key: str
    family: int
    question: int  # the first turn's question (an index into the question pool)
    follow_of: str | None = None  # a follow-up: the key of the first turn it continues


def families(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """System prompts (one per family) and the question pool."""
    texts = workload.category_texts()
    docs = [t for t in texts["summarization"] + texts["rag"] if len(t) >= args.system_chars // 2]
    systems = [
        f"{PREAMBLE if f < args.shared_families else ''}You are the help desk of team {f}. "
        f"Reference document {f}:\n\n{docs[f % len(docs)][: args.system_chars]}"
        for f in range(args.families)
    ]
    return systems, texts["qa"] + texts["open_chat"]


def prefix_rounds(args: argparse.Namespace, n_questions: int) -> list[list[Turn]]:
    """Round r: question r of every family (shuffled), and follow-ups of round r-1's first turns."""
    rng = random.Random(args.seed)
    rounds: list[list[Turn]] = []
    previous: list[Turn] = []
    for r in range(args.questions + 1):
        turns: list[Turn] = []
        if r < args.questions:
            order = list(range(args.families))
            rng.shuffle(order)
            turns += [Turn(f"f{f}-q{r}", f, (f * 7 + r * 3) % n_questions) for f in order]
        follows = [t for t in previous if rng.random() < args.follow_up_share]
        turns += [Turn(t.key + "-follow", t.family, t.question, t.key) for t in follows]
        rng.shuffle(turns)
        rounds.append(turns)
        previous = [t for t in turns if t.follow_of is None]
    return [r for r in rounds if r]


def run_prefix(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    replica = {"model": MODEL, "time_scale": args.time_scale, "seed": args.seed}
    replica |= {"cache_blocks": args.replica_cache_blocks, "prefill_ms_per_token": 0.2}
    configs = [PoolConfig(name=f"{mode}-r{i}", **replica) for mode in MODES for i in range(3)]
    systems, questions = families(args)
    rounds = prefix_rounds(args, len(questions))
    results: ByArm = {m: [] for m in MODES}
    with stubs(configs, tmp) as urls, contextlib.ExitStack() as stack:
        gateways = {}
        for mode in MODES:
            group = {"replica_group": "replicas", "speculative": "off"}
            replicas = [backend(name, urls[name], **group) for name in (f"{mode}-r{i}" for i in range(3))]
            config: dict[str, Any] = {"embedded": {"enabled": False}, "backends": replicas}
            affinity = {"enabled": False} if mode == "off" else {"mode": mode}
            config |= {"telemetry": {"enabled": False}, "affinity": affinity, "policy": {"seed": args.seed}}
            gateways[mode] = stack.enter_context(gateway(f"affinity-{mode}", config, tmp)).url
        launch.log(f"prefix: 9 stubs and 3 gateways up in {time.perf_counter() - t0:.0f} s")
        answers: dict[str, dict[str, str]] = {m: {} for m in MODES}
        for k, turns in enumerate(rounds):
            for mode in MODES[k % len(MODES) :] + MODES[: k % len(MODES)]:
                jobs = [_job(t, systems, questions, answers[mode]) for t in turns]
                res = asyncio.run(
                    batch(gateways[mode], jobs, args.prefix_concurrency, args.prefix_max_tokens)
                )
                firsts = [(t, r) for t, r in zip(turns, res, strict=True) if t.follow_of is None]
                answers[mode].update({t.key: r.text for t, r in firsts})
                results[mode] += res
        stats = [httpx.get(f"{url}/stats", timeout=10, trust_env=False).json() for url in urls.values()]
    report = analyse_prefix(results, {s["name"]: s["requests"] for s in stats}, args.seed)
    return {**report, "seconds": round(time.perf_counter() - t0, 1), "rounds": len(rounds)}


def _job(t: Turn, systems: list[str], questions: list[str], answers: dict[str, str]) -> Job:
    messages = [{"role": "system", "content": systems[t.family]}, *workload.user(questions[t.question])]
    if t.follow_of is not None:  # the first turn, the answer this arm got, a new question
        messages += [{"role": "assistant", "content": answers[t.follow_of]}, *workload.user(FOLLOW_UP)]
    return t.key, f"family{t.family}", messages


def analyse_prefix(results: ByArm, served: dict[str, int], seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, rows in results.items():
        counts = [sum(r.route.get("backend") == f"{mode}-r{i}" for r in rows) for i in range(3)]
        # Why the gateway chose each replica (prefix mode: "prefix", "load" or "no match").
        why = ((r.route.get("affinity") or {}).get("prefix_reason") for r in rows)
        reasons = Counter(str(w or "session key") for w in why)
        ttfts = distribution(ttft(r) for r in rows)
        cached = sum(r.cached_tokens for r in rows) / max(1, sum(r.prompt_tokens for r in rows))
        out[mode] = {"requests": len(rows), "cached_share": round(cached, 4)}
        # The mean too: the median sits on the knee of a two-humped distribution (cached: tens of ms,
        # uncached: hundreds), and the mean moves less from run to run.
        out[mode] |= {f"ttft_{k}_ms": round(ttfts[k] or 0.0, 1) for k in ("p50", "p90", "mean")}
        busiest = round(max(counts) / (sum(counts) / 3), 3) if sum(counts) else None
        out[mode] |= {"per_replica": counts, "busiest_over_mean": busiest}
        out[mode]["stub_requests"] = [served[f"{mode}-r{i}"] for i in range(3)]
        out[mode]["affinity_reasons"] = dict(reasons)
    by_key = {mode: {r.request_id: ttft(r) for r in rows} for mode, rows in results.items()}
    for other in ("session", "off"):
        theirs = by_key[other]
        pairs: Rows = [(t, theirs[k]) for k, t in by_key["prefix"].items() if k in theirs]
        out[f"ttft_p50_{other}_over_prefix"] = round(_median_ratio(pairs), 3)
        out[f"ttft_{other}_ratio_ci95"] = ratio_interval(pairs, _median_ratio, seed)
    cut = 1.0 - out["prefix"]["ttft_p50_ms"] / out["session"]["ttft_p50_ms"]
    out["ttft_p50_cut"] = round(cut, 3)
    out["goals"] = {
        "prefix raises the cached share": out["prefix"]["cached_share"] > out["session"]["cached_share"],
        "prefix cuts median TTFT by >= 30%": cut >= 0.30,
        "prefix: busiest replica <= 1.25x mean": (out["prefix"]["busiest_over_mean"] or 99) <= 1.25,
    }
    return out


def _median_ratio(pairs: Rows) -> float:
    """Median of the second column over median of the first."""
    return (percentile([p[1] for p in pairs], 50) or 0.0) / (percentile([p[0] for p in pairs], 50) or 1.0)


# ---- report ---------------------------------------------------------------------------------------------


def pools_table(rep: dict[str, Any]) -> list[str]:
    arms = list(next(iter(rep["table"].values()))["goodput"])
    names = " / ".join(arms)
    head = ["load/group", "n", "to spec", f"goodput {names}", f"TTFT p50 ms {names}", f"tok/s total {names}"]
    head += ["learned / best pool [95%]", "learned / split [95%]"]
    rows = []
    for key, row in rep["table"].items():
        cells = [key, row["n"], f"{row['learned_to_spec']:.0%}"]
        cells += [
            " / ".join(f"{row[m][a]:.1f}" for a in arms) for m in ("goodput", "ttft_p50_ms", "throughput")
        ]
        cells.append(f"{row['ratio']:.2f}x {row['best_single']} [{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}]")
        rows.append([*cells, times(row["vs_split"], *row["vs_split_ci95"])])
    tr = rep["training"]
    how = "promoted" if tr["declined"] is None else f"declined ({tr['declined']}), forced"
    lines = ["Two pools: a learned policy across `spec` and `plain`, each pool alone, both split by hash", ""]
    lines += [*table(head, rows), ""]
    lines.append(
        f"training: {tr['requests']} requests at {tr['levels']} in flight, routed {tr['routed']}; "
        f"retrain {how}; active {tr['active_kind']}, modelled {tr['modelled_arms']}; "
        f"crossovers {tr['pool_crossovers']}"
    )
    for level, c in rep.get("crossing", {}).items():
        lines.append(
            f"{level}: learned requests with the spec pool's batch before its class crossover: {c['before']} "
            f"({c['before_to_spec']} to spec); past it: {c['past']} ({c['past_to_plain']} to plain)"
        )
    return lines + launch.goal_lines(rep["goals"].items())


def prefix_table(rep: dict[str, Any]) -> list[str]:
    head = ["mode", "requests", "cached share", "TTFT p50 / p90 / mean ms", "per replica", "busiest / mean"]
    rows = []
    for mode, r in ((mode, rep[mode]) for mode in MODES):
        ttfts = f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_mean_ms']:.0f}"
        rows.append([mode, r["requests"], f"{r['cached_share']:.1%}", ttfts, r["per_replica"]])
        rows[-1] += [f"{r['busiest_over_mean']:.2f}", r["affinity_reasons"]]
    lines = ["Shared prefix over 3 replicas: affinity.mode prefix, session, and affinity off", ""]
    lines += [*table([*head, "why this replica"], rows), ""]
    for other in ("session", "off"):
        ratio = times(rep[f"ttft_p50_{other}_over_prefix"], *rep[f"ttft_{other}_ratio_ci95"])
        lines.append(f"median TTFT {other} / prefix: {ratio}")
    lines.append(f"prefix cuts session's median TTFT by {rep['ttft_p50_cut']:.0%}")
    return lines + launch.goal_lines(rep["goals"].items())
