"""`specgate eagle train | eval`: the arguments of EAGLE head training and evaluation
(gateway/training/eagle/run.py does the work)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _report(results: dict[str, dict[str, Any]], label: str) -> None:
    w = sys.stdout.write
    w(f"{label}: mean accepted length (tokens per verification step) and draft acceptance, held out\n")
    for cat, r in results.items():
        mal, rate = r["mean_acceptance_length"], r["acceptance_rate"]
        w(
            f"  {cat:<15} {r['requests']:>3} requests  "
            f"{'-' if mal is None else f'{mal:.2f}':>6}  {'-' if rate is None else f'{rate:.3f}':>6}\n"
        )


def _config(args: argparse.Namespace) -> Any:
    from specgate.gateway.training.eagle.run import RunConfig

    fields = set(RunConfig.__slots__)
    return RunConfig(**{k: v for k, v in vars(args).items() if k in fields})


def cmd_train(args: argparse.Namespace) -> int:
    from specgate.gateway.training.eagle.run import train_and_evaluate

    cfg = _config(args)
    _report(train_and_evaluate(cfg), f"eagle, k={cfg.k}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from specgate.gateway.training.eagle.run import evaluate

    cfg = _config(args)
    for method in args.methods.split(","):
        _report(evaluate(cfg, method, Path(args.head) if args.head else None), f"{method}, k={cfg.k}")
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
            p.add_argument("--ttt-steps", type=int, default=0, help="EAGLE-3 training-time test passes (0-4)")
            p.add_argument("--init-head", default=None, help="fine-tune this head directory")
        else:
            p.add_argument("--head", default=None, help="head directory (default: the shipped one)")
            p.add_argument("--methods", default="eagle,ngram,suffix")
