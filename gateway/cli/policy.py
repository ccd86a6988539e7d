"""`specgate policy ...`: build the labeled prompts, train and try the workload classifier."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def cmd_build_dataset(args: argparse.Namespace) -> int:
    from collections import Counter

    from specgate.policies.training import dataset

    rows = dataset.build(Path(args.source), seed=args.seed)
    out = Path(args.out) if args.out else dataset.DEFAULT_DATASET
    dataset.save(rows, out)
    counts = Counter(r["label"] for r in rows)
    sys.stdout.write(f"{len(rows)} labeled prompts -> {out}\n")
    for label, n in sorted(counts.items()):
        sys.stdout.write(f"  {label:<15} {n}\n")
    return 0


def cmd_train_classifier(args: argparse.Namespace) -> int:
    from specgate.policies.classifier import DEFAULT_ARTIFACT
    from specgate.policies.training import dataset
    from specgate.policies.training.classifier import train_and_save

    rows = dataset.load(Path(args.data) if args.data else dataset.DEFAULT_DATASET)
    out = Path(args.out) if args.out else DEFAULT_ARTIFACT
    ev = train_and_save(rows, out, seed=args.seed, test_share=args.test_share)
    w = sys.stdout.write
    w(f"trained on {len(rows)} prompts; held-out evaluation on {ev.n_test} (split by source item):\n")
    w(f"  accuracy {ev.accuracy:.4f}   public prompts only {ev.public_accuracy:.4f}\n")
    w(f"  median classification time {ev.ms_per_request:.3f} ms per request\n")
    w("  recall per class: " + ", ".join(f"{c} {r:.3f}" for c, r in ev.per_class_recall.items()) + "\n")
    w("confusion matrix (rows: true class, columns: predicted):\n" + ev.table() + "\n")
    for err in ev.errors[: args.show_errors]:
        w(f"  miss: {err['label']} -> {err['pred']}: {err['text']!r}\n")
    w(f"artifact -> {out}\n")
    return 0


def cmd_classify(args: argparse.Namespace) -> int:
    from specgate.policies.classifier import DEFAULT_ARTIFACT, WorkloadClassifier
    from specgate.policies.features import request_features
    from specgate.policies.request import RequestInfo

    clf = WorkloadClassifier.load(Path(args.artifact) if args.artifact else DEFAULT_ARTIFACT)
    info = RequestInfo(text=args.text, last_user=args.text, temperature=args.temperature)
    c = clf.classify(info)
    out: dict[str, Any] = {"class": c.label, "confidence": round(c.confidence, 4), "probs": c.probs}
    out["features"] = {k: round(v, 4) for k, v in request_features(info, c.probs).items()}
    out["classifier_version"] = clf.version
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    return 0


def add_policy_parser(sub: Any) -> None:
    policy = sub.add_parser("policy", help="routing policy: workload classifier data and training")
    cmds = policy.add_subparsers(dest="policy_command", required=True)

    build = cmds.add_parser("build-dataset", help="labeled prompts from the public workload data")
    build.add_argument(
        "--source", default="bench/data", help="directory with Spec-Bench, HumanEval, GSM8K, BFCL"
    )
    build.add_argument("--out", default=None, help="default: policies/data/workload_prompts.jsonl.gz")
    build.add_argument("--seed", type=int, default=0)
    build.set_defaults(func=cmd_build_dataset)

    train = cmds.add_parser("train-classifier", help="train, evaluate held-out, and save the classifier")
    train.add_argument("--data", default=None, help="labeled prompts (default: the shipped set)")
    train.add_argument("--out", default=None, help="default: policies/data/workload_classifier.npz")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--test-share", type=float, default=0.2)
    train.add_argument("--show-errors", type=int, default=10, help="misclassified held-out prompts to print")
    train.set_defaults(func=cmd_train_classifier)

    classify = cmds.add_parser("classify", help="classify one prompt and print its features")
    classify.add_argument("text")
    classify.add_argument("--temperature", type=float, default=1.0)
    classify.add_argument("--artifact", default=None)
    classify.set_defaults(func=cmd_classify)
