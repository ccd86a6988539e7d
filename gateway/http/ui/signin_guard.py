"""A limit on failed dashboard sign-ins per client address.

After `max_failures` failures within `lockout` seconds an address may not try again until the
oldest of them is `lockout` seconds old, whatever key it sends (a guesser must not be able to tell
when it hit). A success clears the address's failures. State is bounded, and per process: with
several workers an address gets that many tries per worker (the refusal budget of the middleware,
which counts every 401, bounds it further).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

MAX_ADDRESSES = 65_536


class SignInGuard:
    def __init__(self, max_failures: int, lockout: float) -> None:
        self.max_failures = max_failures
        self.lockout = lockout
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, addr: str, now: float) -> deque[float]:
        times = self._failures.get(addr)
        if times is None:
            return deque()
        while times and times[0] <= now - self.lockout:
            times.popleft()
        if not times:
            del self._failures[addr]
        return times

    def retry_after(self, addr: str, now: float | None = None) -> float:
        """0.0 if `addr` may try to sign in now, else the seconds until it may."""
        now = time.monotonic() if now is None else now
        times = self._recent(addr, now)
        if len(times) < self.max_failures:
            return 0.0
        return max(1.0, times[0] + self.lockout - now)

    def failed(self, addr: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        times = self._failures.setdefault(addr, deque())
        self._failures.move_to_end(addr)
        times.append(now)
        while len(times) > self.max_failures:
            times.popleft()
        while len(self._failures) > MAX_ADDRESSES:
            self._failures.popitem(last=False)

    def succeeded(self, addr: str) -> None:
        self._failures.pop(addr, None)
