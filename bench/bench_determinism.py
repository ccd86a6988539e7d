"""What deterministic mode costs, and what it buys, on the default model (bf16), one run.

    python bench/bench_determinism.py [--prompts 8] [--max-tokens 64]

For each mode (deterministic off, then on) the same greedy requests run:
- alone, one after another (the reference);
- all at once in one batch;
- all at once with each speculative method (ngram, suffix, eagle);
and the table counts how many outputs equal the reference. Speed rows: batch-1 decode tokens/s,
16 concurrent tokens/s, and TTFT of a long prompt (prefill). No prefix-cache sharing anywhere.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from specgate.bench.workloads import chat_prompts, round_robin
from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.params import SpecParams
from specgate.gateway.settings import default_cache_dir

METHODS = ("ngram", "suffix", "eagle")


def run(engine: Engine, prompts: list[list[int]], n: int, spec: SpecParams | None, concurrency: int):
    """(outputs by index, tokens, seconds, mean TTFT seconds)."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    outs: dict[int, list[int]] = {}
    ttfts: list[float] = []
    in_flight, tokens, tag = 0, 0, time.perf_counter()
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            i, ids = pending.pop(0)
            engine.add_request(f"{i}-{tag}", ids, params, spec, prefix_salt=None)
            in_flight += 1
        for o in engine.step():
            i = int(o.request_id.split("-")[0])
            outs.setdefault(i, []).extend(o.new_token_ids)
            tokens += len(o.new_token_ids)
            if o.finished:
                in_flight -= 1
                if o.stats.ttft is not None:
                    ttfts.append(o.stats.ttft)
    return outs, tokens, time.perf_counter() - start, sum(ttfts) / max(1, len(ttfts))


def _same(outs: dict[int, list[int]], ref: dict[int, list[int]]) -> str:
    return f"{sum(outs[i] == ref[i] for i in ref)}/{len(ref)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long-prompt-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    table: list[tuple[str, str, str]] = []
    for det in (False, True):
        engine = Engine(
            EngineConfig(convert_cache_dir=default_cache_dir(), num_threads=args.threads, deterministic=det)
        )
        prompts = [p for _, p in round_robin(chat_prompts(engine.tokenizer, 2, 400))][: args.prompts]
        long_prompt = [t for p in prompts for t in p][: args.long_prompt_tokens]
        run(engine, [prompts[0][:16]], 4, None, 1)  # warm-up
        label = "on" if det else "off"
        ref: dict[int, list[int]] = {}
        tokens = seconds = 0.0
        for i, p in enumerate(prompts):
            o, n, t, _ = run(engine, [p], args.max_tokens, None, 1)
            ref[i] = o[0]
            tokens, seconds = tokens + n, seconds + t
        table.append((label, "batch 1, tokens/s", f"{tokens / seconds:.1f}"))
        outs, n, t, _ = run(engine, prompts, args.max_tokens, None, 16)
        table.append((label, "16 concurrent, tokens/s", f"{n / t:.1f}"))
        table.append((label, "batched = alone", _same(outs, ref)))
        for method in METHODS:
            outs, n, t, _ = run(engine, prompts, args.max_tokens, SpecParams(method=method), 16)
            table.append((label, f"{method}, 16 concurrent = alone", _same(outs, ref)))
        _, _, _, ttft = run(engine, [long_prompt], 1, None, 1)
        table.append((label, f"TTFT, {len(long_prompt)}-token prompt, ms", f"{ttft * 1e3:.0f}"))
        del engine
    print(f"default model, bf16, {args.threads} threads, {args.prompts} prompts x {args.max_tokens} tokens\n")
    print("| deterministic | measure | value |\n|---|---|---|")
    for row in table:
        print(f"| {' | '.join(row)} |")


if __name__ == "__main__":
    main()
