"""The workload classifier: structural rules where the request says what it is, a text model elsewhere.

A request that offers tools or asks for JSON output is a tool call by definition; everything else
is classified by `LinearTextModel` over the prompt's text and structural features. The trained
model ships in `policies/data/` and is versioned by its metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specgate.policies.classes import CLASS_INDEX, WORKLOAD_CLASSES
from specgate.policies.features import structural
from specgate.policies.request import RequestInfo
from specgate.policies.text_model import LinearTextModel

DEFAULT_ARTIFACT = Path(__file__).resolve().parent / "data" / "workload_classifier.npz"


@dataclass(slots=True)
class Classification:
    label: str
    confidence: float
    probs: dict[str, float]
    rule: str | None = None  # set when a structural rule decided, not the text model


@dataclass(slots=True)
class WorkloadClassifier:
    model: LinearTextModel
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def version(self) -> str:
        return str(self.metadata.get("version", "unversioned"))

    @classmethod
    def load(cls, path: Path = DEFAULT_ARTIFACT) -> WorkloadClassifier:
        if not path.exists():
            raise FileNotFoundError(
                f"workload classifier artifact {path} is missing; "
                "build it with `specgate policy train-classifier`"
            )
        model, metadata = LinearTextModel.load(path)
        if tuple(model.classes) != WORKLOAD_CLASSES:
            raise ValueError(
                f"{path} was trained for classes {model.classes}, expected {list(WORKLOAD_CLASSES)}"
            )
        return cls(model, metadata)

    def text_probs(self, info: RequestInfo) -> np.ndarray:
        return self.model.predict_proba(info.classifier_text(), structural(info))  # [n_classes]

    def classify(self, info: RequestInfo) -> Classification:
        if info.has_tools or info.json_mode:
            probs = dict.fromkeys(WORKLOAD_CLASSES, 0.0)
            probs["tool_call"] = 1.0
            return Classification("tool_call", 1.0, probs, rule="tools" if info.has_tools else "json_mode")
        p = self.text_probs(info)
        best = int(p.argmax())
        return Classification(
            WORKLOAD_CLASSES[best],
            float(p[best]),
            {c: round(float(p[CLASS_INDEX[c]]), 4) for c in WORKLOAD_CLASSES},
        )
