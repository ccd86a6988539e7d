"""Engine throughput vs Hugging Face `generate` (and llama.cpp) on the default model, one run.

    python bench/bench_engine.py [--max-tokens 128] [--hf-prompts 4] [--dtype bfloat16]

Every system decodes greedily and exactly --max-tokens tokens per prompt (EOS ignored), so the
token counts are identical and the tokens/s ratios compare like with like. Prefill time counts.
Rows: this engine (default quantization: the GGUF's own precision; steps compiled at
--compile-sizes, the sizes `specgate serve --compile` uses) at 1 (sequential), 4 and 16 concurrent
requests; the sequential prompts streamed through `specgate serve` with the same sizes, alternating
request by request with the engine's own (its TPOT against the engine's; --no-served skips it); at
batch 1 with each --compare mode (default: eager = the same engine without compiled steps, none =
dense bf16, eager); HF generate sequential (batch 1);
llama.cpp sequential when llama-cpp-python is installed (`pip install llama-cpp-python`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent

from specgate.bench.served_row import ServedGateway
from specgate.bench.workloads import chat_prompts, round_robin
from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.loader import converted_dir, default_model_source
from specgate.engine.sampling_params import SamplingParams
from specgate.gateway.settings import default_cache_dir


def run_engine(
    engine: Engine, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> tuple[int, float, float]:
    """(tokens, seconds, median TPOT in ms: a request's time from its first token to its last, per
    token after the first)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    in_flight = 0
    tokens = 0
    first: dict[str, tuple[float, int]] = {}  # request id -> (time of its first token, tokens then)
    tpots: list[float] = []
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            i, ids = pending.pop(0)
            # No prefix-cache sharing: rows reuse prompts, and a hit would skip their prefill.
            engine.add_request(f"b{concurrency}-{i}-{start}", ids, params, prefix_salt=None)
            in_flight += 1
        for out in engine.step():
            now = time.perf_counter()
            tokens += len(out.new_token_ids)
            seen = first.setdefault(out.request_id, (now, len(out.new_token_ids)))
            if out.finished:
                in_flight -= 1
                decoded = out.stats.num_output_tokens - seen[1]
                if decoded > 0:
                    tpots.append((now - seen[0]) * 1e3 / decoded)
    tpots.sort()
    return tokens, time.perf_counter() - start, tpots[len(tpots) // 2] if tpots else float("nan")


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


def _total(runs: list[tuple[int, float, float]]) -> tuple[int, float, float]:
    """Requests run one by one as one row: summed tokens and seconds, the median TPOT."""
    tpots = sorted(r[2] for r in runs)
    return sum(r[0] for r in runs), sum(r[1] for r in runs), tpots[len(tpots) // 2]


def engine_config_mode(compare: str) -> str:
    """A --compare entry's quantization mode ('eager': the default one)."""
    return "auto" if compare == "eager" else compare


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
        default="eager,none",
        help="extra batch-1 engine rows, eager: at these quantization modes, 'eager' for the default one",
    )
    ap.add_argument(
        "--served",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add a row for the sequential prompts streamed through `specgate serve` (same sizes)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="repetitions of the sequential prompts in the alternating engine / served rows",
    )
    ap.add_argument(
        "--compile-sizes",
        default="1,2,4,8,16",
        help="step sizes compiled for the main rows (comma-separated; empty: none)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    sizes = tuple(int(x) for x in args.compile_sizes.split(",") if x.strip())
    started = time.perf_counter()
    engine = Engine(
        EngineConfig(
            dtype=args.dtype,
            convert_cache_dir=default_cache_dir(),
            num_threads=args.threads,
            compile_sizes=sizes,
        )
    )
    steps = engine.runner.compiled
    compiled = sorted(steps.graphs) if steps is not None else []
    del steps
    built = f"engine built in {time.perf_counter() - started:.0f} s"
    print(built + (f", compiled steps {compiled}" if compiled else ", no compiled steps"))
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

    nan = float("nan")
    rows: list[tuple[str, int, float, float]] = []  # (system, tokens, seconds, TPOT ms)
    n, t = run_hf(hf_model, seq_ids, args.max_tokens)
    rows.append(("HF generate, batch 1 (sequential)", n, t, nan))
    mode = engine.config.quantization + (", compiled" if compiled else "")
    alone = f"specgate engine ({mode}), batch 1 (sequential)"
    if args.served:
        out = Path(tempfile.mkdtemp(prefix="bench-engine-served-"))  # its log and data directory
        with ServedGateway(args.compile_sizes, args.threads, out) as gateway:
            gateway.stream(seq_ids[0][:32], 8)  # warm-up
            pairs = [
                (run_engine(engine, [ids], 1, args.max_tokens), gateway.stream(ids, args.max_tokens))
                for ids in seq_ids * args.rounds
            ]
        rows.append((alone, *_total([a for a, _ in pairs])))
        rows.append(
            (
                f"specgate serve ({mode}), streamed, batch 1 (alternating with the row above)",
                *_total([s for _, s in pairs]),
            )
        )
    else:
        rows.append((alone, *run_engine(engine, seq_ids, 1, args.max_tokens)))
    for c in (4, 16):
        rows.append(
            (f"specgate engine ({mode}), {c} concurrent", *run_engine(engine, ids, c, args.max_tokens))
        )
    del engine
    for other in filter(None, args.compare.split(",")):
        alt = Engine(
            EngineConfig(
                dtype=args.dtype,
                quantization=engine_config_mode(other),
                convert_cache_dir=default_cache_dir(),
                num_threads=args.threads,
            )
        )
        run_engine(alt, [ids[0][:32]], 1, 8)  # warm-up
        name = f"specgate engine ({engine_config_mode(other)}, eager), batch 1 (sequential)"
        rows.append((name, *run_engine(alt, seq_ids, 1, args.max_tokens)))
        del alt
    lc = run_llama_cpp(source.directory / (source.gguf_file or ""), seq_ids, args.max_tokens, args.threads)
    if lc is not None:
        rows.append(("llama.cpp (Q4_1 GGUF), batch 1 (sequential)", *lc, nan))

    hf_rate = rows[0][1] / rows[0][2]
    lc_rate = lc[0] / lc[1] if lc is not None else nan
    print(
        "\n| system | tokens | seconds | tokens/s | TPOT ms (p50) | vs HF generate | vs llama.cpp |"
        "\n|---|---|---|---|---|---|---|"
    )
    for name, n, t, tpot in rows:
        tpot_text = "" if tpot != tpot else f"{tpot:.2f}"  # NaN: not measured
        vs_lc = "" if lc is None else f"{n / t / lc_rate:.2f}x"
        print(f"| {name} | {n} | {t:.1f} | {n / t:.1f} | {tpot_text} | {n / t / hf_rate:.2f}x | {vs_lc} |")


if __name__ == "__main__":
    main()
