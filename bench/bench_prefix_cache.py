"""Prefix caching on vs off: TTFT of the turns that resend a prefix, on the default model, one run.

    python bench/bench_prefix_cache.py [--conversations 12] [--questions 12] [--answer-tokens 192]
                                       [--max-tokens 32] [--dtype bfloat16] [--deterministic]

Two engines on the same model, one with prefix caching and one without, take the same requests
one at a time, interleaved (conversation by conversation), so machine noise hits both alike:
- multi-turn: MT-bench's two-turn conversations (Spec-Bench's copy in bench/data): the first answer
  is up to --answer-tokens long, and the second turn resends the first question and that answer, as
  a chat client does;
- a shared system prompt: a long tool catalogue (BFCL function schemas) before short questions
  (Spec-Bench QA), as an agent or RAG template does.
The table gives TTFT p50 of the later turns / questions with and without the cache, their ratio,
the mean cached prompt tokens, and how many outputs are token-identical between the two engines
(expected all in fp32, or with --deterministic in any dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from specgate.bench.workloads import DATA
from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from specgate.gateway.backends.embedded.chat_template import render_chat
from specgate.gateway.settings import default_cache_dir


def generate(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """(output tokens, TTFT seconds, cached prompt tokens) of one request run alone."""
    rid = f"r{time.perf_counter_ns()}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    out: list[int] = []
    ttft, cached = 0.0, 0
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
            if o.finished:
                ttft, cached = o.stats.ttft or 0.0, o.stats.num_cached_tokens
    return out, ttft, cached


def conversations(n: int) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in (DATA / "spec_bench_dev.jsonl").read_text().splitlines()]
    return [(r["turns"][0], r["turns"][1]) for r in rows if len(r["turns"]) == 2][:n]


def tool_catalogue(max_chars: int) -> str:
    lines = ["You are an assistant with these tools. Call one when it helps; otherwise answer briefly."]
    for line in (DATA / "bfcl" / "BFCL_v4_multiple.json").read_text().splitlines():
        for fn in json.loads(line)["function"]:
            lines.append(json.dumps(fn))
            if sum(map(len, lines)) > max_chars:
                return "\n".join(lines)
    return "\n".join(lines)


def questions(n: int) -> list[str]:
    rows = [json.loads(line) for line in (DATA / "spec_bench_dev.jsonl").read_text().splitlines()]
    return [r["turns"][0] for r in rows if r["category"] == "qa"][:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--answer-tokens", type=int, default=192, help="length of the first turn's answers")
    ap.add_argument("--max-tokens", type=int, default=32, help="length of the measured answers")
    ap.add_argument("--system-chars", type=int, default=4000, help="length of the shared system prompt")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    def engine(cache: bool) -> Engine:
        return Engine(
            EngineConfig(
                dtype=args.dtype,
                convert_cache_dir=default_cache_dir(),
                num_threads=args.threads,
                prefix_caching=cache,
                deterministic=args.deterministic,
            )
        )

    engines = {"off": engine(False), "on": engine(True)}
    tok = engines["on"].tokenizer
    for e in engines.values():
        generate(e, render_chat(tok, [{"role": "user", "content": "Hi"}])[:8], 2)  # warm-up

    ttft: dict[tuple[str, str], list[float]] = {}
    cached: dict[str, list[int]] = {}
    same: dict[str, list[bool]] = {}

    def record(scenario: str, prompts: dict[str, list[int]], later: bool) -> dict[str, list[int]]:
        outs = {}
        for name, e in engines.items():
            out, t, c = generate(e, prompts[name], args.max_tokens if later else args.answer_tokens)
            outs[name] = out
            if later:
                ttft.setdefault((scenario, name), []).append(t)
                if name == "on":
                    cached.setdefault(scenario, []).append(c)
        if later:
            same.setdefault(scenario, []).append(outs["on"] == outs["off"])
        return outs

    for first, second in conversations(args.conversations):
        turn1 = [{"role": "user", "content": first}]
        t1 = render_chat(tok, turn1)
        answers = record("multi-turn", {"off": t1, "on": t1}, later=False)
        turn2 = {
            name: render_chat(
                tok,
                [
                    *turn1,
                    {"role": "assistant", "content": tok.decode(ans, skip_special_tokens=True)},
                    {"role": "user", "content": second},
                ],
            )
            for name, ans in answers.items()
        }
        record("multi-turn", turn2, later=True)

    system = tool_catalogue(args.system_chars)
    for i, q in enumerate(questions(args.questions)):
        ids = render_chat(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}])
        record("shared system prompt", {"off": ids, "on": ids}, later=i > 0)

    print(
        f"default model, {args.dtype}, deterministic {'on' if args.deterministic else 'off'}, "
        f"{args.threads} threads, first answers up to {args.answer_tokens} tokens, "
        f"measured answers {args.max_tokens} tokens\n"
    )
    print(
        "| scenario | later requests | TTFT p50 off (ms) | TTFT p50 on (ms) | off / on | "
        "cached tokens (mean) | identical outputs |"
    )
    print("|---|---|---|---|---|---|---|")
    for scenario in same:
        off = statistics.median(ttft[(scenario, "off")]) * 1e3
        on = statistics.median(ttft[(scenario, "on")]) * 1e3
        n = len(same[scenario])
        print(
            f"| {scenario} | {n} | {off:.0f} | {on:.0f} | {off / on:.1f}x | "
            f"{statistics.mean(cached[scenario]):.0f} | {sum(same[scenario])}/{n} |"
        )


if __name__ == "__main__":
    main()
