"""`specgate bench policy`: the routing policy under production-like traffic; does it beat every static
choice, with confidence? (bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import shutil
import statistics
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specgate.bench import launch, workload
from specgate.bench.client import POLICY, RequestResult, open_loop, send, spec_of
from specgate.bench.stats import t_interval, table

ADMIN_KEY = "bench-policy-admin"
# Routed by the gateway's policy, not forced. `learned_greedy` is the same retrained policy with
# `deviation_z` 0: it leaves the rules' arm wherever the model predicts better, sure or not.
POLICY_ARMS = ("rules", "learned", "learned_greedy")
FOLLOW_UP = "Thanks. Now go one step further and be more specific."
PERIODS = ("light", "medium", "overload")
CODE_CLASSES = ("code", "tool_call", "rag", "summarization")
CONV_CLASSES = ("open_chat", "qa", "translation", "math_reasoning", "summarization", "rag")
COPY_HEAVY = ("code", "summarization", "rag")
MIN_TOKENS = 16  # the floor of a request's max_tokens: the code trace asks for as few as 6 tokens
ACCEPTED_GOAL = 3.0
Runs = dict[str, list[list[RequestResult]]]  # [arm][repetition]: results in schedule order
PAIRED = (
    "learned_minus_best_static",
    "learned_minus_oracle",
    "overload_learned_minus_plain",
    "light_learned_minus_best_speculative",
    "rules_minus_best_static",
    "learned_minus_learned_greedy",
)


def _rates(text: str) -> tuple[float, ...]:
    with contextlib.suppress(ValueError):
        if len(rates := tuple(float(x) for x in text.split(","))) == len(PERIODS) and min(rates) > 0:
            return rates
    raise argparse.ArgumentTypeError(f"three rates > 0 (light,medium,overload), got {text!r}")


def _arms(text: str) -> str:
    if "plain" not in text.split(",") or len(text.split(",")) < 2:
        raise argparse.ArgumentTypeError("--arms needs plain and at least one proposer")
    try:
        [spec_of(arm) for arm in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _tokens(text: str) -> int:
    if int(text) < MIN_TOKENS:
        raise argparse.ArgumentTypeError(f"--max-tokens must be at least {MIN_TOKENS}")
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--code-requests", type=int, default=24, help="evaluation requests from the code trace")
    p.add_argument("--conv-requests", type=int, default=48, help="evaluation requests, conversation trace")
    p.add_argument("--train-code-requests", type=int, default=36, help="training requests, code trace")
    p.add_argument(
        "--train-conv-requests", type=int, default=72, help="training requests, conversation trace"
    )
    p.add_argument("--rates", type=_rates, default=(0.25, 1.0, 4.0), help="requests/s: light,medium,overload")
    p.add_argument("--max-in-flight", type=int, default=16, help="most requests in flight (open loop)")
    p.add_argument("--max-tokens", type=_tokens, default=64, help="cap on a request's max_tokens (floor 16)")
    p.add_argument("--sampled-share", type=float, default=0.3, help="requests at temperature 0.7-1.0")
    p.add_argument("--multi-turn-share", type=float, default=0.25, help="requests that are a second turn")
    p.add_argument("--train-exploration", type=float, default=0.75, help="training traffic's exploration")
    p.add_argument("--arms", type=_arms, default="plain,ngram,suffix,eagle", help="plain, METHOD, METHOD:kN")
    launch.options(p, reps=3, model=None, dtype=None, threads=None, compile=None, out="bench-out/policy")
    p.add_argument("--quick", action="store_true", help="6 + 12 evaluation, 12 + 24 training requests")


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """--quick's sizes (and one repetition), and the checks that need several options."""
    if args.quick:
        args.code_requests, args.conv_requests = 6, 12
        args.train_code_requests, args.train_conv_requests = 12, 24
        args.max_tokens, args.reps = 32, 1
    if min(args.code_requests, args.conv_requests) < 3:
        raise ValueError("each trace needs at least 3 evaluation requests (one per period)")
    return args


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
class Scheduled(Slot):
    """One request of a schedule: its slot, what it asks and at which temperature."""

    request: workload.BenchRequest = field(default_factory=lambda: workload.BenchRequest("", [], 0))
    temperature: float = 0.0


def _parts(trace: Sequence[workload.TraceRequest]) -> list[list[workload.TraceRequest]]:
    """Three consecutive parts of `trace`, equal when its length is a multiple of 3 (or the first longer)."""
    ends = [sum(len(trace) // 3 + (k < len(trace) % 3) for k in range(i + 1)) for i in range(3)]
    return [list(trace[start:end]) for start, end in zip([0, *ends[:2]], ends, strict=True)]


def _tagged(part: Sequence[workload.TraceRequest], rank: int, name: str) -> list[Any]:
    """A part's requests, each with its offset stretched onto [0, 1] (its bursts kept; all 0 if the
    part has no span) and the keys of the merge: (position, rank, index, name, request)."""
    start = part[0].offset if part else 0.0
    span = part[-1].offset - start if part else 0.0
    return [((t.offset - start) / span if span > 0 else 0.0, rank, i, name, t) for i, t in enumerate(part)]


def timeline(
    code: Sequence[workload.TraceRequest], conv: Sequence[workload.TraceRequest], rates: Sequence[float]
) -> list[Slot]:
    """The two traces merged into the light, medium and overload periods (a third of each trace a
    period), each request with its class, taken in turn from its trace's classes."""
    out: list[Slot] = []
    turn = {"code": 0, "conv": 0}
    for period, rate, code_part, conv_part in zip(PERIODS, rates, _parts(code), _parts(conv), strict=True):
        # Ties go to the code trace, then trace order: the merge is deterministic.
        merged = sorted(_tagged(code_part, 0, "code") + _tagged(conv_part, 1, "conv"), key=lambda e: e[:3])
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
    code = [CODE_CLASSES[k % len(CODE_CLASSES)] for k in range(n_code)]
    return Counter(code + [CONV_CLASSES[k % len(CONV_CLASSES)] for k in range(n_conv)])


def schedule(
    slots: Sequence[Slot],
    pools: Mapping[str, Sequence[workload.BenchRequest]],
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
            messages = [*messages, {"role": "assistant", "content": answer}, *workload.user(FOLLOW_UP)]
        temperature = rng.uniform(0.7, 1.0) if rng.random() < sampled_share else 0.0
        tokens = max(MIN_TOKENS, min(s.generated_tokens, max_tokens))
        req = workload.BenchRequest(src.category, messages, tokens, src.tools)
        out.append(Scheduled(**asdict(s), request=req, temperature=temperature))
    return out


def workload_of(args: argparse.Namespace) -> dict[str, list[Scheduled]]:
    """The training and the evaluation schedule: disjoint prompts and trace requests, seeded."""
    n_code, n_conv = args.code_requests, args.conv_requests
    code = workload.load_trace("code", limit=n_code + args.train_code_requests)
    conv = workload.load_trace("conv", limit=n_conv + args.train_conv_requests)
    if len(code) < n_code + args.train_code_requests or len(conv) < n_conv + args.train_conv_requests:
        raise ValueError(f"the traces hold {len(code)} code and {len(conv)} conversation requests")
    train, evaluation = demand(args.train_code_requests, args.train_conv_requests), demand(n_code, n_conv)
    per_class = max(train[c] + evaluation[c] for c in workload.CATEGORIES)
    by_class: dict[str, list[workload.BenchRequest]] = defaultdict(list)
    for req in workload.shipped(per_class, args.max_tokens):
        by_class[req.category].append(req)
    need = {c: train[c] + evaluation[c] for c in workload.CATEGORIES}
    if short := {c: f"{len(by_class[c])} < {n}" for c, n in need.items() if len(by_class[c]) < n}:
        raise ValueError(f"not enough shipped prompts (have < need): {short}; ask for fewer requests")
    # Per class, training takes the first prompts and evaluation the next: never the same prompt.
    train_pools = {c: by_class[c][: train[c]] for c in workload.CATEGORIES}
    eval_pools = {c: by_class[c][train[c] :] for c in workload.CATEGORIES}
    shares = (args.multi_turn_share, args.sampled_share)
    train_slots = timeline(code[n_code:], conv[n_conv:], args.rates)
    eval_slots = timeline(code[:n_code], conv[:n_conv], args.rates)
    return {
        "train": schedule(train_slots, train_pools, args.max_tokens, 1, *shares),
        "evaluation": schedule(eval_slots, eval_pools, args.max_tokens, 0, *shares),
    }


def describe(items: Sequence[Scheduled]) -> dict[str, Any]:
    """Per period: requests, mean rate, span, classes and trace mix (for the report)."""
    out: dict[str, Any] = {}
    for part in ([s for s in items if s.period == p] for p in PERIODS):
        if not part:
            continue
        span = part[-1].offset - part[0].offset
        about = {"requests": len(part), "rate": round((len(part) - 1) / span, 3) if span > 0 else None}
        about |= {"from_s": round(part[0].offset, 1), "to_s": round(part[-1].offset, 1)}
        about |= {"code_trace": sum(s.trace == "code" for s in part)}
        about["max_tokens_total"] = sum(s.request.max_tokens for s in part)
        out[part[0].period] = {**about, "classes": dict(sorted(Counter(s.category for s in part).items()))}
    return out


def held_out_classifier(
    evaluation: Sequence[workload.BenchRequest], out: Path
) -> tuple[Path, dict[str, Any]]:
    """A classifier trained without any dataset group that holds an evaluation prompt, or is in one."""
    from specgate.policies.training import dataset
    from specgate.policies.training.classifier import train_and_save

    texts = [str(m["content"]) for r in evaluation for m in r.messages if m["role"] == "user"]
    keys = [t.strip()[:200] for t in texts if t.strip() and t != FOLLOW_UP]
    rows = dataset.load()

    def same(key: str, text: str) -> bool:
        head = text.strip()[:200]
        return key in text or (len(head) >= 20 and head in key)

    dropped = {r["group"] for r in rows if any(same(k, r["text"]) for k in keys)}
    kept = [r for r in rows if r["group"] not in dropped]
    path = out / "classifier_heldout.npz"
    accuracy = round(train_and_save(kept, path).accuracy, 4)
    return path, {"groups_left_out": len(dropped), "rows": len(kept), "heldout_accuracy": accuracy}


@contextlib.contextmanager
def gateway(args: argparse.Namespace, run_dir: Path, data: Path | None, env: dict[str, str]) -> Iterator[str]:
    """`specgate serve` on --model over a copy of a telemetry directory (or a new one)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if data is not None:
        shutil.copytree(data, run_dir / "gateway-data", dirs_exist_ok=True)
    log, options = run_dir / "specgate.gateway.log", launch.serve_options(args)
    with launch.specgate(log, options, env=env, data=run_dir / "gateway-data") as server:
        yield server.url


async def replay(
    url: str, items: Sequence[Scheduled], arm: str, label: str, max_in_flight: int
) -> list[RequestResult]:
    """The schedule in an open loop under one arm (a policy arm leaves routing to the gateway)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    run = uuid.uuid4().hex[:6]
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        s = items[i]
        kind = POLICY if arm in POLICY_ARMS else arm
        res = await send(client, model, s.request, kind, f"{label}-{run}-{i}", s.temperature)
        res.arm = arm
        # Timed from the scheduled arrival: a request held back by --max-in-flight waits as it
        # would in the gateway's queue, and an arm that drains an overload slower pays for it.
        res.sent_at = min(res.sent_at, t0 + s.offset)
        return res

    results = await open_loop(one, [s.offset for s in items], max_in_flight)
    await client.close()
    if failed := [r.error for r in results if not r.ok]:
        raise RuntimeError(f"{len(failed)} requests failed in {label}: {failed[:3]}")
    return results


def accepted_length(r: RequestResult) -> float | None:
    """Tokens per verification step of one request (the bonus token included); None when it did
    not speculate (served plain, or its proposer never drafted)."""
    steps = r.spec.get("num_drafts") or 0
    return float((r.spec.get("num_accepted_tokens") or 0) + steps) / steps if steps else None


def analyse(res: Runs, periods: Sequence[str], static: Sequence[str]) -> dict[str, Any]:
    """res[arm][rep]: results in schedule order; periods[i]: the period of request i."""
    n = len(periods)
    classes = [r.category for r in next(iter(res.values()))[0]]
    reps = len(next(iter(res.values())))
    g = {arm: [[r.goodput for r in rr] for rr in runs] for arm, runs in res.items()}  # [arm][rep][i]
    masks = {"all": [True] * n, **{p: [q == p for q in periods] for p in PERIODS}}
    masks = {k: m for k, m in masks.items() if any(m)}

    def mean_of(values: list[list[float]], mask: list[bool]) -> float:
        return statistics.fmean(values[k][i] for k in range(reps) for i in range(n) if mask[i])

    def arm_ci(arm: str, mask: list[bool]) -> dict[str, float]:
        return t_interval(
            [statistics.fmean(x for x, m in zip(g[arm][k], mask, strict=True) if m) for k in range(reps)]
        )

    def paired(a: list[list[float]], b: list[list[float]], mask: list[bool]) -> dict[str, float]:
        """a - b request by request (and repetition), relative to b's mean."""
        diffs = [a[k][i] - b[k][i] for k in range(reps) for i in range(n) if mask[i]]
        base = mean_of(b, mask)
        return {k: v / base if k != "n" else v for k, v in t_interval(diffs, 1.96).items()}

    table_ = {arm: {name: arm_ci(arm, m) for name, m in masks.items()} for arm in res}
    best = max(static, key=lambda a: table_[a]["all"]["mean"])
    speculative = [a for a in static if a != "plain"]
    light = "light" in masks and speculative
    best_spec_light = max(speculative, key=lambda a: table_[a]["light"]["mean"]) if light else None
    # The per-class oracle: per class and period, the static arm with the best mean goodput.
    oracle_pick: dict[tuple[str, str], str] = {}
    for c, p in set(zip(classes, periods, strict=True)):
        mask = [classes[i] == c and periods[i] == p for i in range(n)]
        oracle_pick[(c, p)] = max(static, key=lambda a: mean_of(g[a], mask))
    oracle = [[g[oracle_pick[(classes[i], periods[i])]][k][i] for i in range(n)] for k in range(reps)]
    learned, every = g["learned"], masks["all"]
    out: dict[str, Any] = {"table": table_, "best_static": best, "best_speculative_light": best_spec_light}
    out["oracle_pick"] = {f"{c}@{p}": a for (c, p), a in sorted(oracle_pick.items())}
    out["oracle"] = {name: mean_of(oracle, m) for name, m in masks.items()}
    out["learned_minus_best_static"] = paired(learned, g[best], every)
    out["learned_minus_oracle"] = paired(learned, oracle, every)
    overload = "overload" in masks
    out["overload_learned_minus_plain"] = paired(learned, g["plain"], masks["overload"]) if overload else None
    out["light_learned_minus_best_speculative"] = (
        paired(learned, g[best_spec_light], masks["light"]) if best_spec_light else None
    )
    out["rules_minus_best_static"] = paired(g["rules"], g[best], every) if "rules" in g else None
    greedy = g.get("learned_greedy")
    out["learned_minus_learned_greedy"] = paired(learned, greedy, every) if greedy else None
    out["accepted_length"] = accepted_lengths(res)
    out["routes"] = {arm: _routes(res[arm], periods) for arm in POLICY_ARMS if arm in res}
    return out


def accepted_lengths(res: Runs) -> dict[str, dict[str, dict[str, Any]]]:
    """[arm][class]: the median accepted length over the requests that speculated (all periods and
    repetitions), how many did, and out of how many."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for arm, runs in res.items():
        total = Counter(r.category for rr in runs for r in rr)
        lengths: dict[str, list[float]] = {c: [] for c in total}
        for r in (r for rr in runs for r in rr):
            if (x := accepted_length(r)) is not None:
                lengths[r.category].append(x)
        out[arm] = {
            c: {"median": statistics.median(xs) if xs else None, "speculated": len(xs), "requests": total[c]}
            for c, xs in sorted(lengths.items())
        }
    return out


def _routes(runs: list[list[RequestResult]], periods: Sequence[str]) -> dict[str, dict[str, int]]:
    out: dict[str, Counter[str]] = defaultdict(Counter)
    for rr in runs:
        for r, p in zip(rr, periods, strict=True):
            out[f"{r.category}@{p}"][str(r.route.get("arm", "?")).split(":")[-1]] += 1
    return {k: dict(v) for k, v in sorted(out.items())}


def goals(rep: dict[str, Any]) -> list[tuple[str, bool]]:
    """The issue's goals, each with whether this run met it (a goal with nothing to judge is missed)."""
    best, oracle = rep["learned_minus_best_static"], rep["learned_minus_oracle"]
    overload, light = rep["overload_learned_minus_plain"], rep["light_learned_minus_best_speculative"]
    accepted = rep["accepted_length"].get("learned", {})
    medians = [accepted.get(c, {}).get("median") for c in COPY_HEAVY]
    best_text = f"learned at least 10% above the best static arm ({rep['best_static']}) over the whole trace"
    out = [(best_text + ", 95% interval above zero", best["mean"] >= 0.10 and best["low"] > 0)]
    oracle_text = "learned never more than 3% below the per-class-and-load oracle (mean of learned - oracle"
    out.append((oracle_text + " >= -3%)", oracle["mean"] >= -0.03))
    overload_text = "overload period: the interval of learned - plain includes or exceeds zero"
    out.append((overload_text, overload is not None and overload["high"] >= 0))
    light_text = "light period: the interval of learned - the best speculative static arm"
    light_text += f" ({rep['best_speculative_light']}) includes or exceeds zero"
    out.append((light_text, light is not None and light["high"] >= 0))
    median_text = f"median accepted length under learned at least {ACCEPTED_GOAL} on {', '.join(COPY_HEAVY)}"
    return [*out, (median_text, all(m is not None and m >= ACCEPTED_GOAL for m in medians))]


def markdown(rep: dict[str, Any], arms: Sequence[str]) -> str:
    names = [m for m in ("all", *PERIODS) if m in rep["oracle"]]

    def ci(x: dict[str, float], f: str = ".2f") -> str:
        return f"{x['mean']:{f}} [{x['low']:{f}}, {x['high']:{f}}]"

    rows = [[arm, *(ci(rep["table"][arm][p]) for p in names)] for arm in arms]
    lines = table(["arm", *names], [*rows, ["per-class oracle", *(f"{rep['oracle'][p]:.2f}" for p in names)]])
    lines += ["", "goodput per request, tok/s (mean over repetitions, [95% interval]); paired differences:"]
    for key, d in ((key, rep[key]) for key in PAIRED):
        lines.append(f"- {key}: " + (f"{ci(d, '+.1%')} over {d['n']} request pairs" if d else "n/a"))
    lines.append(
        f"- best static arm: {rep['best_static']}; best speculative in light: {rep['best_speculative_light']}"
    )
    lines += ["", "median accepted length (speculated / requests), all periods and repetitions:"]
    acc = rep["accepted_length"]

    def cell(a: dict[str, Any] | None) -> str:
        if a is None or a["median"] is None:
            return "-" if a is None else f"- (0/{a['requests']})"
        return f"{a['median']:.2f} ({a['speculated']}/{a['requests']})"

    classes = sorted({c for per in acc.values() for c in per})
    lines += table(["class", *arms], [[c, *(cell(acc.get(arm, {}).get(c)) for arm in arms)] for c in classes])
    return "\n".join([*lines, "", *launch.goal_lines(goals(rep))])


def run(args: argparse.Namespace) -> int:
    settle(args)
    admin = functools.partial(launch.admin, key=ADMIN_KEY)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    items = workload_of(args)
    evaluation, train = items["evaluation"], items["train"]
    clf, clf_info = held_out_classifier([s.request for s in evaluation], out)
    static = args.arms.split(",")
    env = {"SPECGATE_ADMIN_KEY": ADMIN_KEY, "SPECGATE_POLICY__SEED": "0"}
    env |= {"SPECGATE_POLICY__CLASSIFIER_PATH": str(clf), "SPECGATE_TELEMETRY__SPEC_STEPS_SAMPLE_RATE": "1.0"}
    # Training traffic through all three periods, routed by the rule policy exploring heavily (the
    # gateway logs each decision's propensity), the gateway's own retrain, exploration back to normal.
    with gateway(args, out / "train", None, env) as url:
        explore = {"exploration_rate": args.train_exploration, "exploration_cap": 1.0}
        bounds = {"min_train_rows": max(10, len(train) // 2), "min_arm_rows": 5}
        admin(url, "PUT", "/admin/policy", {**explore, **bounds, "note": "bench: training traffic"})
        asyncio.run(replay(url, train, "learned", "train", args.max_in_flight))  # unforced: the policy routes
        retrain = admin(url, "POST", "/admin/policy/retrain", {})
        if not retrain["promoted"]:
            declined = retrain["reason"]
            retrain = {**admin(url, "POST", "/admin/policy/retrain", {"force": True}), "declined": declined}
        normal = {"exploration_rate": 0.05, "exploration_cap": 0.1, "note": "bench: normal"}
        admin(url, "PUT", "/admin/policy", normal)
        policy = admin(url, "GET", "/admin/policy")
    launch.log(f"training: done at {(time.perf_counter() - t0) / 60:.1f} min")
    # Evaluation: a fresh process per arm and repetition, arms rotated between repetitions.
    arms = [*static, *POLICY_ARMS]
    res: Runs = {a: [] for a in arms}
    eval_env = {**env, "SPECGATE_TELEMETRY__SPEC_STEPS_SAMPLE_RATE": "0.05"}
    for rep in range(args.reps):
        for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
            run_dir = out / f"eval-{rep}-{arm}"
            with gateway(args, run_dir, out / "train" / "gateway-data", eval_env) as url:
                if arm == "rules":
                    admin(url, "POST", "/admin/policy/rollback/1")
                elif arm == "learned_greedy":
                    admin(url, "PUT", "/admin/policy", {"deviation_z": 0.0, "note": "bench: no margin"})
                res[arm].append(asyncio.run(replay(url, evaluation, arm, "eval", args.max_in_flight)))
            shutil.rmtree(run_dir / "gateway-data", ignore_errors=True)
            launch.log(f"rep {rep + 1}/{args.reps} {arm}: done at {(time.perf_counter() - t0) / 60:.1f} min")
    report = analyse(res, [s.period for s in evaluation], static)
    report["config"] = {k: v for k, v in vars(args).items() if k not in ("out", "func")}
    report["config"] |= {"schedule": {"evaluation": describe(evaluation), "train": describe(train)}}
    report["config"] |= {"classifier": clf_info, "step_cost": policy.get("step_cost")}
    keys = ("version", "promoted", "reason", "declined", "off_policy")
    report["config"]["retrain"] = {k: retrain.get(k) for k in keys}
    report["config"]["minutes"] = round((time.perf_counter() - t0) / 60, 1)
    (out / "policy_bench.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report, arms)
    (out / "policy_bench.md").write_text(text + "\n")
    how = f"declined ({retrain['declined']}), then forced" if "declined" in retrain else "promoted"
    sys.stdout.write(f"{text}\nschedule: {json.dumps(report['config']['schedule']['evaluation'])}\n")
    sys.stdout.write(f"classifier: {clf_info}\nretrain: {how}: {retrain.get('reason')}\n")
    sys.stdout.write(f"crossover: {(policy.get('step_cost') or {}).get('crossover_batch')}\n")
    sys.stdout.write(f"{report['config']['minutes']} min; report: {out / 'policy_bench.md'}\n")
    return 0
