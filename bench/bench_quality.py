"""What each weight mode costs in quality, against a dequantized float32 reference and llama.cpp.

    python bench/bench_quality.py --model qwen2.5-coder-1.5b [--tokens 64] [--prompts 12]

For one GGUF file (a path, or a name from bench/models.py; default: the embedded default model):
- reference: the file's weights dequantized to float32 (transformers' GGUF loader), dense;
- each mode of --modes: `native` (the default: the file's own blocks on the GGUF kernels),
  `bf16` (dense bfloat16), `int8` and `int4` (torch's weight-only kernels), `plan` (the earlier
  default: 4-bit tensors as int4, the rest dense bfloat16);
- llama.cpp on the same file (llama-cpp-python), when installed.
Reported per system: greedy agreement with the reference over the first --tokens tokens of each
prompt (the mean share of positions before the first difference, and how many match in full),
perplexity on held-out text (HumanEval solutions and GSM8K answers) and its change from the
reference's, and greedy agreement with llama.cpp.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import math
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from specgate.bench.models import resolve
from specgate.engine.batch_layout import ForwardItem
from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.kernels import extension
from specgate.engine.loader import default_model_source
from specgate.engine.sampling_params import SamplingParams
from specgate.gateway.settings import default_cache_dir

DATA = Path(__file__).resolve().parent / "data"
MODES: dict[str, dict[str, Any]] = {
    "reference": {"quantization": "none", "dtype": "float32"},
    "native": {"quantization": "auto"},
    "bf16": {"quantization": "none", "dtype": "bfloat16"},
    "int8": {"quantization": "int8", "dtype": "bfloat16"},
    "int4": {"quantization": "int4", "dtype": "bfloat16"},
    "plan": {"quantization": "auto", "dtype": "bfloat16", "kernels": False},
}


def prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in (DATA / "spec_bench_dev.jsonl").open()]
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt") as f:
        code = [json.loads(line)["prompt"] for line in f]
    out = [r["turns"][0] for r in rows[:: max(1, len(rows) // max(1, n // 2))]][: n - n // 2]
    return out + [f"Complete this function:\n{c}" for c in code[: n // 2]]


def held_out_texts() -> list[str]:
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt") as f:
        code = [json.loads(line) for line in f]
    math_rows = [json.loads(line) for line in (DATA / "gsm8k_test_dev.jsonl").open()]
    texts = [c["prompt"] + c["canonical_solution"] for c in code[100:112]]
    texts += [r["question"] + "\n" + r["answer"] for r in math_rows[:12]]
    return texts


def engine_for(model: str | None, mode: str) -> Engine:
    opts = dict(MODES[mode])
    kernels = opts.pop("kernels", True)
    if not kernels:
        os.environ["SPECGATE_KERNELS"] = "off"
        extension._state.clear()
    try:
        return Engine(
            EngineConfig(model=model, convert_cache_dir=default_cache_dir(), prefix_caching=False, **opts)
        )
    finally:
        os.environ.pop("SPECGATE_KERNELS", None)
        extension._state.clear()


def chat_ids(engine: Engine, text: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def greedy(engine: Engine, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    out: list[list[int]] = []
    for i, ids in enumerate(prompt_ids):
        engine.add_request(
            f"q{i}-{time.time()}", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )
        tokens: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens.extend(o.new_token_ids)
        out.append(tokens)
    return out


@torch.inference_mode()
def perplexity(engine: Engine, texts: list[str]) -> float:
    """exp(mean negative log-likelihood) of every token after the first, teacher-forced."""
    runner, nll, count = engine.runner, 0.0, 0
    bs = engine.config.block_size
    for text in texts:
        ids = [int(t) for t in engine.tokenizer.encode(text)][: engine.max_model_len]
        blocks = list(range(-(-len(ids) // bs)))
        chunk = engine.config.max_num_batched_tokens
        logits_all = []
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            item = ForwardItem(part, start, blocks, num_logits=len(part))
            logits_all.append(runner.execute([item]).float())
        logits = torch.cat(logits_all)[:-1]  # [n - 1, vocab]: each position predicts the next token
        target = torch.tensor(ids[1:])
        nll += float(
            torch.nn.functional.cross_entropy(logits[:, : runner.vocab_size], target, reduction="sum")
        )
        count += len(ids) - 1
    return math.exp(nll / count)


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
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=4096, n_threads=os.cpu_count(), verbose=False, logits_all=False)
    out = []
    for ids in prompt_ids:
        llm.reset()
        tokens: list[int] = []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            tokens.append(int(tok))
            if len(tokens) >= n:
                break
        out.append(tokens)
    del llm
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF path or a bench model name (default: SmolLM2)")
    ap.add_argument("--modes", default="native,bf16,int8,int4,plan")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    model = resolve(args.model)
    if model is None:
        src = default_model_source()
        assert src.gguf_file is not None, "the default model ships as a GGUF file"
        gguf_path = str(src.directory / src.gguf_file)
    else:
        gguf_path = model
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    texts, held_out = prompts(args.prompts), held_out_texts()
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    prompt_ids: list[list[int]] = []
    for mode in ["reference", *modes]:
        engine = engine_for(model, mode)
        if not prompt_ids:
            prompt_ids = [chat_ids(engine, t) for t in texts]
        outputs[mode] = greedy(engine, prompt_ids, args.tokens)
        results[mode] = {"perplexity": perplexity(engine, held_out), "dtype": engine.config.dtype}
        if mode == "native":
            results[mode]["native"] = engine.runner.native is not None
        print(f"{mode}: perplexity {results[mode]['perplexity']:.4f}", flush=True)
        del engine
        gc.collect()
    peer = llama_cpp_greedy(gguf_path, prompt_ids, args.tokens)
    if peer is not None:
        outputs["llama.cpp"] = peer
        results["llama.cpp"] = {}
    ref_ppl = results["reference"]["perplexity"]
    print(
        f"\n{Path(gguf_path).name}: {len(prompt_ids)} prompts, {args.tokens} greedy tokens; "
        f"held-out text: {len(held_out)} texts"
    )
    print(
        "| system | agreement with reference (share before first difference / equal in full) "
        "| perplexity (change) | agreement with llama.cpp |"
    )
    print("|---|---|---|---|")
    for name, r in results.items():
        share, equal = agreement(outputs[name], outputs["reference"])
        ppl = r.get("perplexity")
        ppl_text = "" if ppl is None else f"{ppl:.3f} ({100 * (ppl / ref_ppl - 1):+.2f}%)"
        peer_text = ""
        if "llama.cpp" in outputs and name != "llama.cpp":
            ps, pe = agreement(outputs[name], outputs["llama.cpp"])
            peer_text = f"{ps:.2f} / {pe}"
        r.update(agreement_share=share, agreement_equal=equal)
        print(f"| {name} | {share:.2f} / {equal} of {len(prompt_ids)} | {ppl_text} | {peer_text} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
