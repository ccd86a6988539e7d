"""`specgate bench serve --peer llama-server`: specgate's arms beside llama.cpp's own server on the
same GGUF, plain and with its speculation, every server up at once and measured interleaved
(interleaved.py). At 1 in flight each prompt goes to every arm in rotating order, and arms compare
by paired TPOT ratios per class with 95% bootstrap intervals; at N in flight the arms take turns in
palindrome (A-B-B-A) phases and compare by aggregate output tokens/s.

One gateway serves every specgate arm (each request names its arm in its body: runner.arm_body) and
stays up for the whole run; llama-server runs once plain and once with --spec-default (or
--peer-spec), started afresh with -np N at each load point N. Every answer is max_tokens long
(ignore_eos on every server), no server reuses a cached prompt (specgate: a cache salt per request;
llama-server: cache_prompt false), and llama-server gets tools written the way specgate renders
them where the chat template cannot render tools (peer_arm.peer_request).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import openai
from tqdm import tqdm

from specgate.bench.serve import interleaved, llama_server, peer_arm, peer_server
from specgate.bench.serve.datasets import BenchRequest
from specgate.bench.serve.interleaved import ALL, Arm, Phase, Sender
from specgate.bench.serve.metrics import RequestResult, number, over
from specgate.bench.serve.peer_server import PEER
from specgate.bench.serve.runner import PLAIN

LLAMA, LLAMA_SPEC = "llama-server", "llama-server+spec"
BEST = "best llama-server"  # the faster llama-server arm: per class at 1 in flight, per point at N


@dataclass(slots=True)
class LlamaServers:
    """llama-server once per setting (arm name: its flags), started afresh at each load point."""

    exe: Path
    gguf: Path
    threads: int
    per_slot: int  # context tokens a slot needs: the longest prompt and its answer
    least_ctx: int
    settings: dict[str, list[str]]
    body: dict[str, Any]
    reqs: list[BenchRequest]
    logs: Path

    @contextlib.contextmanager
    def up(self, slots: int) -> Iterator[list[Arm]]:
        ctx = llama_server.ctx_size(slots, self.per_slot, self.least_ctx)
        with contextlib.ExitStack() as stack:
            arms = []
            for name, flags in self.settings.items():
                port = peer_server.free_port()
                url = f"http://127.0.0.1:{port}"
                cmd = llama_server.command(self.exe, self.gguf, port, self.threads, slots, ctx, flags)
                log = self.logs / f"{name}-np{slots}.log"
                stack.enter_context(peer_server.running(cmd, log, f"{url}/health"))
                arms.append(Arm(name, url, PEER, self.gguf.stem, self.body, self.reqs))
            yield arms


def run(args: argparse.Namespace, reqs: list[BenchRequest]) -> int:
    exe = llama_server.binary(args.llama_server)  # before anything starts: a missing build says how
    if args.base_url or args.arrival != "closed":
        raise ValueError("--peer llama-server starts its own servers and measures closed loops")
    gguf = peer_server.gguf_path(args.model)
    points = [int(c) for c in args.concurrency.split(",") if c]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings: dict[str, list[str]] = {LLAMA: []}
    if args.peer_spec.strip():
        settings[LLAMA_SPEC] = shlex.split(args.peer_spec)
    template = peer_server.chat_template(gguf)
    llama = LlamaServers(
        exe,
        gguf,
        args.threads or os.cpu_count() or 1,
        max(1024, 2 * max(r.approx_tokens for r in reqs) + args.max_tokens),
        args.peer_n_ctx,
        settings,
        # llama-server's sampling defaults that differ from OpenAI's (top_k 40, top_p 0.95, min_p 0.05)
        # turned off, so that --temperature samples the same distribution on every server.
        {"ignore_eos": args.ignore_eos, "cache_prompt": False, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
        [peer_arm.peer_request(r, template) for r in reqs],
        out,
    )
    port = peer_server.free_port()
    url = f"http://127.0.0.1:{port}"
    body = {"ignore_eos": True} if args.ignore_eos else {}
    specgate = [Arm(a, url, a, args.model_name or "", body) for a in args.arms.split(",")]
    sender = Sender(uuid.uuid4().hex[:8], reqs, args.temperature, args.seed)
    n_arms = len(specgate) + len(settings)
    per_phase = {p: args.requests_in_flight or 2 * p for p in points}
    total = sum(len(reqs) * n_arms if p == 1 else 2 * n_arms * per_phase[p] for p in points)
    report: dict[str, Any] = {"config": _config(args, llama, specgate, len(reqs)), "points": []}
    env = {**os.environ, "SPECGATE_DATA_DIR": str((out / "gateway-data").resolve())}
    gateway = peer_server.gateway_command(
        port, {f: getattr(args, f) for f in ("model", "dtype", "threads", "compile")}
    )
    with (
        tqdm(total=total, desc="bench serve --peer llama-server", unit="req") as bar,
        peer_server.running(gateway, out / "specgate.gateway.log", f"{url}/readyz", 600, env),
    ):
        for point in points:
            try:
                with llama.up(point) as peers:
                    arms = [*specgate, *peers]
                    measure = partial(
                        _measure, arms, point, per_phase[point], sender, list(settings), bar.update
                    )
                    result = asyncio.run(interleaved.at_point(arms, measure))
            except (RuntimeError, OSError, openai.APIError) as exc:  # keep the points measured: report, fail
                result = {"in_flight": point, "error": str(exc)}
            report["points"].append(result)
            _write(report, out)
    sys.stdout.write("\n".join(markdown(report)) + f"\nreport: {out / 'report.json'}\n")
    failed = any("error" in p or any(a.get("failed") for a in p["arms"].values()) for p in report["points"])
    return 1 if failed else 0


def _config(args: argparse.Namespace, llama: LlamaServers, specgate: list[Arm], n: int) -> dict[str, Any]:
    return {
        "gguf": str(llama.gguf),
        "llama_server": str(llama.exe),
        "llama_server_settings": llama.settings,
        "threads": llama.threads,
        "arms": [a.name for a in specgate] + list(llama.settings),
        "prompts": n,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed if args.temperature else None,
        "bootstrap": {"resamples": interleaved.RESAMPLES, "seed": interleaved.BOOTSTRAP_SEED, "level": 0.95},
        "command": "specgate bench serve "
        + shlex.join(sys.argv[3:] if sys.argv[1:3] == ["bench", "serve"] else sys.argv[1:]),
    }


async def _measure(
    arms: list[Arm],
    point: int,
    per_phase: int,
    sender: Sender,
    llama: list[str],
    on_done: Callable[[], None],
) -> dict[str, Any]:
    if point == 1:
        results = await interleaved.one_in_flight(arms, len(sender.reqs), sender, on_done=on_done)
        return paired(results, llama, sender.reqs)
    done = await interleaved.phases(arms, per_phase, point, sender, on_done=on_done)
    return throughput(done, [a.name for a in arms], llama, point, per_phase)


def references(names: Sequence[str], llama: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(reference, the arms compared with it): specgate's plain and each llama-server arm against
    every other arm; the best llama-server setting against specgate's arms."""
    refs = [r for r in (PLAIN, *llama) if r in names]
    out = [(ref, [n for n in names if n != ref]) for ref in refs]
    if len(llama) > 1:
        out.append((BEST, [n for n in names if n not in llama]))
    return out


def paired(
    results: dict[str, list[RequestResult]], llama: Sequence[str], reqs: Sequence[BenchRequest]
) -> dict[str, Any]:
    """1 in flight: each arm's TPOT medians, and the paired ratio of every (arm, reference)."""
    names = list(results)
    best_ref, best = interleaved.best_of(results, llama) if llama else ([], {})
    refs = {**{n: results[n] for n in names}, BEST: best_ref}
    arms = {}
    for name, rs in results.items():
        short = [r for k, r in enumerate(rs) if r.ok and r.output_tokens != reqs[k].max_tokens]
        arms[name] = {
            **interleaved.arm_summary(rs),
            "tpot_p50_ms_by_class": interleaved.class_tpot(rs),
            "not_max_tokens": len(short),
        }
    return {
        "in_flight": 1,
        "arms": arms,
        "best_llama_server": best,
        "pairs": [
            {"arm": a, "reference": ref, **interleaved.paired_ratios(results[a], refs[ref])}
            for ref, compared in references(names, llama)
            for a in compared
        ],
        "requests": [
            interleaved.row(r, prompt=k, position=interleaved.rotation(names, k).index(name))
            for name, rs in results.items()
            for k, r in enumerate(rs)
        ],
    }


def throughput(
    done: list[Phase], names: list[str], llama: Sequence[str], point: int, per_phase: int
) -> dict[str, Any]:
    """N in flight: each phase's aggregate output tokens/s, each arm's mean, their ratios."""
    means = interleaved.phase_means(done, names)
    tok = {n: means[n]["tok_s_mean"] for n in names}
    best = max(llama, key=lambda n: tok[n] or 0.0) if llama else None
    tok[BEST] = tok[best] if best else None
    return {
        "in_flight": point,
        "requests_per_phase": per_phase,
        "phases": [p.summary() for p in done],
        "arms": {
            n: {**means[n], "failed": sum(p.summary()["failed"] for p in done if p.arm == n)} for n in names
        },
        "best_llama_server": best,
        "ratios": {
            ref: {a: over(tok[a], tok[ref]) for a in compared} for ref, compared in references(names, llama)
        },
        "requests": [interleaved.row(r, phase=k) for k, p in enumerate(done) for r in p.results],
    }


def _ratio(est: dict[str, Any] | None) -> str:
    if not est or est.get("ratio") is None:
        return "-"
    if est.get("low") is None:
        return f"{est['ratio']:.2f}x"
    return f"{est['ratio']:.2f}x [{est['low']:.2f}, {est['high']:.2f}]"


def markdown(report: dict[str, Any]) -> list[str]:
    cfg = report["config"]
    servers = ", ".join(f"{k} {shlex.join(v)}".strip() for k, v in cfg["llama_server_settings"].items())
    lines = [
        "# specgate bench serve --peer llama-server",
        "",
        f"`{cfg['gguf']}`, {cfg['prompts']} prompts, {cfg['max_tokens']} tokens an answer "
        f"(ignore_eos {cfg['ignore_eos']}), temperature {cfg['temperature']}, llama-server -t "
        f"{cfg['threads']}: {servers}.",
        f"Command: `{cfg['command']}`",
        "",
    ]
    for point in report["points"]:
        if "error" in point:
            lines += [f"## {point['in_flight']} in flight: FAILED: {point['error']}", ""]
        elif point["in_flight"] == 1:
            lines += _one_in_flight(point)
        else:
            lines += _many_in_flight(point)
    return lines


def _one_in_flight(point: dict[str, Any]) -> list[str]:
    arms = point["arms"]
    names = list(arms)
    classes = list(next(iter(arms.values()))["tpot_p50_ms_by_class"])
    counts = {
        c: sum(1 for r in point["requests"] if r["arm"] == names[0] and r["category"] == c) for c in classes
    }
    best = point["best_llama_server"]
    lines = [
        f"## 1 in flight: every prompt to every arm in turn (load average {point['loadavg'][0]} -> "
        f"{point['loadavg'][1]})",
        "",
        "TPOT median, ms",
        "",
        "| class | prompts | " + " | ".join(names) + (f" | {BEST} |" if best else " |"),
        "|---|---|" + "---|" * (len(names) + bool(best)),
    ]
    for c in classes:
        cells = [number(arms[n]["tpot_p50_ms_by_class"][c]) for n in names] + ([best[c]] if best else [])
        lines.append(f"| {c} | {counts[c]} | " + " | ".join(cells) + " |")
    overall = [number(arms[n]["tpot_p50_ms"]) for n in names] + (["-"] if best else [])
    lines.append(f"| {ALL} | {sum(counts.values())} | " + " | ".join(overall) + " |")
    for ref in dict.fromkeys(p["reference"] for p in point["pairs"]):
        pairs = {p["arm"]: p for p in point["pairs"] if p["reference"] == ref}
        lines += [
            "",
            f"Against {ref}: TPOT {ref} / TPOT arm, prompt by prompt; geometric mean per class "
            "[95% bootstrap interval]; above 1: the arm is faster",
            "",
            "| class | " + " | ".join(pairs) + " |",
            "|---|" + "---|" * len(pairs),
        ]
        for c in classes:
            lines.append(f"| {c} | " + " | ".join(_ratio(p["classes"].get(c)) for p in pairs.values()) + " |")
        lines.append("| median of classes | " + " | ".join(_ratio(p[ALL]) for p in pairs.values()) + " |")
    short = {n: a["not_max_tokens"] for n, a in arms.items() if a["not_max_tokens"]}
    failed = {n: a["failed"] for n, a in arms.items() if a["failed"]}
    if short:
        lines += ["", f"Answers not max_tokens long: {short} (their TPOT compares unequal lengths)"]
    if failed:
        lines += ["", f"Failed requests: {failed}"]
    return [*lines, ""]


def _many_in_flight(point: dict[str, Any]) -> list[str]:
    n = point["in_flight"]
    refs = list(point["ratios"])
    order = " ".join(p["arm"] for p in point["phases"])
    lines = [
        f"## {n} in flight: {point['requests_per_phase']} requests a phase, in order {order} (load average "
        f"{point['loadavg'][0]} -> {point['loadavg'][1]})",
        "",
        "Aggregate output tokens/s; ratios: arm / reference, above 1: the arm is faster",
        "",
        "| arm | tok/s by phase | mean | " + " | ".join(f"vs {r}" for r in refs) + " |",
        "|---|---|---|" + "---|" * len(refs),
    ]
    for name, a in point["arms"].items():
        ratios = [point["ratios"][r].get(name) for r in refs]
        cells = [", ".join(number(x) for x in a["tok_s"]), number(a["tok_s_mean"])]
        cells += ["-" if x is None else f"{x:.2f}x" for x in ratios]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    failed = {name: a["failed"] for name, a in point["arms"].items() if a["failed"]}
    if failed:
        lines += ["", f"Failed requests: {failed}"]
    return [*lines, ""]


def _write(report: dict[str, Any], out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "report.md").write_text("\n".join(markdown(report)) + "\n")
