"""Training and held-out evaluation of the workload classifier (`specgate policy train-classifier`)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specgate.policies.classes import CLASS_INDEX, WORKLOAD_CLASSES
from specgate.policies.classifier import WorkloadClassifier
from specgate.policies.features import structural
from specgate.policies.request import RequestInfo
from specgate.policies.text_model import LinearTextModel


def row_info(row: dict[str, Any]) -> RequestInfo:
    """A labeled row as the request the gateway would have seen. Tools are kept as text only: the
    structural rule would classify them without the model, and the model must learn them too."""
    tools = row.get("tools") or []
    return RequestInfo(
        text=row["text"],
        last_user=row["text"],
        tool_names=[t["name"] for t in tools],
        tool_descriptions=[t.get("description", "") for t in tools],
    )


def _xy(rows: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, float]], list[str]]:
    infos = [row_info(r) for r in rows]
    return [i.classifier_text() for i in infos], [structural(i) for i in infos], [r["label"] for r in rows]


def fit(rows: list[dict[str, Any]]) -> LinearTextModel:
    texts, dense, labels = _xy(rows)
    return LinearTextModel.fit(texts, dense, labels, WORKLOAD_CLASSES)


def split_by_group(
    rows: list[dict[str, Any]], test_share: float, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Held-out split by source item, stratified by class: no rephrasing of a test prompt is trained on."""
    rng = random.Random(seed)
    test_groups: set[str] = set()
    for label in WORKLOAD_CLASSES:
        groups = sorted({r["group"] for r in rows if r["label"] == label})
        rng.shuffle(groups)
        test_groups.update(groups[: max(1, round(len(groups) * test_share))])
    train = [r for r in rows if r["group"] not in test_groups]
    test = [r for r in rows if r["group"] in test_groups]
    return train, test


@dataclass(slots=True)
class Evaluation:
    accuracy: float
    public_accuracy: float  # on the public prompts only, without the project's variants
    per_class_recall: dict[str, float]
    confusion: list[list[int]]  # [true class][predicted class], in WORKLOAD_CLASSES order
    n_train: int
    n_test: int
    ms_per_request: float  # median, text model path
    errors: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "accuracy": round(self.accuracy, 4),
            "public_accuracy": round(self.public_accuracy, 4),
            "per_class_recall": {k: round(v, 4) for k, v in self.per_class_recall.items()},
            "confusion": self.confusion,
            "classes": list(WORKLOAD_CLASSES),
            "n_train": self.n_train,
            "n_test": self.n_test,
            "ms_per_request": round(self.ms_per_request, 4),
        }

    def table(self) -> str:
        short = [c[:8] for c in WORKLOAD_CLASSES]
        lines = ["true \\ pred   " + " ".join(f"{s:>8}" for s in short)]
        for c, row in zip(WORKLOAD_CLASSES, self.confusion, strict=True):
            lines.append(f"{c:<14}" + " ".join(f"{v:>8}" for v in row))
        return "\n".join(lines)


def evaluate(model: LinearTextModel, test: list[dict[str, Any]], n_train: int) -> Evaluation:
    clf = WorkloadClassifier(model)
    confusion = np.zeros((len(WORKLOAD_CLASSES), len(WORKLOAD_CLASSES)), dtype=int)
    public_hits = public_n = 0
    errors, times = [], []
    for row in test:
        info = row_info(row)
        t0 = time.perf_counter()
        p = clf.text_probs(info)
        times.append(time.perf_counter() - t0)
        pred = WORKLOAD_CLASSES[int(p.argmax())]
        confusion[CLASS_INDEX[row["label"]], CLASS_INDEX[pred]] += 1
        if not row["source"].startswith("synthetic"):
            public_n += 1
            public_hits += pred == row["label"]
        if pred != row["label"]:
            errors.append({"label": row["label"], "pred": pred, "text": row["text"][:120]})
    totals = confusion.sum(axis=1)
    return Evaluation(
        accuracy=float(np.trace(confusion) / max(1, confusion.sum())),
        public_accuracy=public_hits / max(1, public_n),
        per_class_recall={
            c: float(confusion[i, i] / max(1, totals[i])) for i, c in enumerate(WORKLOAD_CLASSES)
        },
        confusion=confusion.tolist(),
        n_train=n_train,
        n_test=len(test),
        ms_per_request=float(np.median(times) * 1e3) if times else 0.0,
        errors=errors,
    )


def train_and_save(
    rows: list[dict[str, Any]], out: Path, seed: int = 0, test_share: float = 0.2
) -> Evaluation:
    """Evaluate on a held-out split, then fit on every row and save the artifact with its report."""
    train, test = split_by_group(rows, test_share, seed)
    evaluation = evaluate(fit(train), test, len(train))
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:12]
    today = dt.datetime.now(dt.UTC).strftime("%Y%m%d")
    metadata = {
        "version": f"wc-{today}-{digest}",
        "trained_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "dataset_sha256": digest,
        "n_rows": len(rows),
        "heldout": evaluation.as_dict(),
    }
    fit(rows).save(out, metadata)
    return evaluation
