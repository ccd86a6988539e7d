"""The workload classifier: structural rules where the request says what it is, a text model elsewhere.

A request that offers tools or asks for JSON output is a tool call by definition; everything else
is classified by `LinearTextModel` over the prompt's text and structural features. The trained
model ships in `policies/data/` and is versioned by its metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specgate.policies.classes import CLASS_INDEX, WORKLOAD_CLASSES
from specgate.policies.features import structural
from specgate.policies.request import RequestInfo
from specgate.policies.text_model import LinearTextModel

DEFAULT_ARTIFACT = Path(__file__).resolve().parent / "data" / "workload_classifier.npz"
SCORE_CACHE_ENTRIES = 4096  # under 1 MiB: a 16-byte key and a few floats each


class ScoreCache:
    """A bounded LRU map from a digest to what was computed from it (thread-safe)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.hits = self.misses = 0
        self._entries: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> Any:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: bytes, value: Any) -> None:
        if isinstance(value, np.ndarray):
            value.flags.writeable = False  # shared by every request that hits it
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)


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
    # The text model's scores by the bounded text it reads: requests that open the same way (one
    # system prompt and question, an agent's fixed preamble, retries) are scored once.
    cache: ScoreCache = field(default_factory=lambda: ScoreCache(SCORE_CACHE_ENTRIES))
    answers: ScoreCache = field(default_factory=lambda: ScoreCache(SCORE_CACHE_ENTRIES))

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
        logits = self._text_logits(info.classifier_text())
        return self.model.proba_from(logits, structural(info))  # [n_classes]

    def _text_logits(self, text: str) -> np.ndarray:
        key = _digest(text)
        logits: np.ndarray | None = self.cache.get(key)
        if logits is None:
            logits = self.model.text_logits(text)
            self.cache.put(key, logits)
        return logits

    def classify(self, info: RequestInfo) -> Classification:
        if info.has_tools or info.json_mode:
            probs = dict.fromkeys(WORKLOAD_CLASSES, 0.0)
            probs["tool_call"] = 1.0
            return Classification("tool_call", 1.0, probs, rule="tools" if info.has_tools else "json_mode")
        text, dense = info.classifier_text(), structural(info)
        # The whole answer, by the text the model reads and the structure around it.
        key = _digest(text) + struct.pack(f"{len(dense)}d", *dense.values())
        known: Classification | None = self.answers.get(key)
        if known is None:
            p = self.model.proba_from(self._text_logits(text), dense)
            best = int(p.argmax())
            probs = {c: round(float(p[CLASS_INDEX[c]]), 4) for c in WORKLOAD_CLASSES}
            known = Classification(WORKLOAD_CLASSES[best], float(p[best]), probs)
            self.answers.put(key, known)
        return dataclasses.replace(known, probs=dict(known.probs))  # the caller's own copy


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
