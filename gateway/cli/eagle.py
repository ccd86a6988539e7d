"""`specgate eagle train | eval`: train an EAGLE head for the served model on this machine's CPU,
and measure its held-out acceptance per workload class."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any


def _engine(args: argparse.Namespace, head: Path | None = None, pack: bool | None = None) -> Any:
    from specgate.engine.config import EngineConfig
    from specgate.engine.engine import Engine
    from specgate.gateway.settings import default_cache_dir

    options = {"eagle": {"head": str(head)}} if head is not None else {}
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(512, args.max_prompt_tokens),
        proposer_options=options,
        pack_linears=pack,
        convert_cache_dir=default_cache_dir(),
    )
    return Engine(config)


def _report(results: dict[str, dict[str, Any]], label: str) -> None:
    w = sys.stdout.write
    w(f"{label}: mean accepted length (tokens per verification step) and draft acceptance, held out\n")
    for cat, r in results.items():
        mal, rate = r["mean_acceptance_length"], r["acceptance_rate"]
        w(
            f"  {cat:<15} {r['requests']:>3} requests  "
            f"{'-' if mal is None else f'{mal:.2f}':>6}  {'-' if rate is None else f'{rate:.3f}':>6}\n"
        )


def cmd_train(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from specgate.engine.spec_decode.eagle_io import save_head
    from specgate.gateway.training.eagle import data
    from specgate.gateway.training.eagle.evaluate import acceptance_by_class
    from specgate.gateway.training.eagle.train import TrainConfig, draft_vocabulary, init_head, train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train_items, eval_items = data.prompts(args.train_per_class, args.eval_per_class, args.seed)
    engine = _engine(args, pack=False)  # training reads the target's weights as plain tensors
    samples_path = out / "samples.pt"
    if args.resume and samples_path.exists():
        samples = [data.Sample(**s) for s in torch.load(samples_path, weights_only=False)]
        sys.stdout.write(f"resumed {len(samples)} self-distilled samples from {samples_path}\n")
    else:
        with tqdm(total=len(train_items), desc="self-distillation", unit="prompt") as bar:
            samples = data.self_distill(
                engine, train_items, args.max_tokens, args.max_prompt_tokens, bar.update
            )
        with tqdm(total=len(samples), desc="target features", unit="seq") as bar:
            data.collect_features(engine.runner, samples, bar.update)
        torch.save([{k: getattr(s, k) for k in s.__slots__} for s in samples], samples_path)
    tokens = sum(len(s.token_ids) - s.prompt_len for s in samples)
    sys.stdout.write(f"{len(samples)} samples, {tokens} answer tokens\n")
    head = init_head(engine.runner, identity=not args.random_init)
    cfg = TrainConfig(steps=args.steps, lr=args.lr, batch_tokens=args.batch_tokens, seed=args.seed)
    with tqdm(total=cfg.steps, desc="training", unit="step") as bar:

        def on_step(step: int, m: dict[str, float]) -> None:
            bar.n = step + 1
            bar.set_postfix(vloss=f"{m['vloss']:.3f}", ploss=f"{m['ploss']:.2f}", acc=f"{m['acc']:.3f}")
            bar.refresh()

        metrics = train(head, engine.runner, samples, cfg, out / "checkpoint.pt", args.resume, on_step)
    if args.draft_vocab > 0:
        head.draft_vocab, coverage = draft_vocabulary(samples, args.draft_vocab)
        sys.stdout.write(
            f"draft vocabulary: {len(head.draft_vocab)} tokens, {coverage:.1%} of training answer tokens\n"
        )
    head_dir = out / "head"
    command = "specgate eagle train " + shlex.join(
        sys.argv[3:] if sys.argv[1:3] == ["eagle", "train"] else []
    )
    provenance = {
        "target": engine.model_name,
        "command": command,
        "samples": len(samples),
        "answer_tokens": tokens,
        "steps": cfg.steps,
        "final_train_metrics": metrics,
    }
    save_head(head.to(torch.bfloat16), head_dir, {"specgate": provenance})
    sys.stdout.write(f"head -> {head_dir} ({time.time() - t0:.0f} s so far)\n")
    del engine
    ev = _engine(args, head=head_dir)
    with tqdm(total=len(eval_items), desc="held-out evaluation", unit="prompt") as bar:
        results = acceptance_by_class(
            ev, eval_items, "eagle", args.k, args.max_tokens, args.max_prompt_tokens, bar.update
        )
    _report(results, f"eagle, k={args.k}")
    (out / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specgate.gateway.training.eagle import data
    from specgate.gateway.training.eagle.evaluate import acceptance_by_class

    _, eval_items = data.prompts(args.train_per_class, args.eval_per_class, args.seed)
    for method in args.methods.split(","):
        engine = _engine(args, head=Path(args.head) if args.head else None)
        with tqdm(total=len(eval_items), desc=method, unit="prompt") as bar:
            results = acceptance_by_class(
                engine, eval_items, method, args.k, args.max_tokens, args.max_prompt_tokens, bar.update
            )
        _report(results, f"{method}, k={args.k}")
    return 0


def add_eagle_parser(sub: Any) -> None:
    eagle = sub.add_parser("eagle", help="EAGLE draft heads: train one for the served model, evaluate it")
    cmds = eagle.add_subparsers(dest="eagle_command", required=True)
    for name, func, text in (
        ("train", cmd_train, "self-distil, train, save and evaluate a head"),
        ("eval", cmd_eval, "held-out acceptance per workload class"),
    ):
        p = cmds.add_parser(name, help=text)
        p.add_argument("--model", default=None, help="target model (default: the embedded default)")
        p.add_argument("--dtype", default="auto")
        p.add_argument("--train-per-class", type=int, default=40, help="training prompts per class")
        p.add_argument("--eval-per-class", type=int, default=4, help="held-out prompts per class")
        p.add_argument("--max-tokens", type=int, default=160, help="answer length")
        p.add_argument("--max-prompt-tokens", type=int, default=384)
        p.add_argument("--batch", type=int, default=48, help="engine batch size")
        p.add_argument("--k", type=int, default=4, help="draft length for the evaluation")
        p.add_argument("--seed", type=int, default=0)
        p.set_defaults(func=func)
        if name == "train":
            p.add_argument("--out", default="eagle-out", help="samples, checkpoint, head/ and eval.json")
            p.add_argument("--steps", type=int, default=600)
            p.add_argument("--lr", type=float, default=1e-3)
            p.add_argument("--batch-tokens", type=int, default=1024)
            p.add_argument(
                "--draft-vocab",
                type=int,
                default=8192,
                help="tokens drafts may use (0: the whole vocabulary)",
            )
            p.add_argument(
                "--resume", action="store_true", help="reuse samples.pt and checkpoint.pt in --out"
            )
            p.add_argument("--random-init", action="store_true", help="start from noise, not the identity")
        else:
            p.add_argument("--head", default=None, help="head directory (default: the shipped one)")
            p.add_argument("--methods", default="eagle,ngram,suffix")
