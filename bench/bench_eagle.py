"""EAGLE against n-gram, suffix and plain decoding on the default model, per workload class.

    python bench/bench_eagle.py [--per-class 4] [--max-tokens 128] [--head DIR] [--quick]

Batch 1, greedy, the serving dtype (bfloat16 on CPU). The prompts are the held-out side of the
split the shipped head was trained on (`gateway.eagle.data.prompts`), so the head never saw them
or a rephrasing of them. For each prompt every arm runs back to back, each arm in its own engine
(nothing one arm learns helps another). Reported per class and arm: tokens/s, the ratio to plain,
and the mean accepted length (tokens per verification step, the bonus token included).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.params import SpecParams
from specgate.gateway.settings import default_cache_dir
from specgate.gateway.training.eagle.data import chat_ids, prompts

ARMS: dict[str, SpecParams | None] = {
    "plain": None,
    "ngram dyn": SpecParams("ngram", controller="goodput", k_max=10),
    "suffix dyn": SpecParams("suffix", controller="goodput", k_max=10),
    "eagle K=3": SpecParams(
        "eagle", controller="static", num_speculative_tokens=3, k_min=3, k_max=3, max_tree_nodes=0
    ),
    "eagle dyn": SpecParams("eagle", controller="goodput", k_max=6),
}


def run(
    engine: Engine, ids: list[int], spec: SpecParams | None, max_tokens: int
) -> tuple[int, float, int, int]:
    """(tokens, seconds, accepted drafts, verification steps) of one request run alone."""
    engine.add_request(
        f"r{time.perf_counter_ns()}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), spec
    )
    start = time.perf_counter()
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    seconds = time.perf_counter() - start
    assert last is not None
    st = last.stats.spec
    return (
        last.stats.num_output_tokens,
        seconds,
        (st.num_accepted_tokens if st else 0),
        (st.num_drafts if st else 0),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-class", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--head", default=None, help="EAGLE head directory (default: the shipped one)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="1 prompt per class, 48 tokens")
    args = ap.parse_args()
    if args.quick:
        args.per_class, args.max_tokens = 1, 48
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    options = {"eagle": {"head": args.head}} if args.head else {}

    def make() -> Engine:
        return Engine(
            EngineConfig(
                dtype="auto",
                convert_cache_dir=default_cache_dir(),
                num_threads=args.threads,
                proposer_options=options,
            )
        )

    engines = {arm: make() for arm in ARMS}
    tok = next(iter(engines.values())).tokenizer
    _, held_out = prompts(0, args.per_class)
    items = [(c, ids) for c, text in held_out if (ids := chat_ids(tok, text, args.max_prompt_tokens))]
    warm = tok.encode("Warm-up: the quick brown fox jumps over the lazy dog. " * 4)
    for arm, engine in engines.items():
        run(engine, warm, ARMS[arm], 8)
    tokens: dict[tuple[str, str], int] = defaultdict(int)
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    accepted: dict[tuple[str, str], int] = defaultdict(int)
    steps: dict[tuple[str, str], int] = defaultdict(int)
    for i, (cat, ids) in enumerate(items):
        for arm, engine in engines.items():
            got_tokens, got_s, got_accepted, got_steps = run(engine, ids, ARMS[arm], args.max_tokens)
            key = (cat, arm)
            tokens[key] += got_tokens
            seconds[key] += got_s
            accepted[key] += got_accepted
            steps[key] += got_steps
        print(f"[{i + 1}/{len(items)}] {cat}", file=sys.stderr)
    cats = sorted({c for c, _ in items})
    print(
        f"\n{len(items)} held-out prompts, {args.max_tokens} max new tokens, greedy, batch 1, "
        f"{engines['plain'].config.dtype}"
    )
    print("tokens/s (ratio to plain) [mean accepted length]\n")
    print("| class | " + " | ".join(ARMS) + " |")
    print("|---|" + "---|" * len(ARMS))
    for cat in [*cats, "all"]:
        sel = cats if cat == "all" else [cat]
        rate = {a: sum(tokens[c, a] for c in sel) / sum(seconds[c, a] for c in sel) for a in ARMS}
        cells = []
        for a in ARMS:
            n = sum(steps[c, a] for c in sel)
            mal = f" [{1 + sum(accepted[c, a] for c in sel) / n:.2f}]" if n else ""
            cells.append(f"{rate[a]:.1f} ({rate[a] / rate['plain']:.2f}x){mal}")
        print(f"| {cat} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
