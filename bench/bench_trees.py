"""Draft trees against chains, per workload class, for the n-gram, suffix, EAGLE and draft-model
proposers.

    python bench/bench_trees.py [--per-class 2] [--max-tokens 96] [--reps 3] [--concurrency 1,4]
                                [--methods ngram,suffix,eagle] [--tree-nodes 16] [--fixed K]
                                [--head DIR] [--compile SIZES] [--quick]
    python bench/bench_trees.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
                                --methods ngram,suffix,draft_model

The default model (or --model: a GGUF path or a name from bench/models.py) in its serving dtype,
greedy; `draft_model` drafts with --draft. --categories takes the served benchmark's prompts of
those classes instead of the held-out split below (which has no summarization or rag prompts). Every
arm runs on one engine (speculation is per request), so all arms share the machine's state and, with
--compile, one set of compiled steps. Arms: plain decoding, and per method a chain (max_tree_nodes
0) and a tree (max_tree_nodes N), both under the goodput controller (as served); with --fixed K also
a static chain of K drafts against a static tree K deep of N nodes (what a tree accepts when its
size is not weighed against its cost). Prompts are by default the held-out side of the split the
shipped EAGLE head was trained on (`gateway.training.eagle.data.prompts`), so the head never saw
them. Repetitions are interleaved: each repetition runs every class, and within it every arm in turn
(the order rotating), prompt by prompt at batch 1 and the class's prompts c at a time at concurrency
c. The suffix cache of finished outputs is scoped per arm and repetition, so no arm learns from
another's outputs or from an earlier repetition of the same prompts.

Reported per concurrency and class: tokens/s, and per method chain and tree tokens/s with the mean
accepted length (tokens per verification step, the bonus token included) and the tree's mean drafted
nodes; then the issue's goals, checked on these figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

from specgate.bench.models import resolve
from specgate.bench.serve.datasets import shipped
from specgate.engine.config import DEFAULT_COMPILE_SIZES, EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.params import SpecParams
from specgate.gateway.backends.embedded.chat_template import render_chat
from specgate.gateway.settings import default_cache_dir
from specgate.gateway.training.eagle.data import chat_ids, prompts

K_MAX = {"ngram": 10, "suffix": 10, "eagle": 6, "draft_model": 6}
EAGLE_GOAL_CLASSES = ("open_chat", "qa", "math_reasoning")


@dataclass(slots=True)
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0
    accepted: int = 0
    nodes: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mal(self) -> float:
        """Mean accepted length: tokens per verification step, the bonus token included."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def mean_nodes(self) -> float:
        return self.nodes / self.drafts if self.drafts else 0.0

    def add(self, other: Tally) -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.drafts += other.drafts
        self.accepted += other.accepted
        self.nodes += other.nodes


def arms(methods: list[str], tree_nodes: int, fixed: int) -> dict[str, SpecParams | None]:
    out: dict[str, SpecParams | None] = {"plain": None}
    for m in methods:
        out[f"{m} chain"] = SpecParams(m, controller="goodput", k_max=K_MAX[m], max_tree_nodes=0)
        out[f"{m} tree"] = SpecParams(m, controller="goodput", k_max=K_MAX[m], max_tree_nodes=tree_nodes)
        if fixed:
            static = dict(controller="static", num_speculative_tokens=fixed, k_min=fixed, k_max=fixed)
            out[f"{m} chain-{fixed}"] = SpecParams(m, max_tree_nodes=0, **static)  # type: ignore[arg-type]
            out[f"{m} tree-{fixed}"] = SpecParams(m, max_tree_nodes=tree_nodes, **static)  # type: ignore[arg-type]
    return out


def pairs(methods: list[str], fixed: int) -> list[tuple[str, str, str]]:
    """(method, chain arm, tree arm) compared in the tables."""
    out = [(m, f"{m} chain", f"{m} tree") for m in methods]
    if fixed:
        out += [(m, f"{m} chain-{fixed}", f"{m} tree-{fixed}") for m in methods]
    return out


def run_batch(
    engine: Engine,
    batch: list[list[int]],
    spec: SpecParams | None,
    max_tokens: int,
    scope: str,
    after_prefill: bool = False,
) -> Tally:
    """Submit `batch` at once and run it to completion; the batch's totals. With `after_prefill`,
    tokens and seconds count only from when every request has its first token: long prompts' prefill
    (cached for every arm but the first to run a prompt) would otherwise weigh more than decoding."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    tag = time.perf_counter_ns()
    for i, ids in enumerate(batch):
        engine.add_request(f"{scope}-{tag}-{i}", ids, params, spec, cache_scope=scope)
    t = Tally()
    start = time.perf_counter()
    started: set[str] = set()
    counting = not after_prefill
    while engine.has_unfinished():
        for out in engine.step():
            if counting:
                t.tokens += len(out.new_token_ids)
            if out.new_token_ids:
                started.add(out.request_id)
            st = out.stats.spec
            if out.finished and st is not None:
                t.drafts += st.num_drafts
                t.accepted += st.num_accepted_tokens
                t.nodes += st.num_draft_tokens
        if not counting and len(started) == len(batch):
            counting, start = True, time.perf_counter()
    t.seconds = time.perf_counter() - start
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-class", type=int, default=2, help="held-out prompts per class")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--methods", default="ngram,suffix,eagle")
    ap.add_argument("--tree-nodes", type=int, default=16, help="max_tree_nodes of the tree arms")
    ap.add_argument(
        "--fixed", type=int, default=0, help="also static chains of K against static trees K deep"
    )
    ap.add_argument("--head", default=None, help="EAGLE head directory (default: the shipped one)")
    ap.add_argument("--model", default=None, help="target: a GGUF path or a bench/models.py name")
    ap.add_argument("--draft", default=None, help="draft model of the draft_model method")
    ap.add_argument(
        "--after-prefill", action="store_true", help="time decoding only, from every request's first token"
    )
    ap.add_argument(
        "--categories",
        default="",
        help="prompts of these served-benchmark categories (e.g. code,summarization,rag) instead of "
        "the EAGLE head's held-out split",
    )
    ap.add_argument(
        "--compile", default="", help="compiled step sizes, e.g. 1,2,4,8,16,32 ('default': 1,2,4,8,16)"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="1 prompt per class, 48 tokens, 1 repetition")
    args = ap.parse_args()
    if args.quick:
        args.per_class, args.max_tokens, args.reps = 1, 48, 1
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    sizes: tuple[int, ...] = ()
    if args.compile == "default":
        sizes = DEFAULT_COMPILE_SIZES
    elif args.compile:
        sizes = tuple(int(s) for s in args.compile.split(","))
    methods = [m for m in args.methods.split(",") if m]
    arm_specs = arms(methods, args.tree_nodes, args.fixed)
    options: dict[str, dict[str, object]] = {"eagle": {"head": args.head}} if args.head else {}
    if "draft_model" in methods:
        if not args.draft:
            raise SystemExit("the draft_model method needs --draft")
        options["draft_model"] = {"model": resolve(args.draft)}
    model = {"model": resolve(args.model)} if args.model else {}
    engine = Engine(
        EngineConfig(
            **model,  # type: ignore[arg-type]
            convert_cache_dir=default_cache_dir(),
            num_threads=args.threads,
            kv_cache_bytes=2**30,
            compile_sizes=sizes,
            proposer_options=options,
        )
    )
    tok = engine.tokenizer
    by_class: dict[str, list[list[int]]] = defaultdict(list)
    if args.categories:
        # The served benchmark's prompts (Spec-Bench, HumanEval, BFCL ...), whole: copy-heavy classes
        # such as summarization and rag live there, and their long contexts are the point.
        for req in shipped(args.per_class, args.max_tokens, args.categories.split(",")):
            by_class[req.category].append(render_chat(tok, req.messages, req.tools))
    else:
        _, held_out = prompts(0, args.per_class)
        for cat, text in held_out:
            ids = chat_ids(tok, text, args.max_prompt_tokens)
            if ids:
                by_class[cat].append(ids)
    classes = sorted(by_class)
    warm = tok.encode("Warm-up: the quick brown fox jumps over the lazy dog. " * 4)
    for spec in arm_specs.values():  # first calls pay one-off costs; every proposer is built here
        run_batch(engine, [warm], spec, 8, "warm-up")
    levels = [int(c) for c in args.concurrency.split(",")]
    tally: dict[tuple[int, str, str], Tally] = defaultdict(Tally)
    names = list(arm_specs)
    print(
        f"{sum(len(v) for v in by_class.values())} held-out prompts in {len(classes)} classes, "
        f"{args.max_tokens} max new tokens, greedy, {engine.config.dtype}, "
        f"compiled steps {list(sizes) or 'off'}, {args.reps} interleaved repetitions",
        flush=True,
    )
    turn = 0
    for rep in range(args.reps):
        for c in levels:
            for cat in classes:
                ps = by_class[cat]
                batches = [[p] for p in ps] if c == 1 else [[ps[i % len(ps)] for i in range(c)]]
                for batch in batches:
                    order = names[turn % len(names) :] + names[: turn % len(names)]
                    turn += 1
                    for arm in order:
                        got = run_batch(
                            engine, batch, arm_specs[arm], args.max_tokens, f"{arm}/{rep}", args.after_prefill
                        )
                        tally[c, cat, arm].add(got)
            print(f"repetition {rep + 1}/{args.reps}, concurrency {c} done", file=sys.stderr, flush=True)
    compared = pairs(methods, args.fixed)
    for c in levels:
        report(c, classes, compared, tally)
    goals(levels, classes, compared, tally)


def _total(tally: dict[tuple[int, str, str], Tally], c: int, cats: list[str], arm: str) -> Tally:
    out = Tally()
    for cat in cats:
        out.add(tally[c, cat, arm])
    return out


def report(
    c: int, classes: list[str], compared: list[tuple[str, str, str]], tally: dict[tuple[int, str, str], Tally]
) -> None:
    print(f"\nconcurrency {c}: tokens/s [mean accepted length]; tree: (tree / chain tokens/s) {{mean nodes}}")
    print("| class | plain | " + " | ".join(f"{a} | {b}" for _, a, b in compared) + " |")
    print("|---|---|" + "---|---|" * len(compared))
    for cat in [*classes, "all"]:
        cats = classes if cat == "all" else [cat]
        plain = _total(tally, c, cats, "plain")
        cells = [f"{plain.rate:.1f}"]
        for _, a, b in compared:
            chain, tree = _total(tally, c, cats, a), _total(tally, c, cats, b)
            cells.append(f"{chain.rate:.1f} [{chain.mal:.2f}]")
            ratio = tree.rate / chain.rate if chain.rate else 0.0
            cells.append(f"{tree.rate:.1f} [{tree.mal:.2f}] ({ratio:.2f}x) {{{tree.mean_nodes:.1f}}}")
        print(f"| {cat} | " + " | ".join(cells) + " |")


def goals(
    levels: list[int],
    classes: list[str],
    compared: list[tuple[str, str, str]],
    tally: dict[tuple[int, str, str], Tally],
) -> None:
    """The issue's goals on these figures: met or missed, with the numbers behind each."""
    print("\ngoals")
    methods = sorted({m for m, _, _ in compared})
    for c in levels:
        for _, a, b in compared:
            for cat in classes:
                chain, tree = tally[c, cat, a], tally[c, cat, b]
                if chain.mal >= 1.5:
                    ok = tree.mal >= 1.3 * chain.mal
                    print(
                        f"  c={c} {b} {cat}: MAL {tree.mal:.2f} vs 1.3 x {a} {chain.mal:.2f} "
                        f"-> {'met' if ok else 'missed'}"
                    )
                ok = tree.rate >= 0.97 * chain.rate
                print(
                    f"  c={c} {b} {cat}: {tree.rate:.1f} tok/s vs {a} {chain.rate:.1f} "
                    f"({tree.rate / chain.rate - 1:+.1%}) -> {'met' if ok else 'missed'} (>= -3%)"
                )
        if "eagle" in methods:
            for cat in EAGLE_GOAL_CLASSES:
                if cat not in classes:
                    continue
                tree, chain = tally[c, cat, "eagle tree"], tally[c, cat, "eagle chain"]
                plain = tally[c, cat, "plain"]
                vs_chain, vs_plain = tree.rate / chain.rate, tree.rate / plain.rate
                ok = vs_chain >= 1.2 and vs_plain >= 1.15
                print(
                    f"  c={c} eagle tree {cat}: {vs_chain:.2f}x its chain (>= 1.2), {vs_plain:.2f}x plain "
                    f"(>= 1.15) -> {'met' if ok else 'missed'}"
                )


if __name__ == "__main__":
    main()
