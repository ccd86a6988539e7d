"""Speculative decoding on the default model, by workload category, side by side in one run.

    python bench/bench_spec.py [--per-category 3] [--max-tokens 128] [--quick]

Batch 1, greedy, bfloat16 on CPU (the serving default). For each prompt every arm runs back to
back, so machine noise hits all arms alike. Each arm has its own engine, so what one arm learns
(the suffix cache of earlier outputs, acceptance and cost estimates) never helps another; the
suffix arms do learn from the earlier prompts of the run, as in serving. Arms: the engine without
speculation (plain), n-gram and
suffix drafting with a static K and with the goodput (dynamic K) controller, and Hugging Face
`generate` with prompt lookup (`prompt_lookup_num_tokens=10`). Reported: tokens/s per category
and arm, the ratio to plain, and the mean accepted length (tokens per verification step). A
second table runs the same mixed prompts 4 and 16 at a time, where speculation must back off.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent

from specgate.bench.workloads import CATEGORIES, chat_prompts, round_robin
from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.params import SpecParams
from specgate.gateway.settings import default_cache_dir

ARMS: dict[str, SpecParams | None] = {
    "plain": None,
    "ngram K=4": SpecParams("ngram", controller="static", num_speculative_tokens=4, max_tree_nodes=0),
    "ngram dyn": SpecParams("ngram", controller="goodput", k_max=10),
    "suffix K=4": SpecParams("suffix", controller="static", num_speculative_tokens=4, max_tree_nodes=0),
    "suffix dyn": SpecParams("suffix", controller="goodput", k_max=10),
}
HF_ARM = "HF prompt lookup"


def run_engine(
    engine: Engine, ids: list[int], spec: SpecParams | None, max_tokens: int
) -> tuple[int, float, float]:
    """(tokens, seconds, mean accepted length) of one request run alone."""
    engine.add_request(
        f"r{time.perf_counter_ns()}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), spec
    )
    tokens, last = 0, None
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            last = out
    elapsed = time.perf_counter() - start
    acc = last.stats.spec.mean_acceptance_length if last and last.stats.spec else 1.0
    return tokens, elapsed, acc


def run_hf(model, ids: list[int], max_tokens: int) -> tuple[int, float, float]:
    x = torch.tensor([ids])
    start = time.perf_counter()
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=max_tokens,
        prompt_lookup_num_tokens=10,
    )
    return out.shape[1] - len(ids), time.perf_counter() - start, float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face prompt-lookup arm")
    ap.add_argument("--quick", action="store_true", help="1 prompt per category, 64 tokens")
    ap.add_argument("--no-load", dest="load", action="store_false", help="skip the 4 / 16 concurrent table")
    ap.add_argument("--load-only", action="store_true", help="only the 4 / 16 concurrent table")
    args = ap.parse_args()
    if args.quick:
        args.per_category, args.max_tokens = 1, 64
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    def make_engine() -> Engine:
        config = EngineConfig(
            dtype="bfloat16",
            convert_cache_dir=default_cache_dir(),
            num_threads=args.threads,
            kv_cache_bytes=2**30,  # room for 16 concurrent long prompts without preemption
        )
        return Engine(config)

    first = make_engine()
    prompts = chat_prompts(first.tokenizer, args.per_category, args.max_prompt_tokens)
    warm = first.tokenizer.encode("Warm-up: the quick brown fox jumps over the lazy dog. " * 4)
    if not args.load_only:
        category_table(args, make_engine, prompts, warm, first)
    gc.collect()
    if args.load or args.load_only:
        load_table(make_engine, prompts, args.max_tokens, warm)


def category_table(
    args: argparse.Namespace,
    make_engine: Callable[[], Engine],
    prompts: list[tuple[str, list[int]]],
    warm: list[int],
    first: Engine,
) -> None:
    """Batch 1, every arm on every prompt, per category."""
    engines = {arm: make_engine() for arm in ARMS}
    arms = list(ARMS) + ([] if args.no_hf else [HF_ARM])
    hf_model = None
    if not args.no_hf:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            _converted(first), dtype=torch.bfloat16, attn_implementation="sdpa", local_files_only=True
        ).eval()
    # Warm-up on a text outside the benchmark: first calls pay one-off costs (allocations, kernels).
    for arm, engine in engines.items():
        run_engine(engine, warm, ARMS[arm], 8)
    if hf_model is not None:
        run_hf(hf_model, warm, 8)

    tokens: dict[tuple[str, str], int] = defaultdict(int)
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    accepted: dict[tuple[str, str], list[float]] = defaultdict(list)
    print(
        f"{len(prompts)} prompts x {len(arms)} arms, {args.max_tokens} max new tokens, greedy, bf16, batch 1"
    )
    for n, (cat, ids) in enumerate(prompts, 1):
        for arm in arms:
            if arm == HF_ARM:
                t, s, a = run_hf(hf_model, ids, args.max_tokens)
            else:
                t, s, a = run_engine(engines[arm], ids, ARMS[arm], args.max_tokens)
            tokens[cat, arm] += t
            seconds[cat, arm] += s
            accepted[cat, arm].append(a)
        print(
            f"[{n}/{len(prompts)}] {cat}: "
            + ", ".join(f"{arm} {tokens[cat, arm] / seconds[cat, arm]:.0f}" for arm in arms),
            flush=True,
        )

    cats = [c for c in CATEGORIES if (c, "plain") in tokens]
    print("\ntokens/s (ratio to plain) [mean accepted length]")
    print("| category | " + " | ".join(arms) + " |")
    print("|---|" + "---|" * len(arms))
    for cat in [*cats, "all"]:
        keys = cats if cat == "all" else [cat]
        plain = sum(tokens[c, "plain"] for c in keys) / sum(seconds[c, "plain"] for c in keys)
        cells = []
        for arm in arms:
            rate = sum(tokens[c, arm] for c in keys) / sum(seconds[c, arm] for c in keys)
            acc = [a for c in keys for a in accepted[c, arm]]
            extra = f" [{sum(acc) / len(acc):.2f}]" if arm not in ("plain", HF_ARM) else ""
            cells.append(f"{rate:.1f} ({rate / plain:.2f}x){extra}")
        print(f"| {cat} | " + " | ".join(cells) + " |")


LOAD_ARMS = ["plain", "ngram K=4", "ngram dyn", "suffix dyn"]


def run_concurrent(
    engine: Engine, prompts: list[list[int]], spec: SpecParams | None, max_tokens: int
) -> float:
    """Aggregate tokens/s with every prompt submitted at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(f"c{time.perf_counter_ns()}-{i}", ids, params, spec)
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - start)


def load_table(
    make_engine: Callable[[], Engine], prompts: list[tuple[str, list[int]]], max_tokens: int, warm: list[int]
) -> None:
    """Speculation under load: the same mixed prompts at several concurrencies."""
    # Prompts up to 400 tokens, so decode (not prefill) dominates as in a busy chat service.
    mixed = [ids for _, ids in round_robin(prompts) if len(ids) <= 400]
    print(f"\naggregate tokens/s under load, {len(mixed)} mixed prompts of <= 400 tokens (ratio to plain)")
    print("| concurrent | " + " | ".join(LOAD_ARMS) + " |")
    print("|---|" + "---|" * len(LOAD_ARMS))
    for n in (4, 16):
        batch = (mixed * (n // len(mixed) + 1))[:n]
        engines = {arm: make_engine() for arm in LOAD_ARMS}  # nothing learnt from another row
        for arm, engine in engines.items():
            run_engine(engine, warm, ARMS[arm], 8)
        rates = {arm: run_concurrent(engines[arm], batch, ARMS[arm], max_tokens) for arm in LOAD_ARMS}
        cells = [f"{rates[arm]:.1f} ({rates[arm] / rates['plain']:.2f}x)" for arm in LOAD_ARMS]
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)


def _converted(engine: Engine) -> Path:
    """The directory the engine loaded (the safetensors conversion of a GGUF default model)."""
    src = engine.runner.source
    if src.gguf_file is None:
        return src.directory
    from specgate.engine.loader import converted_dir

    return converted_dir(src, default_cache_dir())


if __name__ == "__main__":
    main()
