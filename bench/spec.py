"""`specgate bench spec`: speculation per workload class on one engine.
(bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from specgate.bench import engine_run, launch, models, workload
from specgate.bench.stats import table
from specgate.engine.config import DEFAULT_COMPILE_SIZES
from specgate.engine.vocab import SpecParams

K_MAX = {"ngram": 10, "suffix": 10, "eagle": 6, "draft_model": 6}
# A batch's SpecStats counters that a Tally adds up: its drafts, accepted and nodes.
COUNTERS = ("num_drafts", "num_accepted_tokens", "num_draft_tokens")
EAGLE_GOAL_CLASSES = ("open_chat", "qa", "math_reasoning")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default="ngram,suffix,eagle", help="of ngram, suffix, eagle, draft_model")
    p.add_argument("--draft", default=None, help="the draft_model method's model")
    p.add_argument("--head", default=None, help="EAGLE head directory (default: the shipped one)")
    p.add_argument("--tree-nodes", type=int, default=16, help="max_tree_nodes of the tree arms (0: none)")
    p.add_argument("--fixed", type=int, default=0, help="also static chains of K against static trees K deep")
    p.add_argument("--categories", default="", help="the served benchmark's prompts of these classes")
    p.add_argument("--per-class", type=int, default=2)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--after-prefill", action="store_true", help="time decoding only (from every first token)")
    p.add_argument("--compile", default="", help="compiled step sizes ('default': 1,2,4,8,16)")
    launch.options(p, model=None, max_tokens=96, reps=3, threads=None)
    p.add_argument("--quick", action="store_true", help="1 prompt per class, 48 tokens, 1 repetition")


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

    def add(self, other: Tally) -> Tally:
        for name in ("tokens", "seconds", "drafts", "accepted", "nodes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


Tallies = dict[tuple[int, str, str], Tally]  # by (concurrency, class, arm)


def arms(methods: list[str], tree_nodes: int, fixed: int) -> dict[str, SpecParams | None]:
    out: dict[str, SpecParams | None] = {"plain": None}
    static: dict[str, Any] = {"controller": "static", "num_speculative_tokens": fixed}
    static |= {"k_min": fixed, "k_max": fixed}
    for m in methods:
        out[f"{m} chain"] = SpecParams(m, controller="goodput", k_max=K_MAX[m], max_tree_nodes=0)
        if tree_nodes:
            out[f"{m} tree"] = SpecParams(m, controller="goodput", k_max=K_MAX[m], max_tree_nodes=tree_nodes)
        if fixed:
            out[f"{m} chain-{fixed}"] = SpecParams(m, max_tree_nodes=0, **static)
        if fixed and tree_nodes:
            out[f"{m} tree-{fixed}"] = SpecParams(m, max_tree_nodes=tree_nodes, **static)
    return out


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.per_class, args.max_tokens, args.reps = 1, 48, 1
    named = DEFAULT_COMPILE_SIZES if args.compile == "default" else args.compile.split(",")
    sizes = tuple(int(s) for s in named if s)
    methods = [m for m in args.methods.split(",") if m]
    options: dict[str, dict[str, object]] = {"eagle": {"head": args.head}} if args.head else {}
    if "draft_model" in methods and not args.draft:
        raise ValueError("the draft_model method needs --draft")
    if "draft_model" in methods:
        options["draft_model"] = {"model": models.resolve(args.draft)}
    engine = engine_run.build(
        args.model, args.threads, kv_cache_bytes=2**30, compile_sizes=sizes, proposer_options=options
    )
    by_class: dict[str, list[list[int]]] = defaultdict(list)
    if args.categories:
        reqs = workload.shipped(args.per_class, args.max_tokens, args.categories.split(","))
        for req, ids in zip(reqs, engine_run.prompt_ids(engine, reqs), strict=True):
            by_class[req.category].append(ids)
    else:
        from specgate.gateway.training.eagle.data import chat_ids, prompts

        for cat, text in prompts(0, args.per_class)[1]:
            if held := chat_ids(engine.tokenizer, text, args.max_prompt_tokens):
                by_class[cat].append(held)
    specs = arms(methods, args.tree_nodes, args.fixed)
    names, classes = list(specs), sorted(by_class)
    warm = engine.tokenizer.encode("Warm-up: the quick brown fox jumps over the lazy dog. " * 4)
    for spec in specs.values():  # first calls pay one-off costs; every proposer is built here
        engine_run.run(engine, [warm], 8, spec, cache_scope="warm-up")
    levels = [int(c) for c in args.concurrency.split(",")]
    tally: Tallies = defaultdict(Tally)
    same: dict[str, list[bool]] = defaultdict(list)
    turn = 0
    for rep in range(args.reps):
        for c in levels:
            for cat in classes:
                ps = by_class[cat]
                for batch in [[p] for p in ps] if c == 1 else [[ps[i % len(ps)] for i in range(c)]]:
                    tokens = {}
                    for arm in names[turn % len(names) :] + names[: turn % len(names)]:
                        scope = f"{arm}/{rep}"
                        b = engine_run.run(engine, batch, args.max_tokens, specs[arm], cache_scope=scope)
                        timed = b.after_first_tokens() if args.after_prefill else (b.tokens, b.seconds)
                        counts = [sum(getattr(s, k) for s in b.spec) for k in COUNTERS]
                        tally[c, cat, arm].add(Tally(*timed, *counts))
                        tokens[arm] = [a.tokens for a in b.answers]
                    turn += 1
                    for arm in names[1:] if c == 1 else []:
                        same[arm].append(tokens[arm] == tokens["plain"])
            launch.log(f"repetition {rep + 1}/{args.reps}, concurrency {c} done")
    print(
        f"{sum(map(len, by_class.values()))} prompts in {len(classes)} classes, {args.max_tokens} max new "
        f"tokens, greedy, {engine.config.dtype}, compiled {list(sizes) or 'no'} steps, {args.reps} reps"
    )
    trees = {a: a.replace("chain", "tree") for a in names if "chain" in a}
    pairs = [(chain, tree) for chain, tree in trees.items() if tree in specs]
    for c in levels:
        report(c, classes, names, pairs, tally)
    print("outputs equal to plain (batch 1): " + ", ".join(f"{a} {sum(v)}/{len(v)}" for a, v in same.items()))
    goals(levels, classes, pairs, tally)
    return 0


def report(
    c: int, classes: list[str], names: list[str], pairs: list[tuple[str, str]], tally: Tallies
) -> None:
    print(f"\nconcurrency {c}: tokens/s [mean accepted length]; a tree: (tree / chain) {{nodes a step}}")
    rows = []
    for cat in [*classes, "all"]:
        total = {arm: Tally() for arm in names}
        for arm, k in ((arm, k) for arm in names for k in (classes if cat == "all" else [cat])):
            total[arm].add(tally[c, k, arm])
        cells = [cat, f"{total['plain'].rate:.1f}"]
        for arm, t in list(total.items())[1:]:
            cells.append(f"{t.rate:.1f} [{t.mal:.2f}]")
            if (chain := next((a for a, b in pairs if b == arm), None)) is not None:
                base, nodes = total[chain].rate, t.nodes / t.drafts if t.drafts else 0.0
                cells[-1] += f" ({t.rate / base if base else 0:.2f}x) {{{nodes:.1f}}}"
        rows.append(cells)
    print("\n".join(table(["class", *names], rows)))


def goals(levels: list[int], classes: list[str], pairs: list[tuple[str, str]], tally: Tallies) -> None:
    """[E5]'s goals on these figures: met or missed, with the numbers behind each."""
    print("\ngoals")
    met = {True: "met", False: "missed"}
    for c in levels:
        for a, b, cat in ((a, b, cat) for a, b in pairs for cat in classes):
            chain, tree = tally[c, cat, a], tally[c, cat, b]
            if chain.mal >= 1.5:
                ok = tree.mal >= 1.3 * chain.mal
                print(f"  c={c} {b} {cat}: MAL {tree.mal:.2f} vs 1.3 x {chain.mal:.2f} -> {met[ok]}")
            ok = tree.rate >= 0.97 * chain.rate
            print(f"  c={c} {b} {cat}: {tree.rate:.1f} vs {chain.rate:.1f} tok/s -> {met[ok]} (>= -3%)")
        for cat in [cat for cat in EAGLE_GOAL_CLASSES if cat in classes and (c, cat, "eagle tree") in tally]:
            tree, chain, plain = (tally[c, cat, a] for a in ("eagle tree", "eagle chain", "plain"))
            vs_chain, vs_plain = tree.rate / chain.rate, tree.rate / plain.rate
            ok = vs_chain >= 1.2 and vs_plain >= 1.15
            text = f"{vs_chain:.2f}x chain (>= 1.2), {vs_plain:.2f}x plain (>= 1.15)"
            print(f"  c={c} eagle tree {cat}: {text} -> {met[ok]}")
