"""A GGUF model on the native kernels: decode speed against llama.cpp, and speculation arms.

    python bench/bench_gguf.py decode --model qwen2.5-coder-1.5b [--tokens 64] [--reps 4]
    python bench/bench_gguf.py spec --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
    python bench/bench_gguf.py steps --model qwen2.5-coder-1.5b [--context 300]
    python bench/bench_gguf.py regime --model qwen2.5-coder-1.5b [--batches 1,2,4,8,16,32]

`decode`: batch 1, greedy, one prompt; specgate's engine and llama-cpp-python's `Llama.generate`
on the same file in one process, the same thread count, repetitions interleaved; the mean time per
token of each repetition and the ratio llama.cpp / specgate (above 1: specgate is faster).

`spec`: batch 1, greedy; per prompt of the shipped categories, every arm back to back on one engine
(plain, n-gram, suffix, the draft model with the goodput controller and with K = 4, an n-gram
tree); tokens/s after the first token, the ratio to plain, the mean accepted length, and whether
each arm's tokens equal plain's. The prefix cache is on, so arms after the first skip the target's
prefill (not timed anyway).

`steps`: what a forward pass of the engine costs by its number of new tokens, after a --context
token prompt: one sequence verifying k tokens (a speculative step), and b sequences decoding one
token each (a batch), repetitions interleaved; the median ms and its ratio to one token. This is
the cost the goodput controller learns online and trades drafted tokens against.

With --roof, `steps` also states the arithmetic: the file's multiply-adds per token (every 2-D
weight but the embedding table, which is the LM head only when the file has no `output.weight`), the
rate of a pass of n tokens in GMAC/s, and the machine's int8 roof: chains of independent VNNI dot
products (vpdpbusd on 512-bit registers; vpmaddubsw + vpmaddwd on AVX2), compiled here with the
system compiler and run on every thread at once. A verification pass cannot cost less than its
multiply-adds at that roof, nor less than one read of the weights.

`regime`: where speculation stops paying, measured and as the routing policy computes it. At each
concurrency B, B greedy requests of the copy-heavy --categories decode together, plain and with
--method (as served, the goodput controller; and a static chain of --k drafts), repetitions
interleaved; aggregate decode tokens/s while all B are decoding (after the last first token, before
the first finish), so prefill is not counted. The static arm's verification steps are the rows
telemetry keeps (`spec_steps`: batch tokens, forward ms): the policy's StepCost is fitted on them,
as a retrain does, and its predicted gain of the best K at each B, and its crossover batch, are
printed beside the measured ones.

--model / --draft: a GGUF path or a name from bench/models.py (default: the embedded model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from specgate.bench.models import resolve
from specgate.bench.serve.datasets import shipped
from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.loader import default_model_source
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.params import SpecParams
from specgate.engine.step_cost import StepCost, expected_accepted
from specgate.gateway.backends.embedded.chat_template import render_chat

PROMPT = "Write a Python function that parses a CSV file and returns a list of dicts."
SPEC_CATEGORIES = "code,summarization,rag,tool_call,open_chat,translation"


def gguf_path(name: str | None) -> str:
    path = resolve(name)
    if path is not None:
        return path
    src = default_model_source()
    assert src.gguf_file is not None, "the default model ships as a GGUF file"
    return str(src.directory / src.gguf_file)


def _mean_gap_ms(times: list[float]) -> float:
    """Mean time between consecutive tokens after the first, in ms."""
    return (times[-1] - times[1]) / (len(times) - 2) * 1000


def decode(args: argparse.Namespace) -> int:
    from llama_cpp import Llama

    path = gguf_path(args.model)
    engine = Engine(EngineConfig(model=path, prefix_caching=False))
    llm = Llama(model_path=path, n_threads=torch.get_num_threads(), n_ctx=1024, verbose=False)
    ids = engine.tokenizer.encode(PROMPT)
    n = args.tokens

    def ours() -> float:
        engine.add_request("r", list(ids), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        times = []
        while engine.has_unfinished():
            engine.step()
            times.append(time.perf_counter())
        return _mean_gap_ms(times)

    def theirs() -> float:
        times: list[float] = []
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if len(times) >= n:
                break
        return _mean_gap_ms(times)

    ours(), theirs()  # warm-up
    print(f"{os.path.basename(path)}: {n} greedy tokens, {torch.get_num_threads()} threads")
    print("| repetition | specgate ms/token | llama.cpp ms/token | llama.cpp / specgate |")
    print("|---|---|---|---|")
    ratios = []
    for rep in range(args.reps):
        a, b = ours(), theirs()
        ratios.append(b / a)
        print(f"| {rep + 1} | {a:.2f} | {b:.2f} | {b / a:.3f} |", flush=True)
    print(f"median ratio {statistics.median(ratios):.3f}")
    return 0


def spec_arms() -> dict[str, SpecParams | None]:
    return {
        "plain": None,
        "ngram": SpecParams(method="ngram"),
        "suffix": SpecParams(method="suffix"),
        "draft": SpecParams(method="draft_model"),
        "draft K=4": SpecParams(
            method="draft_model", controller="static", num_speculative_tokens=4, max_tree_nodes=0
        ),
        "ngram tree": SpecParams(method="ngram", k_max=8, max_tree_nodes=16),
    }


def spec(args: argparse.Namespace) -> int:
    options: dict[str, dict[str, Any]] = {}
    arms = spec_arms()
    if args.draft:
        options["draft_model"] = {"model": gguf_path(args.draft)}
    else:
        arms = {k: v for k, v in arms.items() if not (v and v.method == "draft_model")}
    engine = Engine(EngineConfig(model=gguf_path(args.model), prefix_caching=True, proposer_options=options))
    categories = [c for c in args.categories.split(",") if c]
    rates: dict[tuple[str, str], list[float]] = defaultdict(list)
    accepted: dict[tuple[str, str], list[float]] = defaultdict(list)
    same: dict[str, bool] = {name: True for name in arms}
    for i, req in enumerate(shipped(args.per_category, args.tokens, categories)):
        ids = render_chat(engine.tokenizer, req.messages, req.tools)
        plain: list[int] = []
        for name, params in arms.items():
            sampling = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(f"{name}-{i}", list(ids), sampling, params)
            tokens: list[int] = []
            first, last = 0.0, None
            while engine.has_unfinished():
                for out in engine.step():
                    if out.new_token_ids and not first:
                        first = time.perf_counter()
                    tokens.extend(out.new_token_ids)
                    last = out
            rates[(req.category, name)].append((len(tokens) - 1) / (time.perf_counter() - first))
            plain = tokens if params is None else plain
            same[name] = same[name] and tokens == plain
            st = last.stats.spec if last is not None and last.stats is not None else None
            if st is not None and st.num_drafts:
                accepted[(req.category, name)].append(st.mean_acceptance_length)
        print(f"prompt {i + 1} ({req.category}) done", file=sys.stderr, flush=True)
    print(f"\n{os.path.basename(gguf_path(args.model))}: batch 1, {args.tokens} greedy tokens")
    print("| category | " + " | ".join(arms) + " |")
    print("|---" * (len(arms) + 1) + "|")
    for cat in categories:
        base = statistics.mean(rates[(cat, "plain")])
        cells = [f"{base:.1f} tok/s"]
        for name in list(arms)[1:]:
            v = statistics.mean(rates[(cat, name)])
            acc = accepted.get((cat, name))
            cells.append(f"{v / base:.2f}x" + (f" (len {statistics.mean(acc):.2f})" if acc else ""))
        print(f"| {cat} | " + " | ".join(cells) + " |")
    print("outputs equal to plain: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()))
    return 0 if all(same.values()) else 1


STEP_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)


ROOF_C = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#define N 20000000L
#ifdef __AVX512VNNI__
#define V __m512i
#define SET(x) _mm512_set1_epi8(x)
#define DP(a, b, c) _mm512_dpbusd_epi32(a, b, c)
#define MACS 64
#else
#define V __m256i
#define SET(x) _mm256_set1_epi8(x)
#define DP(a, b, c) _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(b, c), _mm256_set1_epi16(1)))
#define MACS 32
#endif
int main(void) {
  double best = 0;
  for (int round = 0; round < 3; round++) {
    double t0 = omp_get_wtime();
    long sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      V a0 = SET(0), a1 = SET(1), a2 = SET(2), a3 = SET(3);
      V a4 = SET(4), a5 = SET(5), a6 = SET(6), a7 = SET(7);
      V b = SET(3), c = SET(5);
      for (long n = 0; n < N; n++) {
        __asm__ volatile("" : "+x"(b));
        a0 = DP(a0, b, c); a1 = DP(a1, b, c); a2 = DP(a2, b, c); a3 = DP(a3, b, c);
        a4 = DP(a4, b, c); a5 = DP(a5, b, c); a6 = DP(a6, b, c); a7 = DP(a7, b, c);
      }
      int out[16];
      V s = a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7;
      __builtin_memcpy(out, &s, sizeof(int) * 4);
      sink += out[0];
    }
    double dt = omp_get_wtime() - t0, gmacs = (double)omp_get_max_threads() * N * 8 * MACS / dt / 1e9;
    if (gmacs > best) best = gmacs;
    if (sink == 42) printf("!");
  }
  printf("%.1f\n", best);
  return 0;
}
"""


def int8_roof(threads: int) -> float | None:
    """GMAC/s of int8 dot products on `threads` threads (None: no compiler, or no AVX2)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "roof.c"), os.path.join(tmp, "roof")
        with open(src, "w") as f:
            f.write(ROOF_C)
        built = subprocess.run(
            ["cc", "-O3", "-march=native", "-fopenmp", src, "-o", exe], capture_output=True
        )
        if built.returncode != 0:
            return None
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        out = subprocess.run([exe], capture_output=True, text=True, env=env, timeout=120)
        return float(out.stdout.strip()) if out.returncode == 0 else None


def macs_per_token(path: str) -> int:
    """Multiply-adds of one token's pass through every matrix of the file (the LM head included)."""
    from gguf import GGUFReader

    tensors = {t.name: [int(n) for n in t.shape] for t in GGUFReader(path).tensors}
    total = 0
    for name, shape in tensors.items():
        if len(shape) != 2 or not name.endswith(".weight"):
            continue
        if name == "token_embd.weight" and "output.weight" in tensors:
            continue  # a lookup table, not a product
        total += shape[0] * shape[1]
    return total


def steps(args: argparse.Namespace) -> int:
    from specgate.engine.batch_layout import ForwardItem
    from specgate.engine.model_runner import ModelRunner

    runner = ModelRunner(
        EngineConfig(model=gguf_path(args.model), prefix_caching=False, kv_cache_bytes=2 << 30)
    )
    bs = runner.config.block_size
    sizes = [n for n in STEP_SIZES if n <= args.max_size]
    ctx = args.context
    ids = torch.randint(100, 20000, (ctx + max(sizes),), generator=torch.Generator().manual_seed(0)).tolist()
    per_seq = -(-(ctx + max(sizes)) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max(sizes))]
    if len(tables) * per_seq > runner.kv_cache.num_blocks:
        raise SystemExit("the KV cache is too small for this many sequences: lower --max-size or --context")
    for table in tables:  # every sequence holds the same context
        for start in range(0, ctx, 256):
            chunk = ids[start : min(ctx, start + 256)]
            runner.execute([ForwardItem(chunk, start, table, 1)])

    def verify(k: int) -> float:
        t = time.perf_counter()
        runner.execute([ForwardItem(ids[ctx : ctx + k], ctx, tables[0], k)])
        return time.perf_counter() - t

    def batch(b: int) -> float:
        t = time.perf_counter()
        runner.execute([ForwardItem([ids[ctx]], ctx, tables[i], 1) for i in range(b)])
        return time.perf_counter() - t

    kinds = {"verify k": verify, "batch b": batch}
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    for rep in range(args.reps + 1):
        for n in sizes:
            for name, fn in kinds.items():
                dt = fn(n)
                if rep:  # the first round warms up
                    times[(name, n)].append(dt)
    name = os.path.basename(gguf_path(args.model))
    macs = macs_per_token(gguf_path(args.model)) if args.roof else 0
    print(f"{name}: forward pass after a {ctx}-token context, {torch.get_num_threads()} threads, median ms")
    head = [f"{k}: ms (x one token)" for k in kinds] + (["verify k: GMAC/s"] if macs else [])
    print("| new tokens | " + " | ".join(head) + " |")
    print("|---" * (len(head) + 1) + "|")
    for n in sizes:
        cells = []
        for k in kinds:
            t, one = statistics.median(times[(k, n)]), statistics.median(times[(k, 1)])
            cells.append(f"{t * 1000:.1f} ({t / one:.2f}x)")
        if macs:
            cells.append(f"{n * macs / statistics.median(times[('verify k', n)]) / 1e9:.0f}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    if macs:
        roof = int8_roof(torch.get_num_threads())
        floor = f"{8 * macs / roof / 1e6:.1f} ms" if roof else "unknown"
        print(
            f"{macs / 1e9:.2f} GMAC per token; int8 roof on {torch.get_num_threads()} threads: "
            f"{roof if roof is not None else 'not measured'} GMAC/s; 8 tokens' products at the roof: {floor}"
        )
    return 0


@dataclass(slots=True)
class _Run:
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    steps: list[tuple[int, float]] = field(default_factory=list)  # (batch tokens, forward ms)

    def acceptance(self, k: int) -> float:
        """The per-position acceptance p whose chain of k accepts what this static-K run did."""
        mean = k * self.accepted / self.drafted if self.drafted else 0.0
        lo, hi = 0.0, 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if expected_accepted(mid, k) < mean else (lo, mid)
        return (lo + hi) / 2


def _decode_together(engine: Engine, prompts: list[list[int]], spec: SpecParams | None, n: int) -> _Run:
    """Run the prompts at once; decode tokens and seconds while every one of them is decoding."""
    sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    tag = time.perf_counter_ns()
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{tag}-{i}", list(ids), sampling, spec)
    run, started, closed = _Run(), set[str](), False
    window_start: float | None = None
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids:
                started.add(out.request_id)
            st = out.stats.spec
            if out.finished and st is not None:
                run.drafted += st.num_draft_tokens
                run.accepted += st.num_accepted_tokens
                run.steps += list(zip(st.per_step_batch_tokens, st.per_step_ms, strict=True))
        if window_start is not None and not closed:
            # A step in which one finishes is not counted: from there the batch is smaller.
            closed = any(out.finished for out in outs)
            if not closed:
                run.tokens += sum(len(out.new_token_ids) for out in outs)
                run.seconds = now - window_start
        if window_start is None and len(started) == len(prompts):
            window_start = now
    return run


def regime(args: argparse.Namespace) -> int:
    engine = Engine(EngineConfig(model=gguf_path(args.model), prefix_caching=True, kv_cache_bytes=3 << 30))
    batches = [int(b) for b in args.batches.split(",")]
    reqs = shipped(max(batches), args.tokens, [c for c in args.categories.split(",") if c])
    prompts = [render_chat(engine.tokenizer, r.messages, r.tools) for r in reqs]
    static = f"{args.method} K={args.k}"
    fixed = SpecParams(
        method=args.method, controller="static", num_speculative_tokens=args.k, max_tree_nodes=0
    )
    # Calibration, and every prompt's prefill cached before anything is timed: the static arm over
    # all the prompts at once gives the per-position acceptance p of this mix, which the served
    # path would have as the class's prior (the goodput controller starts from it) and which the
    # policy's prediction uses.
    calib = _decode_together(engine, prompts, fixed, args.tokens)
    p = calib.acceptance(args.k)
    arms: dict[str, SpecParams | None] = {
        "plain": None,
        args.method: SpecParams(method=args.method, max_tree_nodes=0, acceptance_prior=round(p, 3)),
        static: fixed,
    }
    rates: dict[tuple[str, int], list[float]] = defaultdict(list)
    runs: dict[tuple[str, int], _Run] = defaultdict(_Run)
    for rep in range(args.reps):
        for b in batches:
            order = list(arms)[rep % len(arms) :] + list(arms)[: rep % len(arms)]
            for name in order:
                r = _decode_together(engine, prompts[:b], arms[name], args.tokens)
                if r.seconds > 0:
                    rates[(name, b)].append(r.tokens / r.seconds)
                total = runs[(name, b)]
                total.drafted += r.drafted
                total.accepted += r.accepted
                total.steps += r.steps
            print(f"repetition {rep + 1}, batch {b} done", file=sys.stderr, flush=True)
    cost = StepCost.fit([s for (name, _), r in runs.items() if name == static for s in r.steps], min_steps=10)
    print(f"\n{os.path.basename(gguf_path(args.model))}: {args.categories}, {args.tokens} greedy tokens")
    print(f"per-position acceptance of the mix (static K={args.k}, all {len(prompts)} prompts): p = {p:.3f}")
    if cost is None:
        print("too few verification steps to fit a step cost curve")
        return 1
    print("step cost fitted from the static arm's verification steps (batch tokens: ms):")
    print(", ".join(f"{t}: {m:.1f}" for t, m in zip(cost.tokens, cost.ms, strict=True)))
    names = list(arms)[1:]
    print(
        "| batch | plain tok/s | "
        + " | ".join(f"{n} / plain" for n in names)
        + " | p at this batch | policy's best K, predicted gain |"
    )
    print("|---" * (len(names) + 4) + "|")
    measured_cross: int | None = None
    for b in batches:
        base = statistics.median(rates[("plain", b)])
        ratios = [statistics.median(rates[(n, b)]) / base for n in names]
        p_b = runs[(static, b)].acceptance(args.k)
        k = cost.best_k(b, p_b, args.k_max)
        gain = cost.gain(b, k, p_b) if k else 1.0
        if measured_cross is None and max(ratios) <= 1.0:
            measured_cross = b
        cells = " | ".join(f"{x:.2f}x" for x in ratios)
        print(f"| {b} | {base:.1f} | {cells} | {p_b:.3f} | K={k}, {gain:.2f}x |")
    predicted = cost.crossover(p, args.k_max)
    print(
        f"crossover: measured {measured_cross} (the first batch measured at which no arm beats plain), "
        f"the policy's {predicted} (from p of the mix, k_max {args.k_max})"
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decode", help="decode speed against llama.cpp")
    d.add_argument("--model", default=None)
    d.add_argument("--tokens", type=int, default=64)
    d.add_argument("--reps", type=int, default=4)
    s = sub.add_parser("spec", help="speculation arms, per category")
    s.add_argument("--model", default=None)
    s.add_argument("--draft", default=None, help="draft model for the draft_model arms (none: no such arms)")
    s.add_argument("--categories", default=SPEC_CATEGORIES)
    s.add_argument("--per-category", type=int, default=1)
    s.add_argument("--tokens", type=int, default=96)
    t = sub.add_parser("steps", help="forward cost by new tokens: verification and batches")
    t.add_argument("--model", default=None)
    t.add_argument("--context", type=int, default=300)
    t.add_argument("--max-size", type=int, default=64)
    t.add_argument("--reps", type=int, default=5)
    t.add_argument("--roof", action="store_true", help="also GMAC/s per pass and the machine's int8 roof")
    r = sub.add_parser("regime", help="where speculation stops paying: measured, and the policy's")
    r.add_argument("--model", default=None)
    r.add_argument("--categories", default="code,summarization,rag")
    r.add_argument("--method", default="ngram")
    r.add_argument("--k", type=int, default=3, help="the static arm's draft length")
    r.add_argument("--k-max", type=int, default=8, help="the policy's bound on K")
    r.add_argument("--batches", default="1,2,4,8,16,32")
    r.add_argument("--tokens", type=int, default=64)
    r.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    return {"decode": decode, "spec": spec, "steps": steps, "regime": regime}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
