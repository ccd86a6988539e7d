"""CircuitBreaker on a fake clock: closed -> open -> half-open (one trial) -> closed or open again."""

from __future__ import annotations

import pytest

from specgate.gateway.backends.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make(clock: FakeClock, failures: int = 3, cooldown: float = 10.0) -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=failures, cooldown=cooldown, clock=clock)


def open_breaker(breaker: CircuitBreaker) -> None:
    for _ in range(breaker.failure_threshold):
        breaker.record_failure()
    assert breaker.state == OPEN


def test_starts_closed_and_lets_everything_through(clock: FakeClock) -> None:
    b = make(clock)
    assert b.state == CLOSED
    assert all(b.allow() for _ in range(10))
    assert b.retry_after() == 0.0


def test_opens_after_threshold_consecutive_failures(clock: FakeClock) -> None:
    b = make(clock, failures=3)
    b.record_failure()
    b.record_failure()
    assert b.state == CLOSED and b.allow()
    b.record_failure()
    assert b.state == OPEN
    assert not b.allow()
    assert b.times_opened == 1


def test_a_success_resets_the_failure_count(clock: FakeClock) -> None:
    b = make(clock, failures=3)
    for _ in range(5):
        b.record_failure()
        b.record_failure()
        b.record_success()  # never three in a row
    assert b.state == CLOSED and b.allow()
    assert b.times_opened == 0


def test_open_refuses_until_the_cooldown_and_counts_it_down(clock: FakeClock) -> None:
    b = make(clock, failures=1, cooldown=10.0)
    b.record_failure()
    assert b.retry_after() == pytest.approx(10.0)
    clock.advance(4.0)
    assert b.state == OPEN and not b.allow()
    assert b.retry_after() == pytest.approx(6.0)
    clock.advance(5.999)
    assert b.state == OPEN and not b.allow()


def test_half_open_after_cooldown_allows_exactly_one_trial(clock: FakeClock) -> None:
    b = make(clock, failures=2, cooldown=5.0)
    open_breaker(b)
    clock.advance(5.0)
    assert b.state == HALF_OPEN
    assert b.retry_after() == 0.0
    assert b.allow() is True  # the trial
    assert [b.allow() for _ in range(5)] == [False] * 5  # no second request while the trial runs
    clock.advance(100.0)
    assert b.allow() is False  # still one trial, however long it takes
    assert b.state == HALF_OPEN


def test_successful_trial_closes(clock: FakeClock) -> None:
    b = make(clock, failures=2, cooldown=5.0)
    open_breaker(b)
    clock.advance(6.0)
    assert b.allow()
    b.record_success()
    assert b.state == CLOSED
    assert all(b.allow() for _ in range(5))
    # Closed again from scratch: it takes the full threshold to open it once more.
    b.record_failure()
    assert b.state == CLOSED
    b.record_failure()
    assert b.state == OPEN
    assert b.times_opened == 2


def test_failed_trial_reopens_for_a_fresh_cooldown(clock: FakeClock) -> None:
    b = make(clock, failures=3, cooldown=5.0)
    open_breaker(b)
    clock.advance(7.0)
    assert b.allow()
    b.record_failure()  # one failure is enough in half-open, below the threshold
    assert b.state == OPEN
    assert not b.allow()
    assert b.retry_after() == pytest.approx(5.0)  # counted from the failed trial, not the first opening
    assert b.times_opened == 2
    clock.advance(5.0)
    assert b.state == HALF_OPEN
    assert b.allow() and not b.allow()  # a new single trial


@pytest.mark.parametrize(("failures", "cooldown"), [(0, 1.0), (1, 0.0), (1, -1.0)])
def test_rejects_nonsense_settings(failures: int, cooldown: float) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=failures, cooldown=cooldown)


def test_default_clock_is_monotonic_time() -> None:
    b = CircuitBreaker(failure_threshold=1, cooldown=0.05)
    b.record_failure()
    assert b.state == OPEN
    assert 0.0 < b.retry_after() <= 0.05


def test_only_the_trial_owner_releases_an_unresolved_trial(clock: FakeClock) -> None:
    b = make(clock, failures=1, cooldown=1.0)
    open_breaker(b)
    clock.advance(1.0)
    first, second, third = object(), object(), object()
    assert b.allow(owner=first) and not b.allow(owner=second)
    b.release(second)  # not the owner: nothing changes
    assert not b.allow(owner=second)
    b.release(first)  # cancelled without a verdict: the next request becomes the trial
    assert b.allow(owner=second)
    b.record_failure()  # second's verdict reopens the breaker
    clock.advance(1.0)
    assert b.allow(owner=third)
    b.release(second)  # a stale owner cannot free third's trial
    assert not b.allow(owner=first)
    b.release(third)
    assert b.allow(owner=first)
