"""The limits shared by a gateway's worker processes: RateLimiter's semantics, one limit across
processes (really spawned, as the supervisor does), the refusal budget, revocations, the segment's
life."""

from __future__ import annotations

import multiprocessing
import random
from collections.abc import Iterator
from multiprocessing.shared_memory import SharedMemory

import pytest

from specgate.gateway.limits.limiters import Limiter, RateLimiter, RefusalBudget
from specgate.gateway.limits.shared import SharedLimits, attached
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.settings import Settings


@pytest.fixture
def limits() -> Iterator[SharedLimits]:
    handle = SharedLimits.create(Settings(rate_limit_rpm=60, refused_rpm=6))
    yield handle
    handle.close()


def test_the_shared_limiter_answers_as_the_in_process_one(limits: SharedLimits) -> None:
    shared: Limiter = limits.attach().api
    local: Limiter = RateLimiter(rpm=60)
    rng = random.Random(7)
    now = 1000.0
    for _ in range(3000):
        now += rng.choice([0.0, 0.0, 0.1, 0.5, 2.0, 30.0])
        key = f"k{rng.randrange(20)}"
        op = rng.choice(["take", "wait", "check"])
        if op == "check":
            outcomes = []
            for limiter in (shared, local):
                try:
                    limiter.check(key, now)
                    outcomes.append(None)
                except GatewayError as exc:
                    outcomes.append((exc.status, exc.retry_after, exc.message))
            assert outcomes[0] == outcomes[1]
        else:
            assert getattr(shared, op)(key, now) == getattr(local, op)(key, now), (op, key, now)


def test_off_and_unknown_keys(limits: SharedLimits) -> None:
    off = SharedLimits.create(Settings(rate_limit_rpm=0))
    try:
        for _ in range(100):
            off.attach().api.check("k", now=0.0)
    finally:
        off.close()
    assert limits.attach().api.wait("never-seen", now=5.0) == 0.0  # and makes no bucket for it


def _hammer(handle: SharedLimits, n: int, out: multiprocessing.Queue[int]) -> None:
    api = handle.attach().api
    out.put(sum(api.take("addr:203.0.113.7", now=500.0) == 0.0 for _ in range(n)))


@pytest.mark.slow
def test_worker_processes_share_one_limit(limits: SharedLimits) -> None:
    """Two spawned processes (the handle travels in their spawn arguments, as the supervisor sends
    it) and this one spend from one bucket: together they get one burst (10 at 60 rpm), not 3."""
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[int] = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(limits, 200, out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    here = sum(limits.attach().api.take("addr:203.0.113.7", now=500.0) == 0.0 for _ in range(50))
    assert sum(got) + here == 10
    assert limits.attach().api.wait("addr:203.0.113.7", now=501.0) == 0.0  # a second refills one


def test_refusal_budget_on_shared_buckets(limits: SharedLimits) -> None:
    budget = RefusalBudget(limits.attach().refusals)  # 6 a minute, bursts of 1
    assert not budget.exhausted("1.2.3.4")
    budget.charge("1.2.3.4")
    assert budget.exhausted("1.2.3.4") and budget.retry_after("1.2.3.4") >= 1.0
    assert not budget.exhausted("5.6.7.8")


def test_revocations_until_expiry(limits: SharedLimits) -> None:
    revoked = limits.attach().revoked
    assert not revoked.revoked("sid-1", now=100.0)
    revoked.add("sid-1", expires=200.0)
    assert revoked.revoked("sid-1", now=199.0) and not revoked.revoked("sid-1", now=200.0)
    assert not revoked.revoked("sid-2", now=100.0)


def test_the_creator_owns_the_segment() -> None:
    handle = SharedLimits.create(Settings())
    name = handle.name
    assert attached(handle) is handle.attach() and attached(None) is None
    handle.close()
    with pytest.raises(FileNotFoundError):
        SharedMemory(name=name)


def test_the_handle_is_validated() -> None:
    handle = SharedLimits.create(Settings())
    try:
        with pytest.raises(ValueError):
            SharedLimits(handle.name, handle.lock, b"short", handle.tables, 60, 60, 5, 900.0)
        with pytest.raises(ValueError):
            SharedLimits(handle.name, handle.lock, b"x" * 32, handle.tables[:2], 60, 60, 5, 900.0)
    finally:
        handle.close()


def _hold(handle: SharedLimits, index: int, n: int, out: multiprocessing.Queue[int]) -> None:
    counts = handle.attach().in_flight(index, 2)
    out.put(sum(counts.acquire("tenant", 5) for _ in range(n)))


@pytest.mark.slow
def test_in_flight_counts_are_one_cap_across_workers(limits: SharedLimits) -> None:
    """Two spawned workers take slots of one tenant's cap of 5: never more than 5 in all."""
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[int] = ctx.Queue()
    procs = [ctx.Process(target=_hold, args=(limits, i, 4, out)) for i in range(2)]
    for p in procs:
        p.start()
    taken = [out.get(timeout=60) for _ in range(2)]
    for p in procs:
        p.join(30)
    assert sum(taken) == 5, taken  # 8 asked for, 5 allowed in all, however they interleaved
    assert limits.attach().in_flight(0, 2).count("tenant") == 5  # as every worker sees it


def test_a_dead_workers_slots_stop_counting_when_its_slot_starts_again(limits: SharedLimits) -> None:
    tables = limits.attach()
    first, second = tables.in_flight(0, 2), tables.in_flight(1, 2)
    first.bump(0)
    second.bump(1)
    assert all(first.acquire("t", 4) for _ in range(3)) and second.acquire("t", 4)
    assert not second.acquire("t", 4) and first.count("t") == 4
    # Worker 0 dies holding three; its replacement starts a new generation in slot 0.
    replacement = tables.in_flight(0, 2)
    replacement.bump(0)
    assert replacement.count("t") == 1  # only worker 1's is left
    assert replacement.acquire("t", 4) and replacement.acquire("t", 4)
    second.release("t")
    replacement.release("t")
    assert first.count("t") == 1
