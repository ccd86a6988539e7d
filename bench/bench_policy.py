"""The routing policy under production-like traffic: does it beat every static choice, with confidence?

    python bench/bench_policy.py [--quick] [--reps 3] [--model qwen2.5-coder-1.5b] [--arms plain,ngram,suffix]

The traffic is a replay of the Azure LLM inference traces of 2023 (bench/data/azure_llm_trace_2023),
the code and the conversation trace together, at their own arrival pattern scaled so that the
machine sees a light, a medium and an overload period, in that order:
  - requests: the first --code-requests of the code trace and the first --conv-requests of the
    conversation trace (the training traffic takes the requests that follow those). Each trace is cut
    into three consecutive equal parts, one per period; in a period the two parts are laid over the
    same window (each part's offsets stretched to it, its bursts kept) and merged by offset. Cutting
    before merging keeps both traces in every period: the code trace opens with a burst of a dozen
    requests and then half a minute of silence, so cutting the raw merged timeline would leave a
    whole period without code-trace requests.
  - rates: each period's inter-arrival gaps are scaled (bursts kept, as `arrivals.scale_trace` does)
    so that its mean rate is its value in --rates (requests/s; the defaults put one request at a
    time, near saturation and far past it for Qwen2.5-Coder-1.5B on two CPU cores, where a request
    of ~48 output tokens alone takes ~2 s); the periods follow one another, the first request of a
    period one mean gap of that period after the last of the one before.
  - prompts: a code-trace request takes the next prompt of the code-like classes (code, tool_call,
    rag, summarization) in turn, a conversation-trace request one of the conversational classes
    (open_chat, qa, translation, math_reasoning, summarization, rag), so that every class appears in
    every period; `max_tokens` is the trace's GeneratedTokens clipped to [16, --max-tokens]. A share
    of the requests are second turns of a conversation (--multi-turn-share), a share are sampled at
    temperature 0.7-1.0 (--sampled-share), seeded. Training and evaluation prompts are disjoint.

One run, in four phases:
  1. A classifier for this run, retrained without the evaluation prompts: every group (source item
     and its rephrasings) of the classifier's dataset holding an evaluation prompt is left out, so
     the policy classifies prompts it never saw (the report names them).
  2. Training traffic: a schedule of its own (the training prompts, the trace requests after the
     evaluation ones) through all three periods, on a fresh gateway whose telemetry samples every
     verification step, routed by the rule policy exploring most of its traffic
     (--train-exploration), so every arm is covered at every load and every decision's propensity
     is logged. Then POST /admin/policy/retrain: the gateway fits the goodput model and the step
     cost curve, and decides by its off-policy estimate whether to promote (a declined candidate is
     forced, and the report says so); exploration goes back to its defaults (5%, cap 10%).
  3. Evaluation: each arm on a fresh gateway process over a copy of that telemetry database (no
     arm sees another's answers or suffix caches), the arms in a rotated order in each of --reps
     repetitions. Arms: each static arm (forced with the `spec` extension: a method under the
     engine's goodput controller, or METHOD:kN, a fixed chain of N drafts a step, as vLLM's
     num_speculative_tokens runs it), `rules` (the fresh install's rule policy, version 1: the
     constant batch guard), `learned` (the retrained policy) and `learned_greedy` (the same with
     `deviation_z` 0). Every arm replays the same evaluation
     schedule (same prompts, offsets and temperatures) in an open loop, at most --max-in-flight
     requests in flight.
  4. Report, per arm and period (all, light, medium, overload): goodput per request (output tokens /
     seconds from the request's scheduled arrival to its last token, so queueing at the gateway and
     behind --max-in-flight is included) with a 95% interval over the repetitions; the per-class
     oracle (the best static arm of each class and period, measured here); request by request,
     paired, the learned policy minus the best static arm, minus the oracle, minus `plain` in the
     overload period and minus the best speculative static arm in the light period, with 95%
     intervals; the median accepted length (tokens per verification step, over the requests that
     speculated) per class and arm. Last, the issue's goals with PASS or MISS:
       - learned at least 10% above the best static arm over the whole trace, interval above zero;
       - learned never more than 3% below the per-class-and-load oracle (mean difference >= -3%);
       - overload period: the interval of learned - plain includes or exceeds zero;
       - light period: the interval of learned - the best speculative static arm includes or exceeds
         zero;
       - median accepted length under the learned policy at least 3.0 on each copy-heavy class
         (code, summarization, rag).
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
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from specgate.bench.serve import arrivals, datasets
from specgate.bench.serve.harness import start_local_gateway
from specgate.bench.serve.metrics import RequestResult
from specgate.bench.serve.runner import POLICY, open_loop, send, spec_of

ADMIN_KEY = "bench-policy-admin"
# Routed by the gateway's policy, not forced. `learned_greedy` is the same retrained policy with
# `deviation_z` 0: it leaves the rules' arm wherever the model predicts better, sure or not.
POLICY_ARMS = ("rules", "learned", "learned_greedy")
FOLLOW_UP = "Thanks. Now go one step further and be more specific."
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
PERIODS = ("light", "medium", "overload")
MASKS = ("all", *PERIODS)
CODE_CLASSES = ("code", "tool_call", "rag", "summarization")
CONV_CLASSES = ("open_chat", "qa", "translation", "math_reasoning", "summarization", "rag")
COPY_HEAVY = ("code", "summarization", "rag")
MIN_TOKENS = 16  # the floor of a request's max_tokens: the code trace asks for as few as 6 tokens
ACCEPTED_GOAL = 3.0


@dataclass(slots=True)
class Slot:
    """One request of the merged timeline, before it has a prompt."""

    offset: float  # seconds from the start of the replay
    period: str
    trace: str  # "code" or "conv": the trace it came from
    context_tokens: int
    generated_tokens: int
    category: str = ""


@dataclass(slots=True)
class Scheduled:
    """One request of a schedule: when it leaves, in which period, and what it asks."""

    offset: float
    period: str
    trace: str
    context_tokens: int
    generated_tokens: int
    request: datasets.BenchRequest
    temperature: float


def thirds(n: int) -> list[int]:
    """n split into three consecutive parts, equal when n is a multiple of 3 (else the first longer)."""
    return [n // 3 + (1 if i < n % 3 else 0) for i in range(3)]


def _parts(trace: Sequence[arrivals.TraceRequest]) -> list[list[arrivals.TraceRequest]]:
    out, at = [], 0
    for size in thirds(len(trace)):
        out.append(list(trace[at : at + size]))
        at += size
    return out


def _positions(part: Sequence[arrivals.TraceRequest]) -> list[float]:
    """A part's offsets stretched onto [0, 1], its bursts kept (all 0 if it has no span)."""
    if not part:
        return []
    span = part[-1].offset - part[0].offset
    return [(t.offset - part[0].offset) / span if span > 0 else 0.0 for t in part]


def timeline(
    code: Sequence[arrivals.TraceRequest], conv: Sequence[arrivals.TraceRequest], rates: Sequence[float]
) -> list[Slot]:
    """The two traces merged into the light, medium and overload periods (see the module docstring),
    each request with its class, taken in turn from its trace's classes."""
    if len(rates) != len(PERIODS) or any(r <= 0 for r in rates):
        raise ValueError(f"need {len(PERIODS)} rates > 0, got {list(rates)}")
    out: list[Slot] = []
    turn = {"code": 0, "conv": 0}
    for period, rate, code_part, conv_part in zip(PERIODS, rates, _parts(code), _parts(conv), strict=True):
        # Ties go to the code trace, then trace order: the merge is deterministic.
        merged = sorted(
            [
                (x, 0, i, "code", t)
                for i, (x, t) in enumerate(zip(_positions(code_part), code_part, strict=True))
            ]
            + [
                (x, 1, i, "conv", t)
                for i, (x, t) in enumerate(zip(_positions(conv_part), conv_part, strict=True))
            ],
            key=lambda e: (e[0], e[1], e[2]),
        )
        if not merged:
            continue
        span = merged[-1][0] - merged[0][0]
        # Gaps scaled so that (requests - 1) / span is the period's rate; no span: evenly spaced.
        factor = (len(merged) - 1) / rate / span if span > 0 else 0.0
        start = out[-1].offset + 1.0 / rate if out else 0.0
        for j, (x, _, _, name, t) in enumerate(merged):
            at = start + ((x - merged[0][0]) * factor if span > 0 else j / rate)
            classes = CODE_CLASSES if name == "code" else CONV_CLASSES
            category = classes[turn[name] % len(classes)]
            turn[name] += 1
            out.append(Slot(at, period, name, t.context_tokens, t.generated_tokens, category))
    return out


def demand(n_code: int, n_conv: int) -> Counter[str]:
    """Prompts of each class that a schedule of n_code + n_conv trace requests takes."""
    need: Counter[str] = Counter()
    for n, classes in ((n_code, CODE_CLASSES), (n_conv, CONV_CLASSES)):
        for k in range(n):
            need[classes[k % len(classes)]] += 1
    return need


def schedule(
    slots: Sequence[Slot],
    pools: Mapping[str, Sequence[datasets.BenchRequest]],
    max_tokens: int,
    seed: int,
    multi_turn_share: float,
    sampled_share: float,
) -> list[Scheduled]:
    """Each slot with the next unused prompt of its class, its max_tokens and its temperature."""
    rng = random.Random(seed)
    taken: Counter[str] = Counter()
    out: list[Scheduled] = []
    for s in slots:
        pool = pools.get(s.category, ())
        if taken[s.category] >= len(pool):
            raise ValueError(f"not enough {s.category} prompts: {len(pool)} for the schedule")
        src = pool[taken[s.category]]
        taken[s.category] += 1
        messages = list(src.messages)
        if not src.tools and rng.random() < multi_turn_share:
            answer = "Here is a first answer; ask if you want more detail."
            messages = [*messages, {"role": "assistant", "content": answer}, _user(FOLLOW_UP)]
        temperature = rng.uniform(0.7, 1.0) if rng.random() < sampled_share else 0.0
        tokens = max(MIN_TOKENS, min(s.generated_tokens, max_tokens))
        req = datasets.BenchRequest(src.category, messages, tokens, src.tools)
        out.append(
            Scheduled(s.offset, s.period, s.trace, s.context_tokens, s.generated_tokens, req, temperature)
        )
    return out


def workload(args: argparse.Namespace) -> dict[str, list[Scheduled]]:
    """The training and the evaluation schedule: disjoint prompts and trace requests, seeded."""
    n_code, n_conv = args.code_requests, args.conv_requests
    code = arrivals.load_trace("code", limit=n_code + args.train_code_requests)
    conv = arrivals.load_trace("conv", limit=n_conv + args.train_conv_requests)
    if len(code) < n_code + args.train_code_requests or len(conv) < n_conv + args.train_conv_requests:
        raise ValueError(f"the traces hold {len(code)} code and {len(conv)} conversation requests")
    need = {
        "train": demand(args.train_code_requests, args.train_conv_requests),
        "evaluation": demand(n_code, n_conv),
    }
    per_class = max(need["train"][c] + need["evaluation"][c] for c in datasets.CATEGORIES)
    by_class: dict[str, list[datasets.BenchRequest]] = defaultdict(list)
    for req in datasets.shipped(per_class, args.max_tokens):
        by_class[req.category].append(req)
    short = {
        c: f"{len(by_class[c])} < {need['train'][c] + need['evaluation'][c]}"
        for c in datasets.CATEGORIES
        if len(by_class[c]) < need["train"][c] + need["evaluation"][c]
    }
    if short:
        raise ValueError(f"not enough shipped prompts (have < need): {short}; ask for fewer requests")
    # Per class, training takes the first prompts and evaluation the next: never the same prompt.
    train_pools = {c: by_class[c][: need["train"][c]] for c in datasets.CATEGORIES}
    eval_pools = {c: by_class[c][need["train"][c] :] for c in datasets.CATEGORIES}
    rates = args.rates
    shares = (args.multi_turn_share, args.sampled_share)
    return {
        "train": schedule(
            timeline(code[n_code:], conv[n_conv:], rates), train_pools, args.max_tokens, 1, *shares
        ),
        "evaluation": schedule(
            timeline(code[:n_code], conv[:n_conv], rates), eval_pools, args.max_tokens, 0, *shares
        ),
    }


def describe(items: Sequence[Scheduled]) -> dict[str, Any]:
    """Per period: requests, mean rate, span, classes and trace mix (for the report)."""
    out: dict[str, Any] = {}
    for period in PERIODS:
        part = [s for s in items if s.period == period]
        if not part:
            continue
        span = part[-1].offset - part[0].offset
        out[period] = {
            "requests": len(part),
            "rate": round((len(part) - 1) / span, 3) if span > 0 else None,
            "from_s": round(part[0].offset, 1),
            "to_s": round(part[-1].offset, 1),
            "code_trace": sum(s.trace == "code" for s in part),
            "max_tokens_total": sum(s.request.max_tokens for s in part),
            "classes": dict(sorted(Counter(s.request.category for s in part).items())),
        }
    return out


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def held_out_classifier(
    evaluation: Sequence[datasets.BenchRequest], out: Path
) -> tuple[Path, dict[str, Any]]:
    """A classifier trained without any dataset group that holds an evaluation prompt."""
    from specgate.policies.training import dataset
    from specgate.policies.training.classifier import train_and_save

    texts = [str(m["content"]) for r in evaluation for m in r.messages if m["role"] == "user"]
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
    """`specgate serve` on --model over a copy of a telemetry directory (or a new one)."""

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


async def replay(
    url: str, items: Sequence[Scheduled], arm: str, label: str, args: argparse.Namespace
) -> list[RequestResult]:
    """The schedule in an open loop under one arm (a policy arm leaves routing to the gateway)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    run = uuid.uuid4().hex[:6]
    offsets = [s.offset for s in items]
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        s = items[i]
        res = await send(
            client,
            model,
            s.request,
            POLICY if arm in POLICY_ARMS else arm,
            f"{label}-{run}-{i}",
            s.temperature,
        )
        res.arm = arm
        # Timed from the scheduled arrival: a request held back by --max-in-flight waits as it
        # would in the gateway's queue, and an arm that drains an overload slower pays for it.
        res.sent_at = min(res.sent_at, t0 + offsets[i])
        return res

    def done() -> None:
        pass

    results = await open_loop(one, offsets, args.max_in_flight, done)
    await client.close()
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed in {label}: {failed[:3]}")
    return results


def goodput(r: RequestResult) -> float:
    return r.output_tokens / r.e2e if r.e2e else 0.0


def accepted_length(r: RequestResult) -> float | None:
    """Tokens per verification step of one request (the bonus token included); None when it did
    not speculate (served plain, or its proposer never drafted)."""
    spec = r.spec or {}
    steps = spec.get("num_drafts") or 0
    if not steps:
        return None
    return float((spec.get("num_accepted_tokens") or 0) + steps) / steps


def interval(values: list[float], t: float = 1.96) -> dict[str, float]:
    mean = statistics.fmean(values)
    half = t * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("inf")
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(values)}


def analyse(
    res: dict[str, list[list[RequestResult]]], periods: Sequence[str], static: Sequence[str]
) -> dict[str, Any]:
    """res[arm][rep]: results in schedule order; periods[i]: the period of request i. `static`
    must hold `plain`."""
    n = len(periods)
    classes = [r.category for r in next(iter(res.values()))[0]]
    reps = len(next(iter(res.values())))
    g = {arm: [[goodput(r) for r in rr] for rr in runs] for arm, runs in res.items()}  # [arm][rep][i]
    masks = {"all": [True] * n, **{p: [q == p for q in periods] for p in PERIODS}}
    masks = {k: m for k, m in masks.items() if any(m)}

    def arm_ci(arm: str, mask: list[bool]) -> dict[str, float]:
        per_rep = [
            statistics.fmean(x for x, m in zip(g[arm][k], mask, strict=True) if m) for k in range(reps)
        ]
        return interval(per_rep, T95.get(reps - 1, 1.96))

    table = {arm: {name: arm_ci(arm, m) for name, m in masks.items()} for arm in res}
    best_static = max(static, key=lambda a: table[a]["all"]["mean"])
    speculative = [a for a in static if a != "plain"]
    best_spec_light = (
        max(speculative, key=lambda a: table[a]["light"]["mean"])
        if speculative and "light" in masks
        else None
    )
    # The per-class oracle: per class and period, the static arm with the best mean goodput.
    oracle_pick: dict[tuple[str, str], str] = {}
    for c, p in set(zip(classes, periods, strict=True)):
        idx = [i for i in range(n) if classes[i] == c and periods[i] == p]
        oracle_pick[(c, p)] = max(
            static, key=lambda a: statistics.fmean(g[a][k][i] for k in range(reps) for i in idx)
        )
    oracle = [[g[oracle_pick[(classes[i], periods[i])]][k][i] for i in range(n)] for k in range(reps)]

    def paired(a: list[list[float]], b: list[list[float]], mask: list[bool]) -> dict[str, float]:
        """a - b request by request (and repetition), relative to b's mean."""
        diffs = [a[k][i] - b[k][i] for k in range(reps) for i in range(n) if mask[i]]
        base = statistics.fmean(b[k][i] for k in range(reps) for i in range(n) if mask[i])
        return {k: v / base if k != "n" else v for k, v in interval(diffs).items()}

    learned = g["learned"]
    out: dict[str, Any] = {
        "table": table,
        "best_static": best_static,
        "best_speculative_light": best_spec_light,
        "oracle_pick": {f"{c}@{p}": a for (c, p), a in sorted(oracle_pick.items())},
        "oracle": {
            name: statistics.fmean(oracle[k][i] for k in range(reps) for i in range(n) if m[i])
            for name, m in masks.items()
        },
        "learned_minus_best_static": paired(learned, g[best_static], masks["all"]),
        "learned_minus_oracle": paired(learned, oracle, masks["all"]),
        "overload_learned_minus_plain": (
            paired(learned, g["plain"], masks["overload"]) if "overload" in masks else None
        ),
        "light_learned_minus_best_speculative": (
            paired(learned, g[best_spec_light], masks["light"]) if best_spec_light else None
        ),
        "rules_minus_best_static": paired(g["rules"], g[best_static], masks["all"]) if "rules" in g else None,
        "learned_minus_learned_greedy": (
            paired(learned, g["learned_greedy"], masks["all"]) if "learned_greedy" in g else None
        ),
        "accepted_length": accepted_lengths(res),
        "routes": {arm: _routes(res[arm], periods) for arm in POLICY_ARMS if arm in res},
    }
    return out


def accepted_lengths(res: dict[str, list[list[RequestResult]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """[arm][class]: the median accepted length over the requests that speculated (all periods and
    repetitions), how many did, and out of how many."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for arm, runs in res.items():
        lengths: dict[str, list[float]] = defaultdict(list)
        total: Counter[str] = Counter()
        for rr in runs:
            for r in rr:
                total[r.category] += 1
                x = accepted_length(r)
                if x is not None:
                    lengths[r.category].append(x)
        out[arm] = {
            c: {
                "median": statistics.median(lengths[c]) if lengths[c] else None,
                "speculated": len(lengths[c]),
                "requests": total[c],
            }
            for c in sorted(total)
        }
    return out


def _routes(runs: list[list[RequestResult]], periods: Sequence[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for rr in runs:
        for r, p in zip(rr, periods, strict=True):
            out[f"{r.category}@{p}"][str(r.route.get("arm", "?")).split(":")[-1]] += 1
    return {k: dict(v) for k, v in sorted(out.items())}


def goals(rep: dict[str, Any]) -> list[tuple[str, bool]]:
    """The issue's goals, each with whether this run met it (a goal with nothing to judge is missed)."""
    best = rep["learned_minus_best_static"]
    overload = rep["overload_learned_minus_plain"]
    light = rep["light_learned_minus_best_speculative"]
    accepted = rep["accepted_length"].get("learned", {})
    medians = [accepted.get(c, {}).get("median") for c in COPY_HEAVY]
    return [
        (
            f"learned at least 10% above the best static arm ({rep['best_static']}) over the whole trace,"
            " 95% interval above zero",
            best["mean"] >= 0.10 and best["low"] > 0,
        ),
        (
            "learned never more than 3% below the per-class-and-load oracle"
            " (mean of learned - oracle >= -3%)",
            rep["learned_minus_oracle"]["mean"] >= -0.03,
        ),
        (
            "overload period: the interval of learned - plain includes or exceeds zero",
            overload is not None and overload["high"] >= 0,
        ),
        (
            f"light period: the interval of learned - the best speculative static arm"
            f" ({rep['best_speculative_light']}) includes or exceeds zero",
            light is not None and light["high"] >= 0,
        ),
        (
            f"median accepted length under learned at least {ACCEPTED_GOAL} on {', '.join(COPY_HEAVY)}",
            all(m is not None and m >= ACCEPTED_GOAL for m in medians),
        ),
    ]


PAIRED = (
    "learned_minus_best_static",
    "learned_minus_oracle",
    "overload_learned_minus_plain",
    "light_learned_minus_best_speculative",
    "rules_minus_best_static",
    "learned_minus_learned_greedy",
)


def markdown(rep: dict[str, Any], arms: Sequence[str]) -> str:
    names = [m for m in MASKS if m in rep["oracle"]]
    lines = ["| arm | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for arm in arms:
        row = rep["table"][arm]
        cells = [f"{row[p]['mean']:.2f} [{row[p]['low']:.2f}, {row[p]['high']:.2f}]" for p in names]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines.append("| per-class oracle | " + " | ".join(f"{rep['oracle'][p]:.2f}" for p in names) + " |")
    lines.append("")
    lines.append("goodput per request, tok/s (mean over repetitions, [95% interval]); paired differences:")
    for key in PAIRED:
        d = rep[key]
        if d is None:
            lines.append(f"- {key}: n/a")
            continue
        lines.append(
            f"- {key}: {d['mean']:+.1%} [{d['low']:+.1%}, {d['high']:+.1%}] over {d['n']} request pairs"
        )
    lines.append(
        f"- best static arm: {rep['best_static']}; best speculative in light: {rep['best_speculative_light']}"
    )
    lines.append("")
    acc = rep["accepted_length"]
    classes = sorted({c for per in acc.values() for c in per})
    lines.append("median accepted length (speculated / requests), all periods and repetitions:")
    lines += ["| class | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for c in classes:
        cells = []
        for arm in arms:
            a = acc.get(arm, {}).get(c)
            if a is None or a["median"] is None:
                cells.append("-" if a is None else f"- (0/{a['requests']})")
            else:
                cells.append(f"{a['median']:.2f} ({a['speculated']}/{a['requests']})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{'PASS' if ok else 'MISS'}: {name}" for name, ok in goals(rep)]
    return "\n".join(lines)


def run(args: argparse.Namespace, out: Path) -> int:
    t0 = time.perf_counter()
    items = workload(args)
    evaluation = items["evaluation"]
    clf, clf_info = held_out_classifier([s.request for s in evaluation], out)
    static = args.arms.split(",")
    env = {
        "SPECGATE_ADMIN_KEY": ADMIN_KEY,
        "SPECGATE_POLICY__SEED": "0",
        "SPECGATE_POLICY__CLASSIFIER_PATH": str(clf),
        "SPECGATE_TELEMETRY__SPEC_STEPS_SAMPLE_RATE": "1.0",
    }
    # 2. Training traffic through all three periods, routed by the rule policy exploring heavily
    # (the gateway logs each decision's propensity), then the gateway's own retrain, then
    # exploration back to normal.
    train = items["train"]
    gw = Gateway(args, out / "train", None, env)
    try:
        explore = {"exploration_rate": args.train_exploration, "exploration_cap": 1.0}
        bounds = {"min_train_rows": max(10, len(train) // 2), "min_arm_rows": 5}
        gw.admin("PUT", "/admin/policy", {**explore, **bounds, "note": "bench: training traffic"})
        asyncio.run(replay(gw.url, train, "learned", "train", args))  # unforced: the policy routes
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
    sys.stderr.write(f"training: done at {(time.perf_counter() - t0) / 60:.1f} min\n")
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
                results = asyncio.run(replay(gw.url, evaluation, arm, "eval", args))
            finally:
                gw.stop()
                shutil.rmtree(run_dir / "gateway-data", ignore_errors=True)
            res[arm].append(results)
            sys.stderr.write(
                f"rep {rep + 1}/{args.reps} {arm}: done at {(time.perf_counter() - t0) / 60:.1f} min\n"
            )
    rep_ = analyse(res, [s.period for s in evaluation], static)
    rep_["config"] = {
        **{k: v for k, v in vars(args).items() if k != "out"},
        "schedule": {"evaluation": describe(evaluation), "train": describe(train)},
        "classifier": clf_info,
        "retrain": {k: retrain.get(k) for k in ("version", "promoted", "reason", "declined", "off_policy")},
        "step_cost": policy.get("step_cost"),
        "minutes": round((time.perf_counter() - t0) / 60, 1),
    }
    (out / "policy_bench.json").write_text(json.dumps(rep_, indent=2, default=str))
    text = markdown(rep_, arms)
    (out / "policy_bench.md").write_text(text + "\n")
    how = f"declined ({retrain['declined']}), then forced" if "declined" in retrain else "promoted"
    sys.stdout.write(f"{text}\nschedule: {json.dumps(rep_['config']['schedule']['evaluation'])}\n")
    sys.stdout.write(f"classifier: {clf_info}\nretrain: {how}: {retrain.get('reason')}\n")
    sys.stdout.write(f"crossover: {(policy.get('step_cost') or {}).get('crossover_batch')}\n")
    sys.stdout.write(f"{rep_['config']['minutes']} min; report: {out / 'policy_bench.md'}\n")
    return 0


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not numbers: {text!r}") from None
    if len(rates) != len(PERIODS) or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"three rates > 0 (light,medium,overload), got {text!r}")
    return rates


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code-requests", type=int, default=24, help="evaluation requests from the code trace")
    p.add_argument(
        "--conv-requests", type=int, default=48, help="evaluation requests from the conversation trace"
    )
    p.add_argument(
        "--train-code-requests", type=int, default=36, help="training requests from the code trace"
    )
    p.add_argument(
        "--train-conv-requests", type=int, default=72, help="training requests from the conversation trace"
    )
    p.add_argument(
        "--rates",
        type=_rates,
        default=_rates("0.25,1.0,4.0"),
        help="requests/s of the light, medium and overload periods (default 0.25,1.0,4.0)",
    )
    p.add_argument("--max-in-flight", type=int, default=16, help="most requests in flight (open loop)")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on a request's max_tokens (floor 16)")
    p.add_argument("--sampled-share", type=float, default=0.3, help="requests at temperature 0.7-1.0")
    p.add_argument("--multi-turn-share", type=float, default=0.25, help="requests that are a second turn")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--train-exploration", type=float, default=0.75, help="training traffic's exploration rate"
    )
    p.add_argument(
        "--arms",
        default="plain,ngram,suffix,eagle",
        help="static arms: plain, proposer names (K by the controller), METHOD:kN (a fixed chain of N)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="embedded model: a name from bench/models.py (qwen2.5-coder-1.5b, ...) or a path"
        " (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", default=None)
    p.add_argument("--out", default="bench-out/policy")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 6 + 12 evaluation and 12 + 24 training requests, 32 tokens, 1 rep",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.code_requests, args.conv_requests = 6, 12
        args.train_code_requests, args.train_conv_requests = 12, 24
        args.max_tokens, args.reps = 32, 1
    static = args.arms.split(",")
    if "plain" not in static or len(static) < 2:
        p.error("--arms needs plain and at least one proposer")
    for arm in static:
        try:
            spec_of(arm)
        except ValueError as e:
            p.error(str(e))
    if args.max_tokens < MIN_TOKENS:
        p.error(f"--max-tokens must be at least {MIN_TOKENS}")
    if min(args.code_requests, args.conv_requests) < 3:
        p.error("each trace needs at least 3 evaluation requests (one per period)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from specgate.bench.models import resolve

    args.model = resolve(args.model)  # a bench/models.py name becomes its GGUF path (fetched once)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    return run(args, out)


if __name__ == "__main__":
    raise SystemExit(main())
