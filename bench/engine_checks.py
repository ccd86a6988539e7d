"""Two engine-level checks on one model, each its own command:
`specgate bench determinism`: what deterministic mode costs and buys on the default model;
`specgate bench prefix-cache`: TTFT of the turns that resend a prefix, with prefix caching on and
off, two engines on the same model, interleaved conversation by conversation.
(bench/README.md, "What each benchmark does", has the methods.)
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from specgate.bench import engine_run, launch, workload
from specgate.bench.stats import table
from specgate.engine.vocab import SpecParams
from specgate.gateway.backends.embedded.chat_template import render_chat

METHODS = ("ngram", "suffix", "eagle")


def add_determinism_arguments(p: argparse.ArgumentParser) -> None:
    launch.options(p, model=None, max_tokens=64, threads=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--long-prompt-tokens", type=int, default=1024)


def determinism(args: argparse.Namespace) -> int:
    reqs = workload.shipped(2, args.max_tokens, workload.CATEGORIES[:-1], max_prompt_tokens=400)
    rows = [row for det in (False, True) for row in _mode(args, det, reqs)]
    print(f"{args.prompts} prompts x {args.max_tokens} tokens\n")
    print("\n".join(table(["deterministic", "measure", "value"], rows)))
    return 0


def _mode(
    args: argparse.Namespace, det: bool, reqs: list[workload.BenchRequest]
) -> list[tuple[str, str, str]]:
    engine = engine_run.build(args.model, args.threads, deterministic=det)
    prompts = engine_run.prompt_ids(engine, reqs)[: args.prompts]
    long_prompt = [t for p in prompts for t in p][: args.long_prompt_tokens]

    def go(ps: list[list[int]], n: int, spec: SpecParams | None = None, c: int = 0) -> engine_run.Batch:
        return engine_run.run(engine, ps, n, spec, concurrency=c, prefix_salt=None)

    go([prompts[0][:16]], 4)  # warm-up
    label = "on" if det else "off"
    alone = [go([p], args.max_tokens) for p in prompts]
    ref = [b.answers[0].tokens for b in alone]
    rate = sum(b.tokens for b in alone) / sum(b.seconds for b in alone)
    together = go(prompts, args.max_tokens, c=16)
    rows = [(label, "batch 1, tokens/s", f"{rate:.1f}")]
    rows += [(label, "16 concurrent, tokens/s", f"{together.tokens / together.seconds:.1f}")]
    for name, spec in [("batched", None), *((f"{m}, 16 concurrent", SpecParams(method=m)) for m in METHODS)]:
        batch = together if spec is None else go(prompts, args.max_tokens, spec, 16)
        same = sum(a.tokens == r for a, r in zip(batch.answers, ref, strict=True))
        rows.append((label, f"{name} = alone", f"{same}/{len(ref)}"))
    ttft = go([long_prompt], 1).answers[0].stats.ttft or 0.0
    return [*rows, (label, f"TTFT, {len(long_prompt)}-token prompt, ms", f"{ttft * 1e3:.0f}")]


def add_prefix_cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--questions", type=int, default=12)
    p.add_argument("--answer-tokens", type=int, default=192, help="length of the first turn's answers")
    p.add_argument("--system-chars", type=int, default=4000, help="length of the shared system prompt")
    p.add_argument("--deterministic", action="store_true")
    launch.options(p, model=None, max_tokens=32, dtype="bfloat16", threads=None)


def tool_catalogue(max_chars: int) -> str:
    """BFCL's function schemas, one a line, up to `max_chars`: a long shared system prompt."""
    lines = ["You are an assistant with these tools. Call one when it helps; otherwise answer briefly."]
    for fn in (fn for row in workload.jsonl("bfcl/BFCL_v4_multiple.json") for fn in row["function"]):
        lines.append(json.dumps(fn))
        if sum(map(len, lines)) > max_chars:
            break
    return "\n".join(lines)


def prefix_cache(args: argparse.Namespace) -> int:
    config = {"dtype": args.dtype, "deterministic": args.deterministic}
    engines = {
        c: engine_run.build(args.model, args.threads, prefix_caching=c == "on", **config)
        for c in ("off", "on")
    }
    tok = engines["on"].tokenizer
    for e in engines.values():
        engine_run.run(e, [render_chat(tok, workload.user("Hi"))[:8]], 2, ignore_eos=False)  # warm-up
    ttft: dict[tuple[str, str], list[float]] = defaultdict(list)
    cached: dict[str, list[int]] = defaultdict(list)
    same: dict[str, list[bool]] = defaultdict(list)

    def record(scenario: str, prompts: dict[str, list[int]], later: bool) -> dict[str, list[int]]:
        outs = {}
        for name, e in engines.items():
            n = args.max_tokens if later else args.answer_tokens
            answer = engine_run.run(e, [prompts[name]], n, ignore_eos=False).answers[0]
            outs[name] = answer.tokens
            if later:
                ttft[(scenario, name)].append(answer.stats.ttft or 0.0)
                cached[scenario] += [answer.stats.num_cached_tokens] if name == "on" else []
        if later:
            same[scenario].append(outs["on"] == outs["off"])
        return outs

    rows = [r for r in workload.jsonl("spec_bench_dev.jsonl") if len(r["turns"]) == 2][: args.conversations]
    for first, second in (r["turns"] for r in rows):
        turn1 = workload.user(first)
        answers = record("multi-turn", dict.fromkeys(engines, render_chat(tok, turn1)), False)
        turn2 = {}
        for name, ans in answers.items():  # each engine's own first answer, resent
            reply = {"role": "assistant", "content": tok.decode(ans, skip_special_tokens=True)}
            turn2[name] = render_chat(tok, [*turn1, reply, *workload.user(second)])
        record("multi-turn", turn2, True)
    system = {"role": "system", "content": tool_catalogue(args.system_chars)}
    qa = [r["turns"][0] for r in workload.jsonl("spec_bench_dev.jsonl") if r["category"] == "qa"]
    for i, q in enumerate(qa[: args.questions]):
        prompt = render_chat(tok, [system, *workload.user(q)])
        record("shared system prompt", dict.fromkeys(engines, prompt), i > 0)
    det = "on" if args.deterministic else "off"
    lengths = f"first answers up to {args.answer_tokens} tokens, measured answers {args.max_tokens}"
    print(f"{args.dtype}, deterministic {det}, {lengths}\n")
    out = []
    for scenario, sames in same.items():
        off, on = (statistics.median(ttft[(scenario, c)]) * 1e3 for c in ("off", "on"))
        out.append([scenario, len(sames), f"{off:.0f}", f"{on:.0f}", f"{off / on:.1f}x"])
        out[-1] += [f"{statistics.mean(cached[scenario]):.0f}", f"{sum(sames)}/{len(sames)}"]
    head = ["scenario", "later requests", "TTFT p50 off (ms)", "TTFT p50 on (ms)", "off / on"]
    print("\n".join(table([*head, "cached tokens (mean)", "identical outputs"], out)))
    return 0
