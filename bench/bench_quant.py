"""What each `quantization` mode costs in quality and buys in speed, on the default model, one run.

    python bench/bench_quant.py [--texts 24] [--prompts 8] [--max-tokens 64]

Reference: the dense fp32 model (the GGUF's weights dequantized exactly). For each (dtype, mode):
- perplexity, teacher-forced, on held-out text (HumanEval prompts with their canonical solutions,
  and Spec-Bench questions), and its change against the reference;
- top-1 agreement with the reference's next-token choice at every position of that text;
- greedy agreement: of N greedily decoded tokens per chat prompt, how many come before the first
  token that differs from the dense bf16 run (the serving default before quantization);
- decode speed at batch 1 (tokens/s after the first token, same prompts).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from specgate.bench.workloads import DATA, chat_prompts
from specgate.engine.batch_layout import ForwardItem
from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from specgate.gateway.settings import default_cache_dir

ARMS = [
    ("float32", "none"),
    ("bfloat16", "none"),
    ("bfloat16", "int8"),
    ("bfloat16", "int4"),
    ("bfloat16", "auto"),
    ("float32", "auto"),
]


def held_out_texts(n: int) -> list[str]:
    texts = []
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt") as f:
        for line in f:
            row = json.loads(line)
            texts.append(row["prompt"] + row["canonical_solution"])
    prose = [
        json.loads(line)["turns"][0] for line in (DATA / "spec_bench_dev.jsonl").read_text().splitlines()
    ]
    # Interleave code and prose, skipping the first prompts (the classifier's and benches' own).
    mixed = [t for pair in zip(texts[40:], prose[40:], strict=False) for t in pair]
    return mixed[:n]


def teacher_forced(engine: Engine, texts: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
    """Mean NLL per token over `texts`, and each text's argmax at every position."""
    runner = engine.runner
    bs = engine.config.block_size
    nll, count, argmax = 0.0, 0, []
    for ids in texts:
        item = ForwardItem(ids, 0, list(range(-(-len(ids) // bs))), len(ids))
        logits = runner.execute([item]).float()  # [len(ids), vocab]
        logp = torch.log_softmax(logits[:-1], dim=-1)
        target = torch.tensor(ids[1:])
        nll -= float(logp.gather(1, target.unsqueeze(1)).sum())
        count += len(ids) - 1
        argmax.append(logits[:-1].argmax(-1))
    return nll / count, argmax


def greedy(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs, decode_time, decoded = [], 0.0, 0
    for i, ids in enumerate(prompts):
        engine.add_request(f"q{i}-{time.monotonic()}", ids, params)
        toks: list[int] = []
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                toks += out.new_token_ids
            if first is None and toks:
                first = time.perf_counter()
        assert first is not None
        decode_time += time.perf_counter() - first
        decoded += len(toks) - 1
        outs.append(toks)
    return outs, decoded / decode_time


def agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=24)
    ap.add_argument("--max-text-tokens", type=int, default=384)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rows: list[tuple[str, str, float, float, list[list[int]], float]] = []
    reference: list[torch.Tensor] | None = None
    ref_nll = 0.0
    bf16_tokens: list[list[int]] | None = None
    texts: list[list[int]] = []
    prompts: list[list[int]] = []
    for dtype, mode in ARMS:
        engine = Engine(
            EngineConfig(
                dtype=dtype,
                quantization=mode,
                convert_cache_dir=default_cache_dir(),
                num_threads=args.threads,
                num_blocks=512,
            )
        )
        if not texts:
            tok = engine.tokenizer
            texts = [tok(t)["input_ids"][: args.max_text_tokens] for t in held_out_texts(args.texts)]
            prompts = [ids for _, ids in chat_prompts(tok, 1, 400)][: args.prompts]
            print(
                f"model {engine.model_name}, {args.threads} threads; {len(texts)} held-out texts "
                f"({sum(map(len, texts))} tokens); {len(prompts)} chat prompts x {args.max_tokens} tokens"
            )
        nll, argmax = teacher_forced(engine, texts)
        greedy(engine, prompts[:1], 4)  # warm-up
        tokens, speed = greedy(engine, prompts, args.max_tokens)
        if reference is None:
            reference, ref_nll = argmax, nll
        if (dtype, mode) == ("bfloat16", "none"):
            bf16_tokens = tokens
        hits = sum(int((a == r).sum()) for a, r in zip(argmax, reference, strict=True))
        total = sum(len(r) for r in reference)
        rows.append((dtype, mode, nll, hits / total, tokens, speed))
        del engine
    print(
        "\n| dtype | quantization | perplexity | vs fp32 dense | top-1 = fp32 dense "
        "| greedy tokens = bf16 dense | decode tok/s (batch 1) |\n|---|---|---|---|---|---|---|"
    )
    assert bf16_tokens is not None
    for dtype, mode, nll, top1, tokens, speed in rows:
        agree = [agreement(t, b) for t, b in zip(tokens, bf16_tokens, strict=True)]
        whole = sum(a == args.max_tokens for a in agree)
        change = 100 * (torch.tensor(nll - ref_nll).exp() - 1)
        print(
            f"| {dtype} | {mode} | {torch.tensor(nll).exp():.3f} | {change:+.2f}% "
            f"| {100 * top1:.1f}% | mean {sum(agree) / len(agree):.0f} of {args.max_tokens}, "
            f"{whole}/{len(agree)} whole | {speed:.1f} |"
        )


if __name__ == "__main__":
    main()
