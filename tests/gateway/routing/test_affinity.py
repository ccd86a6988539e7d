"""Replica affinity (gateway/routing/affinity.py): the ring, bounded loads, session keys, arrangement."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import pytest

from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.gateway.routing.affinity import Affinity, HashRing, bounded_pick, session_key
from specgate.gateway.settings import BackendSettings, Settings
from specgate.policies.load import BackendLoad

REPLICAS = ["r0", "r1", "r2", "r3"]


def chat(*messages: tuple[str, str], user: str | None = None) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
    if user is not None:
        body["user"] = user
    return ChatCompletionRequest.model_validate(body)


def keys(n: int) -> list[bytes]:
    return [f"conversation-{i}".encode() for i in range(n)]


def test_ring_is_the_same_in_every_process_and_spreads_keys() -> None:
    a, b = HashRing(REPLICAS, 64), HashRing(list(reversed(REPLICAS)), 64)
    homes = [a.walk(k)[0] for k in keys(4000)]
    assert homes == [b.walk(k)[0] for k in keys(4000)]  # blake2b positions: no per-process hash seed
    assert all(sorted(a.walk(k)) == REPLICAS for k in keys(50))  # every replica once
    shares = [homes.count(r) / len(homes) for r in REPLICAS]
    assert all(0.15 < s < 0.35 for s in shares), shares


def test_taking_a_replica_out_moves_only_its_conversations() -> None:
    full, without = HashRing(REPLICAS, 64), HashRing([r for r in REPLICAS if r != "r2"], 64)
    moved = 0
    for k in keys(3000):
        before, after = full.walk(k), without.walk(k)
        if before[0] != "r2":
            assert after[0] == before[0]
        else:
            moved += 1
            assert after[0] == before[1]  # its conversations go to the next replica on the ring
    assert 0.15 < moved / 3000 < 0.35


def test_bounded_pick_skips_a_replica_over_its_share() -> None:
    # cap = ceil(1.25 * (5 + 0 + 0 + 1) / 3) = 3: the home (5 in flight) is full, the next takes it.
    assert bounded_pick(["a", "b", "c"], {"a": 5, "b": 0, "c": 0}, 1.25) == "b"
    # cap = ceil(1.25 * (1 + 1 + 1 + 1) / 3) = 2: the home has room for one more.
    assert bounded_pick(["a", "b", "c"], {"a": 1, "b": 1, "c": 1}, 1.25) == "a"
    # A floor: under it a replica keeps its conversations whatever the mean.
    assert bounded_pick(["a", "b", "c"], {"a": 3, "b": 0, "c": 0}, 1.25, floor=4) == "a"
    assert bounded_pick(["a", "b", "c"], {"a": 4, "b": 0, "c": 0}, 1.25, floor=4) == "b"
    assert bounded_pick(["a"], {"a": 100}, 1.25) == "a"  # a lone replica always takes it


@pytest.mark.parametrize("factor", [1.1, 1.25, 2.0])
def test_no_replica_goes_over_the_bound(factor: float) -> None:
    """Requests that never finish, keyed unevenly (a third of them one hot conversation): every
    replica stays within ceil(factor * mean) however the keys fall."""
    ring, rng = HashRing(REPLICAS, 64), random.Random(0)
    loads = dict.fromkeys(REPLICAS, 0)
    for i in range(2000):
        key = b"hot" if rng.random() < 0.33 else f"k{rng.randrange(50)}".encode()
        loads[bounded_pick(ring.walk(key), loads, factor)] += 1
        total = i + 1
        assert max(loads.values()) <= math.ceil(factor * total / len(REPLICAS))


def test_a_conversation_keeps_its_key_over_its_turns() -> None:
    turn1 = chat(("system", "You are terse."), ("user", "Plan a trip to Rome."))
    turn2 = chat(
        ("system", "You are terse."),
        ("user", "Plan a trip to Rome."),
        ("assistant", "Day 1: the Forum."),
        ("user", "And day 2?"),
    )
    other = chat(("system", "You are terse."), ("user", "Plan a trip to Oslo."))
    k1, k2, k3 = (session_key(r, 512) for r in (turn1, turn2, other))
    assert k1 is not None and k1[0] == "prefix"
    assert k1 == k2 and k1 != k3
    assert session_key(chat(("system", "You are verbose."), ("user", "Plan a trip to Rome.")), 512) != k1
    # The `user` field names the session whatever the messages say.
    assert session_key(chat(("user", "a"), user="alice"), 512) == session_key(
        chat(("user", "b"), user="alice"), 512
    )
    keyed = session_key(chat(("user", "a"), user="alice"), 512)
    assert keyed is not None and keyed[0] == "user"
    # A conversation that starts with no user turn has nothing stable to key by.
    assert session_key(chat(("assistant", "Hi."), ("user", "Hello.")), 512) is None


def test_completions_are_keyed_by_their_leading_characters() -> None:
    shared = "Context: " + "x" * 600

    def comp(prompt: Any) -> CompletionRequest:
        return CompletionRequest.model_validate({"model": "m", "prompt": prompt})

    assert session_key(comp(shared + " Question one?"), 512) == session_key(comp(shared + " Two?"), 512)
    assert session_key(comp("short one"), 512) != session_key(comp("short two"), 512)
    assert session_key(comp([[1, 2, 3], [4]]), 512) == session_key(comp([1, 2, 3]), 512)
    assert session_key(comp(["first prompt", "second"]), 512) == session_key(comp("first prompt"), 512)


@dataclass
class FakeBackend:
    name: str
    healthy: bool = True
    in_flight: int = 0

    def load(self) -> BackendLoad:
        return BackendLoad(self.in_flight, None, self.healthy)


class FakeRegistry:
    def __init__(self, *backends: FakeBackend) -> None:
        self.backends = {b.name: b for b in backends}

    def get(self, name: str) -> FakeBackend | None:
        return self.backends.get(name)


def affinity(registry: FakeRegistry, **overrides: Any) -> Affinity:
    def be(name: str, group: str | None) -> BackendSettings:
        return BackendSettings(name=name, base_url=f"http://127.0.0.1:9/{name}", replica_group=group)

    backends = [be(n, "pool") for n in REPLICAS] + [be("solo", None)]
    # The session key's ring (today's hashing); prefix mode has tests of its own.
    overrides.setdefault("mode", "session")
    settings = Settings(embedded={"enabled": False}, backends=backends, affinity=overrides)
    return Affinity(settings, registry)  # type: ignore[arg-type]


def test_arrange_puts_the_home_replica_first_and_keeps_the_route_shape() -> None:
    reg = FakeRegistry(*(FakeBackend(n) for n in [*REPLICAS, "solo"]))
    aff = affinity(reg)
    request = chat(("user", "hello"), user="alice")
    route = ["r1", "solo", "r0", "r2", "r3"]
    arranged, choice = aff.arrange(route, request)
    assert choice is not None and choice.group == "pool" and choice.source == "user"
    assert arranged[1] == "solo"  # a backend outside the group keeps its place
    assert sorted(arranged) == sorted(route) and arranged[0] == choice.chosen == choice.home
    assert aff.arrange(route, request)[0] == arranged  # the same conversation, the same replica

    # The home replica down: its conversations go to the next one; the down one is tried last.
    reg.backends[choice.home].healthy = False
    again, moved = aff.arrange(route, request)
    assert moved is not None and moved.home != choice.home and again[0] == moved.home
    assert again[-1] == choice.home

    # Overloaded home (past spill_after and the load bound): the next replica with room takes it.
    reg.backends[choice.home].healthy = True
    reg.backends[choice.home].in_flight = 7
    assert aff.arrange(route, request)[0][0] == choice.home  # under spill_after (8): it stays
    reg.backends[choice.home].in_flight = 10
    spilled, spill = aff.arrange(route, request)
    assert spill is not None and spill.home == choice.home and spill.chosen != choice.home
    assert spilled[0] == spill.chosen


def test_arrange_without_a_key_takes_the_least_loaded_and_leaves_other_routes_alone() -> None:
    reg = FakeRegistry(
        *(FakeBackend(n, in_flight=i + 1) for i, n in enumerate(REPLICAS)), FakeBackend("solo")
    )
    reg.backends["r2"].in_flight = 0
    aff = affinity(reg)
    request = chat(("assistant", "Hi."), ("user", "Hello."))  # no key
    arranged, choice = aff.arrange(["r0", "r1", "r2", "r3"], request)
    assert choice is not None and choice.source == "none" and choice.home is None
    assert arranged[0] == "r2"
    assert aff.arrange(["solo", "r0"], request) == (["solo", "r0"], None)  # the first is in no group
    assert aff.arrange(["r0", "solo"], request) == (["r0", "solo"], None)  # one replica of it here
    off = affinity(reg, enabled=False)
    assert off.arrange(["r0", "r1"], chat(("user", "x"), user="u")) == (["r0", "r1"], None)
