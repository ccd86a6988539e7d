"""Arms measured side by side with every server up at once, so that the drift of a shared machine
lands on every arm alike: 1 in flight, each prompt to every arm in turn (the order rotated, ratios
paired by prompt); N in flight, closed-loop phases in palindrome order (A B B A). `specgate bench
serve --peer` and `families serve` measure so (bench/README.md, "How specgate is measured beside
llama.cpp").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import openai
from pydantic import TypeAdapter

from specgate.bench import launch, models, stats
from specgate.bench.client import PEER, PLAIN, ByArm, OnDone, RequestResult, closed_loop, send, warm_up
from specgate.bench.stats import ms, number, percentile, table, times
from specgate.bench.workload import BenchRequest

T = TypeVar("T")
ALL = "all"  # the row of every class: the median over classes
LLAMA, LLAMA_SPEC = "llama-server", "llama-server+spec"
BEST = "best llama-server"  # the faster llama-server arm: per class at 1 in flight, per point at N


@dataclass(slots=True)
class Arm:
    """One way of serving the prompts: a server, the arm `client.send` knows it as (a specgate arm,
    or PEER for a server without specgate's fields), and the body fields its requests add."""

    name: str  # in tables and report.json
    base_url: str
    kind: str = PLAIN
    model: str = ""  # "": the server's first /v1/models
    extra: dict[str, Any] = field(default_factory=dict)
    reqs: Sequence[BenchRequest] | None = None  # the prompts as this server must get them, if not as sent
    client: Any = None


Send = Callable[[Arm, int, str], Awaitable[RequestResult]]


def rotation(items: Sequence[T], i: int) -> list[T]:
    """The order of prompt i: `items` rotated left by i."""
    k = i % len(items)
    return [*items[k:], *items[:k]]


def palindrome(items: Sequence[T]) -> list[T]:
    """A B C -> A B C C B A: a linear drift adds the same to every item's pair of phases."""
    return [*items, *items[::-1]]


@dataclass(slots=True)
class Sender:
    """Sends prompt i to an arm in a phase. Every request has a cache salt of its own, so that none
    finds a prompt in specgate's prefix cache (as llama-server arms say cache_prompt false). With
    sampling, prompt i carries seed + i to every arm: the same draw on every server that takes one."""

    run_id: str
    reqs: Sequence[BenchRequest]
    temperature: float = 0.0
    seed: int | None = None

    async def __call__(self, arm: Arm, i: int, phase: str) -> RequestResult:
        reqs = arm.reqs or self.reqs
        rid = f"{self.run_id}-{arm.name}-{phase}-{i}"
        seed = None if self.temperature == 0 or self.seed is None else self.seed + i
        req = reqs[i % len(reqs)]
        res = await send(arm.client, arm.model, req, arm.kind, rid, self.temperature, arm.extra, rid, seed)
        res.arm = arm.name  # send names it by kind: two llama-server arms are both PEER there
        return res


async def one_in_flight(arms: Sequence[Arm], n: int, send_one: Send, on_done: OnDone = lambda: None) -> ByArm:
    """Prompts 0..n-1, each to every arm in turn, the order rotated prompt by prompt. results[arm][k]
    of every arm answer the same prompt k."""
    results: ByArm = {a.name: [] for a in arms}
    for i in range(n):
        for arm in rotation(arms, i):
            results[arm.name].append(await send_one(arm, i, "c1"))
            on_done()
    return results


@dataclass(slots=True)
class Phase:
    arm: str
    seconds: float
    results: list[RequestResult]

    def summary(self) -> dict[str, Any]:
        tokens = sum(r.output_tokens for r in self.results if r.ok)
        failed = sum(not r.ok for r in self.results)
        out = {"arm": self.arm, "requests": len(self.results), "failed": failed, "seconds": self.seconds}
        return {**out, "tokens": tokens, "tok_s": tokens / self.seconds}


async def phases(
    arms: Sequence[Arm],
    n: int,
    in_flight: int,
    send_one: Send,
    on_done: OnDone = lambda: None,
    warm_up: bool = True,
) -> list[Phase]:
    """Closed loops of `n` requests at `in_flight`, one arm at a time, in palindrome order. First,
    unless `warm_up` is off, one untimed wave of `in_flight` requests to each arm: a server's first
    full batch pays what a warm one does not (first-time allocations, a step-cost curve not yet
    measured at this batch), and it would fall on the first arm's phase alone."""
    if warm_up:
        for arm in arms:

            def warm(i: int, arm: Arm = arm) -> Awaitable[RequestResult]:
                return send_one(arm, i, f"c{in_flight}-warm")

            await closed_loop(warm, in_flight, in_flight, on_done)
    out: list[Phase] = []
    for k, arm in enumerate(palindrome(arms)):

        def make(i: int, arm: Arm = arm, phase: str = f"c{in_flight}-{k}") -> Awaitable[RequestResult]:
            return send_one(arm, i, phase)

        t0 = time.perf_counter()
        results = await closed_loop(make, n, in_flight, on_done)
        out.append(Phase(arm.name, time.perf_counter() - t0, results))
    return out


def phase_means(done: Sequence[Phase], names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Per arm: aggregate output tokens/s of each of its phases, in order, and their mean."""
    rates = {name: [p.summary()["tok_s"] for p in done if p.arm == name] for name in names}
    return {name: {"tok_s": r, "tok_s_mean": sum(r) / len(r) if r else None} for name, r in rates.items()}


@contextlib.asynccontextmanager
async def connected(arms: Sequence[Arm]) -> AsyncIterator[None]:
    """Every arm's client open, its model named and one untimed request answered (closed after)."""
    try:
        for arm in arms:
            # One retry: llama-server drops a keep-alive connection idle for a few seconds (while the
            # other arms answer), and the next request on it fails before it is sent.
            url = f"{arm.base_url}/v1"
            arm.client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=1, timeout=1800)
            arm.model = arm.model or (await arm.client.models.list()).data[0].id
            await warm_up(arm.client, arm.model, arm.kind, arm.extra)
        yield
    finally:
        for arm in arms:
            if arm.client is not None:
                await arm.client.close()
                arm.client = None


async def at_point(arms: Sequence[Arm], measure: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """`measure()` with every arm connected, and the 1-minute load average before and after it."""
    async with connected(arms):
        load = os.getloadavg()[0]
        out = await measure()
        out["loadavg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    return out


def arm_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    errors = sorted({r.error for r in results if r.error})[:3]
    out = {"requests": len(results), "failed": len(results) - len(ok), "errors": errors}
    out |= {"tpot_ms": [round(t * 1e3, 2) for t in tpots], "tpot_p50_ms": ms(percentile(tpots, 50))}
    out["ttft_p50_ms"] = ms(percentile([r.ttft for r in ok if r.ttft is not None], 50))
    return {**out, "output_tokens": [r.output_tokens for r in ok]}


def class_tpot(results: Sequence[RequestResult]) -> dict[str, float | None]:
    """Median TPOT (ms) per class, classes in their order of appearance."""
    by: dict[str, list[float]] = {r.category: [] for r in results}
    for r in results:
        if r.ok and r.tpot is not None:
            by[r.category].append(r.tpot)
    return {cat: ms(percentile(ts, 50)) for cat, ts in by.items()}


def best_of(results: ByArm, names: Sequence[str]) -> tuple[list[RequestResult], dict[str, str]]:
    """Per class, which of the arms `names` has the lower median TPOT there; and the reference that
    answers each prompt with its class's best arm (its results stay paired prompt by prompt)."""
    medians = {n: class_tpot(results[n]) for n in names}
    first = results[names[0]]
    classes = dict.fromkeys(r.category for r in first)
    best = {c: min(names, key=lambda n: medians[n].get(c) or float("inf")) for c in classes}
    return [results[best[r.category]][k] for k, r in enumerate(first)], best


def _median_of_geomeans(groups: list[list[float]]) -> float | None:
    return percentile([g for g in (stats.geomean(x) for x in groups) if g is not None], 50)


def _estimate(
    groups: list[list[float]], stat: Callable[[list[list[float]]], float | None], resamples: int, seed: int
) -> dict[str, Any]:
    low, high = stats.bootstrap_interval(groups, stat, resamples, seed=seed) or (None, None)
    ratio = stat(groups) if groups else None
    return {"n": sum(len(g) for g in groups), "ratio": ratio, "low": low, "high": high}


def paired_ratios(
    arm: Sequence[RequestResult], reference: Sequence[RequestResult], resamples: int = stats.RESAMPLES
) -> dict[str, Any]:
    """TPOT_reference / TPOT_arm prompt by prompt (above 1: the arm is faster). Per class: their
    geometric mean and its 95% bootstrap interval (the class's prompts resampled); ALL: the median
    over classes of those, its interval from resampling within every class at once. `arm[k]` and
    `reference[k]` must answer the same prompt; pairs where either failed are left out."""
    by_class: dict[str, list[float]] = {}
    for a, r in zip(arm, reference, strict=True):
        if a.category != r.category:
            raise ValueError(
                f"unpaired results: {a.request_id} ({a.category}), {r.request_id} ({r.category})"
            )
        if a.ok and r.ok and a.tpot and r.tpot:
            by_class.setdefault(a.category, []).append(r.tpot / a.tpot)
    classes = {c: _estimate([xs], lambda g: stats.geomean(g[0]), resamples, 0) for c, xs in by_class.items()}
    overall = _estimate(list(by_class.values()), _median_of_geomeans, resamples, 0)
    return {"classes": classes, ALL: {**overall, "classes": len(by_class)}}


def row(r: RequestResult, **extra: Any) -> dict[str, Any]:
    """One request as report.json keeps it."""
    out = {**extra, "request_id": r.request_id, "arm": r.arm, "category": r.category, "ok": r.ok}
    out |= {"error": r.error, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}
    out |= {"ttft_ms": ms(r.ttft), "tpot_ms": ms(r.tpot), "e2e_ms": ms(r.e2e)}
    out |= {"num_drafts": r.spec.get("num_drafts"), "num_accepted_tokens": r.spec.get("num_accepted_tokens")}
    return {**out, "route": (r.route.get("spec") or {}).get("method") if r.route else None}


# ---- `specgate bench serve --peer` ---------------------------------------------------------------


def peer_request(req: BenchRequest, chat_template: str | None) -> BenchRequest:
    """The request as specgate's engine sees it. Where the chat template cannot render tools
    (SmolLM2's), specgate writes them into a system message; llama.cpp would drop them and answer a
    shorter prompt. So the peer gets them the way specgate renders them."""
    if not req.tools:
        return req
    from specgate.gateway.backends.embedded.chat_template import normalize_messages
    from specgate.gateway.protocol.schemas import Message

    parsed = TypeAdapter(list[Message]).validate_python(req.messages)
    template = SimpleNamespace(chat_template=chat_template)
    messages, tools = normalize_messages(template, parsed, req.tools, None)
    return BenchRequest(req.category, messages, req.max_tokens, tools, dict(req.extra))


@dataclass(slots=True)
class Peers:
    """llama.cpp on the same GGUF, once per setting (arm name: its flags), started afresh at each
    load point: its own llama-server (plain, and with its speculation), or llama-cpp-python's server
    (`exe` None), which serves one request at a time."""

    exe: Path | None
    gguf: Path
    threads: int
    per_slot: int  # context tokens a slot needs: the longest prompt and its answer
    least_ctx: int
    settings: dict[str, list[str]]
    body: dict[str, Any]
    reqs: list[BenchRequest]
    logs: Path

    @classmethod
    def of(cls, args: argparse.Namespace, reqs: Sequence[BenchRequest], out: Path) -> Peers:
        """The peers `--peer` names; a missing llama-server build says how to make one."""
        exe = launch.llama_server_binary(args.llama_server) if args.peer == "llama-server" else None
        gguf = models.gguf_path(args.model)
        per_slot = max(1024, 2 * max(r.approx_tokens for r in reqs) + args.max_tokens)
        template = models.chat_template(gguf)  # reading the file's header takes seconds: once
        peer_reqs = [peer_request(r, template) for r in reqs]
        common = (exe, gguf, args.threads or os.cpu_count() or 1, per_slot, args.peer_n_ctx)
        if args.peer == "llama-cpp":
            # llama-cpp-python's sampling defaults that differ from OpenAI's, off; the ends of
            # generation banned when every answer must be max_tokens long (it has no ignore_eos).
            body: dict[str, Any] = {"repeat_penalty": 1.0, "top_k": 0, "min_p": 0.0}
            if args.ignore_eos:
                body["logit_bias"] = {str(i): -100.0 for i in models.eog_token_ids(gguf)}
            return cls(*common, {PEER: []}, body, peer_reqs, out)
        spec = {LLAMA_SPEC: shlex.split(args.peer_spec)} if args.peer_spec.strip() else {}
        # llama-server's sampling defaults that differ from OpenAI's turned off, so that --temperature
        # samples the same distribution on every server; no prompt reuse.
        body = {"ignore_eos": args.ignore_eos, "cache_prompt": False, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
        return cls(*common, {LLAMA: [], **spec}, body, peer_reqs, out)

    def command(self, flags: Sequence[str], port: int, slots: int) -> list[str]:
        if self.exe is None:
            return launch.llama_cpp_command(self.gguf, port, self.threads, self.least_ctx)
        ctx = launch.ctx_size(slots, self.per_slot, self.least_ctx)
        return launch.llama_server_command(self.exe, self.gguf, port, self.threads, slots, ctx, flags)

    @contextlib.contextmanager
    def up(self, slots: int) -> Iterator[list[Arm]]:
        with contextlib.ExitStack() as stack:
            arms = []
            for name, flags in self.settings.items():
                port = launch.free_port()
                ready = f"http://127.0.0.1:{port}" + ("/health" if self.exe is not None else "/v1/models")
                log = self.logs / f"{name}-np{slots}.log"
                server = stack.enter_context(launch.running(self.command(flags, port, slots), log, ready))
                arms.append(Arm(name, server.url, PEER, self.gguf.stem, self.body, self.reqs))
            yield arms


def run_peers(args: argparse.Namespace, reqs: list[BenchRequest]) -> int:
    """specgate's arms (one gateway serves them all: each request names its arm) beside the peers,
    at each --concurrency point; report.json and report.md in --out."""
    from tqdm import tqdm

    if args.base_url:
        raise ValueError("--peer starts its own servers")
    out = Path(args.out)
    peers = Peers.of(args, reqs, out)
    points = [int(c) for c in args.concurrency.split(",") if c]
    out.mkdir(parents=True, exist_ok=True)
    sender = Sender(uuid.uuid4().hex[:8], reqs, args.temperature, args.seed)
    arms, llama = args.arms.split(","), list(peers.settings)
    per_phase = {p: args.requests_in_flight or 2 * p for p in points}
    total = sum(len(reqs) if p == 1 else 2 * per_phase[p] + p for p in points) * (len(arms) + len(llama))
    config = {"gguf": str(peers.gguf), "peer": str(peers.exe or "llama-cpp-python"), "arms": arms + llama}
    config |= {"llama_server_settings": peers.settings, "threads": peers.threads, "prompts": len(reqs)}
    config |= {"max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "temperature": args.temperature}
    config |= {"seed": args.seed if args.temperature else None, "command": launch.command_line()}
    config["bootstrap"] = {"resamples": stats.RESAMPLES, "seed": 0, "level": 0.95}
    report: dict[str, Any] = {"config": config, "points": []}
    # -v: the log says how the model is served.
    options, data = launch.serve_options(args), out / "gateway-data"
    gateway = launch.specgate(out / "specgate.gateway.log", options, data=data, verbose=True)
    with tqdm(total=total, desc="bench serve --peer", unit="req") as bar, gateway as server:
        report["specgate_ready_s"] = server.started_in
        body = {"ignore_eos": True} if args.ignore_eos else {}
        specgate = [Arm(a, server.url, a, args.model_name or "", body) for a in arms]
        for point in points:
            try:
                with peers.up(point) as peer_arms:
                    both = [*specgate, *peer_arms]
                    measure = partial(_measure, both, point, per_phase[point], sender, llama, bar.update)
                    result = asyncio.run(at_point(both, measure))
            except (RuntimeError, OSError, openai.APIError) as exc:  # keep the points measured: report, fail
                result = {"in_flight": point, "error": str(exc)}
            report["points"].append(result)
            (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
            (out / "report.md").write_text("\n".join(markdown(report)) + "\n")
    sys.stdout.write("\n".join(markdown(report)) + f"\nreport: {out / 'report.json'}\n")
    failed = any("error" in p or any(a.get("failed") for a in p["arms"].values()) for p in report["points"])
    return 1 if failed else 0


async def _measure(
    arms: list[Arm], point: int, per_phase: int, sender: Sender, llama: list[str], on_done: OnDone
) -> dict[str, Any]:
    if point == 1:
        return paired(await one_in_flight(arms, len(sender.reqs), sender, on_done), llama, sender.reqs)
    done = await phases(arms, per_phase, point, sender, on_done)
    return throughput(done, [a.name for a in arms], llama, point, per_phase)


def references(names: Sequence[str], llama: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(reference, the arms compared with it): specgate's plain and each llama.cpp arm against
    every other arm; the best llama-server setting against specgate's arms."""
    out = [(ref, [n for n in names if n != ref]) for ref in (PLAIN, *llama) if ref in names]
    return [*out, (BEST, [n for n in names if n not in llama])] if len(llama) > 1 else out


def paired(results: ByArm, llama: Sequence[str], reqs: Sequence[BenchRequest]) -> dict[str, Any]:
    """1 in flight: each arm's TPOT medians, and the paired ratio of every (arm, reference)."""
    names = list(results)
    best_ref, best = best_of(results, llama) if llama else ([], {})
    refs = {**results, BEST: best_ref}
    arms = {}
    for name, rs in results.items():
        short = sum(r.ok and r.output_tokens != reqs[k].max_tokens for k, r in enumerate(rs))
        arms[name] = {**arm_summary(rs), "tpot_p50_ms_by_class": class_tpot(rs), "not_max_tokens": short}
    versus = [(a, ref) for ref, compared in references(names, llama) for a in compared]
    pairs = [{"arm": a, "reference": ref, **paired_ratios(results[a], refs[ref])} for a, ref in versus]
    rows = [
        row(r, prompt=k, position=rotation(names, k).index(n))
        for n, rs in results.items()
        for k, r in enumerate(rs)
    ]
    return {"in_flight": 1, "arms": arms, "best_llama_server": best, "pairs": pairs, "requests": rows}


def throughput(
    done: list[Phase], names: list[str], llama: Sequence[str], point: int, per_phase: int
) -> dict[str, Any]:
    """N in flight: each phase's aggregate output tokens/s, each arm's mean, their ratios."""
    means = phase_means(done, names)
    tok = {n: means[n]["tok_s_mean"] for n in names}
    best = max(llama, key=lambda n: tok[n] or 0.0) if llama else None
    tok[BEST] = tok[best] if best else None
    arms = {n: {**means[n], "failed": sum(p.summary()["failed"] for p in done if p.arm == n)} for n in names}
    ratios = {ref: {a: stats.over(tok[a], tok[ref]) for a in cmp} for ref, cmp in references(names, llama)}
    out = {"in_flight": point, "requests_per_phase": per_phase, "phases": [p.summary() for p in done]}
    out |= {"arms": arms, "best_llama_server": best, "ratios": ratios}
    return {**out, "requests": [row(r, phase=k) for k, p in enumerate(done) for r in p.results]}


def _ratio(est: dict[str, Any] | None) -> str:
    return "-" if not est else times(est.get("ratio"), est.get("low"), est.get("high"))


def markdown(report: dict[str, Any]) -> list[str]:
    cfg = report["config"]
    servers = ", ".join(f"{k} {shlex.join(v)}".strip() for k, v in cfg["llama_server_settings"].items())
    lines = [
        "# specgate bench serve --peer",
        "",
        f"`{cfg['gguf']}`, {cfg['prompts']} prompts, {cfg['max_tokens']} tokens an answer "
        f"(ignore_eos {cfg['ignore_eos']}), temperature {cfg['temperature']}, llama.cpp -t "
        f"{cfg['threads']}: {servers}.",
        f"Command: `{cfg['command']}`",
        "",
    ]
    for point in report["points"]:
        if "error" in point:
            lines += [f"## {point['in_flight']} in flight: FAILED: {point['error']}", ""]
        else:
            lines += _one_in_flight(point) if point["in_flight"] == 1 else _many_in_flight(point)
    return lines


def _one_in_flight(point: dict[str, Any]) -> list[str]:
    arms, best, load = point["arms"], point["best_llama_server"], point["loadavg"]
    names = list(arms)
    classes = list(next(iter(arms.values()))["tpot_p50_ms_by_class"])
    count = {c: sum(r["arm"] == names[0] and r["category"] == c for r in point["requests"]) for c in classes}
    rows = [[c, count[c], *(number(arms[n]["tpot_p50_ms_by_class"][c]) for n in names)] for c in classes]
    rows.append([ALL, sum(count.values()), *(number(arms[n]["tpot_p50_ms"]) for n in names)])
    if best:
        rows = [[*r, best.get(r[0], "-")] for r in rows]
    lines = [f"## 1 in flight: every prompt to every arm in turn (load average {load[0]} -> {load[1]})", ""]
    lines += ["TPOT median, ms", "", *table(["class", "prompts", *names, *([BEST] if best else [])], rows)]
    for ref in dict.fromkeys(p["reference"] for p in point["pairs"]):
        pairs = {p["arm"]: p for p in point["pairs"] if p["reference"] == ref}
        lines += ["", f"Against {ref}: TPOT {ref} / TPOT arm, prompt by prompt; geometric mean per class "]
        lines[-1] += "[95% bootstrap interval]; above 1: the arm is faster"
        rows = [[c, *(_ratio(p["classes"].get(c)) for p in pairs.values())] for c in classes]
        rows.append(["median of classes", *(_ratio(p[ALL]) for p in pairs.values())])
        lines += ["", *table(["class", *pairs], rows)]
    if short := {n: a["not_max_tokens"] for n, a in arms.items() if a["not_max_tokens"]}:
        lines += ["", f"Answers not max_tokens long: {short} (their TPOT compares unequal lengths)"]
    return [*lines, *_failed(arms), ""]


def _many_in_flight(point: dict[str, Any]) -> list[str]:
    refs, load = list(point["ratios"]), point["loadavg"]
    order = " ".join(p["arm"] for p in point["phases"])
    lines = [
        f"## {point['in_flight']} in flight: {point['requests_per_phase']} requests a phase, "
        f"in order {order} (load average {load[0]} -> {load[1]})",
        "",
        "Aggregate output tokens/s; ratios: arm / reference, above 1: the arm is faster",
        "",
    ]
    rows = [
        [name, ", ".join(number(x) for x in a["tok_s"]), number(a["tok_s_mean"])]
        + [times(point["ratios"][r].get(name)) for r in refs]
        for name, a in point["arms"].items()
    ]
    lines += table(["arm", "tok/s by phase", "mean", *(f"vs {r}" for r in refs)], rows)
    return [*lines, *_failed(point["arms"]), ""]


def _failed(arms: dict[str, Any]) -> list[str]:
    failed = {name: a["failed"] for name, a in arms.items() if a["failed"]}
    return ["", f"Failed requests: {failed}"] if failed else []
