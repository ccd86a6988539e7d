"""The cap on explored traffic: a sliding window of recent decisions, shared by every policy."""

from __future__ import annotations

import collections
import threading


class ExplorationBudget:
    def __init__(self, cap: float, window: int = 500) -> None:
        if not 0.0 <= cap <= 1.0 or window < 1:
            raise ValueError("cap must be in [0, 1] and window >= 1")
        self.cap = cap
        self._recent: collections.deque[bool] = collections.deque(maxlen=window)
        self._explored = 0
        self._lock = threading.Lock()

    def allows(self) -> bool:
        """Whether one more explored decision keeps the window's explored share within the cap."""
        with self._lock:
            n = len(self._recent)
            evicted = 1 if n == self._recent.maxlen and self._recent[0] else 0
            size = min(n + 1, self._recent.maxlen or n + 1)
            return (self._explored - evicted + 1) <= self.cap * size

    def note(self, explored: bool) -> None:
        with self._lock:
            if len(self._recent) == self._recent.maxlen and self._recent[0]:
                self._explored -= 1
            self._recent.append(explored)
            self._explored += explored

    @property
    def share(self) -> float:
        with self._lock:
            return self._explored / len(self._recent) if self._recent else 0.0
