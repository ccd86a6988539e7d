"""A limit on failed dashboard sign-ins per client address.

After `max_failures` failures within `lockout` seconds an address may not try again until the
oldest of them is `lockout` seconds old, whatever key it sends (a guesser must not be able to tell
when it hit). A success clears the address's failures. State is bounded.

With several worker processes (`specgate serve --workers N`) the failures are counted in shared
memory instead (`shared`: a bucket per address in limits/shared.py, the same for every worker, so
an address gets `max_failures` tries in all, not per worker). A bucket cannot keep every failure's
time, so there the limit is the same rate kept differently: `max_failures` tries at once, then one
more each `lockout / max_failures` seconds (the refusal budget of the middleware, which counts
every 401, bounds it further in both modes).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque

from specgate.gateway.limits.shared_buckets import SharedRateLimiter

MAX_ADDRESSES = 65_536


class SignInGuard:
    def __init__(self, max_failures: int, lockout: float, shared: SharedRateLimiter | None = None) -> None:
        if max_failures < 1 or lockout <= 0:
            raise ValueError("a sign-in guard needs max_failures >= 1 and a positive lockout")
        if shared is not None and not (
            shared.burst == max_failures and math.isclose(shared.rate, max_failures / lockout)
        ):
            raise ValueError("the shared sign-in bucket was made for other limits")
        self.max_failures = max_failures
        self.lockout = lockout
        self.shared = shared  # the workers' bucket per address; None: the failures below
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
        if self.shared is not None:
            wait = self.shared.wait(addr, now)
            return max(1.0, wait) if wait else 0.0
        times = self._recent(addr, now)
        if len(times) < self.max_failures:
            return 0.0
        return max(1.0, times[0] + self.lockout - now)

    def failed(self, addr: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.shared is not None:
            self.shared.take(addr, now)
            return
        times = self._failures.setdefault(addr, deque())
        self._failures.move_to_end(addr)
        times.append(now)
        while len(times) > self.max_failures:
            times.popleft()
        while len(self._failures) > MAX_ADDRESSES:
            self._failures.popitem(last=False)

    def succeeded(self, addr: str) -> None:
        if self.shared is not None:
            self.shared.reset(addr)
        self._failures.pop(addr, None)
