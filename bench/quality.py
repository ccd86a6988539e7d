"""`specgate bench quality`: what each weight mode costs in quality and buys in speed, against a
float32 reference and llama.cpp. (bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

from specgate.bench import engine_run, launch, models, workload
from specgate.bench.stats import table

MODES: dict[str, dict[str, Any]] = {"reference": {"quantization": "none", "dtype": "float32"}}
MODES |= {"native": {"quantization": "auto"}, "bf16": {"quantization": "none", "dtype": "bfloat16"}}
MODES |= {"int8": {"quantization": "int8", "dtype": "bfloat16"}}
MODES |= {"int4": {"quantization": "int4", "dtype": "bfloat16"}}
MODES["plan"] = {"quantization": "auto", "dtype": "bfloat16", "kernels": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default="native,bf16,int8,int4,plan")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--prompts", type=int, default=12)
    launch.options(p, model=None, out=None)


def held_out_texts() -> list[str]:
    code = [c["prompt"] + c["canonical_solution"] for c in workload.jsonl("HumanEval.jsonl.gz")[100:112]]
    return code + [r["question"] + "\n" + r["answer"] for r in workload.jsonl("gsm8k_test_dev.jsonl")[:12]]


def build(model: str, mode: str) -> Any:
    from specgate.engine.kernels import extension

    opts = dict(MODES[mode])
    if not opts.pop("kernels", True):
        os.environ["SPECGATE_KERNELS"] = "off"
        extension._state.clear()
    try:
        return engine_run.build(model, prefix_caching=False, **opts)
    finally:
        os.environ.pop("SPECGATE_KERNELS", None)
        extension._state.clear()


def teacher_forced(engine: Any, texts: list[str]) -> tuple[float, list[Any]]:
    """exp(mean negative log-likelihood) of every token after the first, and each text's argmax."""
    import torch

    from specgate.engine.batch_layout import ForwardItem

    runner, bs, chunk = engine.runner, engine.config.block_size, engine.config.max_num_batched_tokens
    nll, count, argmax = 0.0, 0, []
    with torch.inference_mode():
        for text in texts:
            ids = [int(t) for t in engine.tokenizer.encode(text)][: engine.max_model_len]
            blocks = list(range(-(-len(ids) // bs)))
            parts = [ids[s : s + chunk] for s in range(0, len(ids), chunk)]
            outs = [runner.execute([ForwardItem(p, k * chunk, blocks, len(p))]) for k, p in enumerate(parts)]
            logits = torch.cat([x.float() for x in outs])
            logits = logits[:-1, : runner.vocab_size]  # each position predicts the next token
            nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
            count += len(ids) - 1
            argmax.append(logits.argmax(-1))
    return math.exp(nll / count), argmax


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    """(mean share of positions before the first difference, sequences equal in full)."""
    shares, equal = [], 0
    for x, y in zip(a, b, strict=True):
        n = min(len(x), len(y))
        first = next((i for i in range(n) if x[i] != y[i]), n)
        shares.append(first / max(1, n))
        equal += first == n
    return sum(shares) / len(shares), equal


def llama_cpp_greedy(path: str, prompt_ids: list[list[int]], n: int) -> list[list[int]] | None:
    """llama.cpp's greedy answers (llama-cpp-python in this process), None where it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=4096, n_threads=os.cpu_count(), verbose=False)
    answers = (itertools.islice(llm.generate(ids, temp=0.0, top_k=1, reset=True), n) for ids in prompt_ids)
    return [[int(t) for t in answer] for answer in answers]


def run(args: argparse.Namespace) -> int:
    path = str(models.gguf_path(args.model))
    reqs = workload.shipped(args.prompts, args.tokens, workload.CATEGORIES[:-1], max_prompt_tokens=400)
    texts = held_out_texts()
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    argmax: dict[str, list[Any]] = {}
    prompt_ids: list[list[int]] = []
    for mode in ["reference", *(m for m in args.modes.split(",") if m)]:
        engine = build(path, mode)
        prompt_ids = prompt_ids or engine_run.prompt_ids(engine, reqs)[: args.prompts]
        ppl, argmax[mode] = teacher_forced(engine, texts)
        batch = engine_run.run(engine, prompt_ids, args.tokens, concurrency=1)
        outputs[mode] = [a.tokens for a in batch.answers]
        rates = [x for a in batch.answers if (x := a.decode_rate)]
        results[mode] = {"perplexity": ppl, "dtype": engine.config.dtype}
        results[mode]["decode_tok_s"] = sum(rates) / len(rates)
        print(f"{mode}: perplexity {ppl:.4f}", flush=True)
        del engine
        gc.collect()
    if (peer := llama_cpp_greedy(path, prompt_ids, args.tokens)) is not None:
        outputs["llama.cpp"], results["llama.cpp"] = peer, {}
    ref: float = results["reference"]["perplexity"]
    print(
        f"\n{Path(path).name}: {len(prompt_ids)} prompts, {args.tokens} tokens; {len(texts)} held-out texts"
    )
    rows = []
    for name, r in results.items():
        share, equal = agreement(outputs[name], outputs["reference"])
        r.update(agreement_share=share, agreement_equal=equal)
        row = [name, f"{share:.2f} / {equal} of {len(prompt_ids)}"]
        got = r.get("perplexity")
        row.append("" if got is None else f"{got:.3f} ({100 * (got / ref - 1):+.2f}%)")
        pairs = zip(argmax.get(name, []), argmax["reference"], strict=False)
        hits = sum(int((a == b).sum()) for a, b in pairs) / sum(len(b) for b in argmax["reference"])
        row.append(f"{100 * hits:.1f}%" if name in argmax else "")
        vs_peer = "llama.cpp" in outputs and name != "llama.cpp"
        row.append("{:.2f} / {}".format(*agreement(outputs[name], outputs["llama.cpp"])) if vs_peer else "")
        rows.append([*row, f"{r['decode_tok_s']:.1f}" if "decode_tok_s" in r else ""])
    head = ["system", "agreement with reference (share before first difference / equal in full)"]
    head += ["perplexity (change)", "top-1 = reference", "agreement with llama.cpp", "decode tok/s (batch 1)"]
    print("\n".join(table(head, rows)))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0
