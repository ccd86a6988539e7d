"""A circuit breaker per backend: closed, open for a cooldown after repeated failures, then half-open.

Half-open lets one trial request through; its success closes the breaker, its failure reopens it.
A trial that ends with neither (cancelled, an error that is no verdict on the backend) is released
by its owner, so the next request becomes the trial.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(slots=True)
class CircuitBreaker:
    failure_threshold: int = 3
    cooldown: float = 10.0
    clock: Callable[[], float] = time.monotonic
    failures: int = 0
    opened_at: float | None = None
    trial_in_flight: bool = False
    _trial_owner: object = None
    times_opened: int = 0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.cooldown <= 0:
            raise ValueError("failure_threshold must be >= 1 and cooldown > 0")

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return CLOSED
        if self.clock() - self.opened_at >= self.cooldown:
            return HALF_OPEN
        return OPEN

    def allow(self, owner: object = None) -> bool:
        """Whether a request may go out now; in half-open state only one trial at a time, held by `owner`."""
        state = self.state
        if state == CLOSED:
            return True
        if state == HALF_OPEN and not self.trial_in_flight:
            self.trial_in_flight, self._trial_owner = True, owner
            return True
        return False

    def release(self, owner: object) -> None:
        """`owner` is done without a verdict: if it still holds the trial, the next request may take it."""
        if self.trial_in_flight and owner is not None and self._trial_owner is owner:
            self.trial_in_flight, self._trial_owner = False, None

    def retry_after(self) -> float:
        if self.opened_at is None:
            return 0.0
        return max(0.0, self.cooldown - (self.clock() - self.opened_at))

    def record_success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.trial_in_flight, self._trial_owner = False, None

    def record_failure(self) -> None:
        self.failures += 1
        self.trial_in_flight, self._trial_owner = False, None
        if self.opened_at is not None or self.failures >= self.failure_threshold:
            self.opened_at = self.clock()
            self.times_opened += 1
