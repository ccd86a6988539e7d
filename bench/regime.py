"""`specgate bench regime`: where speculation stops paying, measured and as the routing policy computes
it. (bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import defaultdict

from specgate.bench import engine_run, launch, models, workload
from specgate.bench.stats import table
from specgate.engine.step_cost import StepCost, expected_accepted
from specgate.engine.vocab import SpecParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--categories", default="code,summarization,rag")
    p.add_argument("--method", default="ngram")
    p.add_argument("--k", type=int, default=3, help="the static arm's draft length")
    p.add_argument("--k-max", type=int, default=8, help="the policy's bound on K")
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--tokens", type=int, default=64)
    launch.options(p, model=None, reps=2)


def acceptance(accepted: int, drafted: int, k: int) -> float:
    """The per-position acceptance p whose chain of k accepts what a static-K run did."""
    mean = k * accepted / drafted if drafted else 0.0
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accepted(mid, k) < mean else (lo, mid)
    return (lo + hi) / 2


def run(args: argparse.Namespace) -> int:
    path = str(models.gguf_path(args.model))
    engine = engine_run.build(path, kv_cache_bytes=3 << 30)
    batches = [int(b) for b in args.batches.split(",")]
    reqs = workload.shipped(max(batches), args.tokens, [c for c in args.categories.split(",") if c])
    prompts = engine_run.prompt_ids(engine, reqs)
    static = f"{args.method} K={args.k}"
    fixed = SpecParams(args.method, controller="static", num_speculative_tokens=args.k, max_tree_nodes=0)
    # Calibration, and every prompt's prefill cached before anything is timed: the static arm over
    # all the prompts at once gives the per-position acceptance p of this mix.
    st = engine_run.run(engine, prompts, args.tokens, fixed).spec
    p = acceptance(sum(s.num_accepted_tokens for s in st), sum(s.num_draft_tokens for s in st), args.k)
    served = SpecParams(args.method, max_tree_nodes=0, acceptance_prior=round(p, 3))
    arms: dict[str, SpecParams | None] = {"plain": None, args.method: served, static: fixed}
    names = list(arms)
    rates: dict[tuple[str, int], list[float]] = defaultdict(list)
    counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # the static arm's (accepted, drafted)
    steps: list[tuple[int, float]] = []  # its verification passes: (batch tokens, forward ms)
    for rep in range(args.reps):
        for b in batches:
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                batch = engine_run.run(engine, prompts[:b], args.tokens, arms[name])
                tokens, seconds = batch.all_decoding()
                if seconds > 0:
                    rates[(name, b)].append(tokens / seconds)
                for s in batch.spec if name == static else []:
                    counts[b][0] += s.num_accepted_tokens
                    counts[b][1] += s.num_draft_tokens
                    steps += [(step.batch_tokens, step.step_ms) for step in s.steps]
            launch.log(f"repetition {rep + 1}, batch {b} done")
    cost = StepCost.fit(steps, min_steps=10)
    print(f"\n{os.path.basename(path)}: {args.categories}, {args.tokens} greedy tokens")
    print(f"per-position acceptance of the mix (static K={args.k}, all {len(prompts)} prompts): p = {p:.3f}")
    if cost is None:
        print("too few verification steps to fit a step cost curve")
        return 1
    print("step cost fitted from the static arm's verification steps (batch tokens: ms):")
    print(", ".join(f"{t}: {m:.1f}" for t, m in zip(cost.tokens, cost.ms, strict=True)))
    rows, measured = [], None
    for b in batches:
        base = statistics.median(rates[("plain", b)])
        ratios = [statistics.median(rates[(n, b)]) / base for n in names[1:]]
        p_b = acceptance(counts[b][0], counts[b][1], args.k)
        k = cost.best_k(b, p_b, args.k_max)
        gain = cost.gain(b, k, p_b) if k else 1.0
        if measured is None and max(ratios) <= 1.0:
            measured = b
        rows.append([b, f"{base:.1f}", *(f"{x:.2f}x" for x in ratios), f"{p_b:.3f}", f"K={k}, {gain:.2f}x"])
    head = ["batch", "plain tok/s", *(f"{n} / plain" for n in names[1:])]
    head += ["p at this batch", "policy: best K, gain"]
    print("\n".join(table(head, rows)))
    predicted = cost.crossover(p, args.k_max)
    print(
        f"crossover: measured {measured} (the first batch where no arm beats plain), the policy's {predicted}"
    )
    return 0
