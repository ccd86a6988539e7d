"""Engine throughput vs Hugging Face `generate` (and llama.cpp) on the default model, one run.

    python bench/bench_engine.py [--max-tokens 128] [--hf-prompts 4] [--dtype bfloat16]

Every system decodes greedily and exactly --max-tokens tokens per prompt (EOS ignored), so the
token counts are identical and the tokens/s ratios compare like with like. Prefill time counts.
Rows: this engine (default quantization: the GGUF's own precision) at 1 (sequential), 4 and 16
concurrent requests, and at batch 1 with each --compare mode (default: none = dense bf16); HF
generate sequential (batch 1);
llama.cpp sequential when llama-cpp-python is installed (`pip install llama-cpp-python`).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent

from specgate.bench.workloads import chat_prompts, round_robin
from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.loader import converted_dir, default_model_source
from specgate.engine.sampling_params import SamplingParams
from specgate.gateway.settings import default_cache_dir


def run_engine(
    engine: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> tuple[int, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    in_flight = 0
    tokens = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            i, ids = pending.pop(0)
            # No prefix-cache sharing: rows reuse prompts, and a hit would skip their prefill.
            engine.add_request(f"b{concurrency}-{i}-{start}", ids, params, prefix_salt=None)
            in_flight += 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
            in_flight -= out.finished
    return tokens, time.perf_counter() - start


def run_hf(model, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_tokens, pad_token_id=0)
    tokens = 0
    start = time.perf_counter()
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
        tokens += out.shape[1] - len(ids)
    return tokens, time.perf_counter() - start


def run_llama_cpp(
    gguf: Path, prompts: list[list[int]], max_tokens: int, threads: int
) -> tuple[int, float] | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, verbose=False, seed=0)
    eos = llm.token_eos()

    def no_eos(_ids, logits):  # decode exactly max_tokens, like the other rows
        logits[eos] = -float("inf")
        return logits

    processors = llama_cpp.LogitsProcessorList([no_eos])
    llm.create_completion(prompts[0], max_tokens=4, temperature=0.0)  # warm-up
    tokens = 0
    start = time.perf_counter()
    for ids in prompts:
        llm.reset()
        out = llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0, logits_processor=processors)
        assert isinstance(out, dict)  # not streaming: one response
        tokens += out["usage"]["completion_tokens"]
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--hf-prompts", type=int, default=4, help="prompts for the sequential rows")
    ap.add_argument("--max-prompt-tokens", type=int, default=400)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument(
        "--compare",
        default="none",
        help="extra batch-1 engine rows at these quantization modes (comma-separated)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    engine = Engine(
        EngineConfig(dtype=args.dtype, convert_cache_dir=default_cache_dir(), num_threads=args.threads)
    )
    # Categories alternate, so the first few prompts (the sequential rows) span several of them.
    prompts = round_robin(chat_prompts(engine.tokenizer, 3, args.max_prompt_tokens))[: args.num_prompts]
    ids = [p[1] for p in prompts]
    seq_ids = ids[: args.hf_prompts]
    cats = ", ".join(sorted({p[0] for p in prompts}))
    print(f"model {engine.model_name}, {args.dtype}, {args.threads} threads, {args.max_tokens} tokens/prompt")
    print(f"{len(ids)} prompts ({cats}), prompt tokens {min(map(len, ids))}-{max(map(len, ids))}")
    print(f"sequential rows use the first {len(seq_ids)} prompts")
    run_engine(engine, [ids[0][:32]], 1, 8)  # warm-up

    source = default_model_source()
    converted = converted_dir(source, default_cache_dir())
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        converted, dtype=getattr(torch, args.dtype), attn_implementation="sdpa", local_files_only=True
    ).eval()
    hf_model.generation_config.eos_token_id = None  # decode exactly max_tokens, like the engine rows
    run_hf(hf_model, [ids[0][:32]], 8)  # warm-up

    rows: list[tuple[str, int, float]] = []
    n, t = run_hf(hf_model, seq_ids, args.max_tokens)
    rows.append(("HF generate, batch 1 (sequential)", n, t))
    n, t = run_engine(engine, seq_ids, 1, args.max_tokens)
    mode = engine.config.quantization
    rows.append((f"specgate engine ({mode}), batch 1 (sequential)", n, t))
    for c in (4, 16):
        n, t = run_engine(engine, ids, c, args.max_tokens)
        rows.append((f"specgate engine ({mode}), {c} concurrent", n, t))
    del engine
    for other in filter(None, args.compare.split(",")):
        alt = Engine(
            EngineConfig(
                dtype=args.dtype,
                quantization=other,
                convert_cache_dir=default_cache_dir(),
                num_threads=args.threads,
            )
        )
        run_engine(alt, [ids[0][:32]], 1, 8)  # warm-up
        n, t = run_engine(alt, seq_ids, 1, args.max_tokens)
        rows.append((f"specgate engine ({other}), batch 1 (sequential)", n, t))
        del alt
    lc = run_llama_cpp(source.directory / (source.gguf_file or ""), seq_ids, args.max_tokens, args.threads)
    if lc is not None:
        rows.append(("llama.cpp (Q4_1 GGUF), batch 1 (sequential)", *lc))

    hf_rate = rows[0][1] / rows[0][2]
    print("\n| system | tokens | seconds | tokens/s | vs HF generate |\n|---|---|---|---|---|")
    for name, n, t in rows:
        print(f"| {name} | {n} | {t:.1f} | {n / t:.1f} | {n / t / hf_rate:.2f}x |")


if __name__ == "__main__":
    main()
