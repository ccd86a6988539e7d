"""External backends as routing arms: a replica group is one arm, a speculative server an arm of its
own kind; the route puts the chosen pool's members first, the arm that served is the pool's; prefix
affinity picks the replica inside a pool.

A real Router over a registry of OpenAIBackends and the default policy (rules, version 1). No
network: routing reads only settings, health and load, which the tests set directly.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from specgate.gateway.backends.registry import BackendRegistry
from specgate.gateway.backends.upstream.backend import OpenAIBackend
from specgate.gateway.backends.upstream.client import UpstreamClient
from specgate.gateway.policy.manager import PolicyManager
from specgate.gateway.policy.store import MemoryPolicyStore
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.protocol.schemas import ChatCompletionRequest
from specgate.gateway.routing.affinity import HashRing, session_key
from specgate.gateway.routing.router import Plan, Router, RoutingPolicy
from specgate.gateway.settings import Settings
from specgate.policies.classifier import DEFAULT_ARTIFACT, WorkloadClassifier
from specgate.policies.load import Load

REPLICAS = ["r0", "r1", "r2"]
LONG_SYSTEM = "You are a careful assistant for the Example Corp support desk. " * 50  # ~3200 chars
SHORT_SYSTEM = "Be brief."


@functools.cache
def classifier() -> WorkloadClassifier:
    return WorkloadClassifier.load(DEFAULT_ARTIFACT)


def be(name: str, group: str | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "name": name,
        "base_url": f"http://127.0.0.1:9/{name}/v1",
        "models": ["m"],
        "replica_group": group,
        **kw,
    }


def make_router(*backends: dict[str, Any], **settings: Any) -> Router:
    settings.setdefault("policy", {"seed": 0})
    s = Settings(embedded={"enabled": False}, backends=list(backends), **settings)
    registry = BackendRegistry.from_settings(s, UpstreamClient(), None)
    manager = PolicyManager(s.policy, MemoryPolicyStore(), persistent=False)
    manager.load()
    return Router(s, registry, RoutingPolicy(classifier(), manager))


def pool(*extra: dict[str, Any], **settings: Any) -> Router:
    """Three replicas of one deployment (group `pool`), and any other backends after them."""
    return make_router(*(be(n, "pool") for n in REPLICAS), *extra, **settings)


def upstream(router: Router, name: str) -> OpenAIBackend:
    b = router.registry.get(name)
    assert isinstance(b, OpenAIBackend)
    return b


def chat(text: str, system: str | None = None, **kw: Any) -> ChatCompletionRequest:
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text}
    ]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **kw})


def route(router: Router, request: ChatCompletionRequest) -> RouteDecision:
    """The route the router decides now, at the registry's current load (as a request is routed:
    the prefix index learns where it went)."""
    return planned(router, request).route


def planned(router: Router, request: ChatCompletionRequest, scope: str | None = "") -> Plan:
    """The plan (the route and the prompt's block hashes affinity read) at the current load."""
    return router.plan(request, Load(backends=router.registry.loads()), scope=scope)


# ---- arms ------------------------------------------------------------------------------------------


def test_a_replica_group_is_one_arm_and_a_speculative_server_an_arm_of_its_kind() -> None:
    r = pool(be("spec", speculative="ngram"), be("solo"), be("auto"))
    names = ["solo", "r1", "spec", "r0", "auto", "r2"]
    assert [a.key for a in r.arms(names)] == [
        "solo:upstream",
        "pool:upstream",
        "spec:upstream-ngram",
        "auto:upstream",
    ]
    assert [a.key for a in r.arms(REPLICAS)] == ["pool:upstream"]
    assert r.registry.groups == {"pool": REPLICAS} and r.registry.group_of["r1"] == "pool"
    loads = r.registry.loads()
    assert set(loads) == {*REPLICAS, "pool", "spec", "solo", "auto"}  # every backend, and the group
    assert loads["spec"].speculative and not loads["pool"].speculative
    # A server on `auto` becomes a speculative arm ("on": the method unsaid) once its metrics
    # showed drafts.
    upstream(r, "auto").drafts_seen = True
    assert [a.key for a in r.arms(["auto"])] == ["auto:upstream-on"]
    assert r.registry.pool_speculation("auto") == "on"


def test_a_group_speculates_as_its_first_member_that_says_so() -> None:
    r = make_router(
        be("r0", "pool"), be("r1", "pool", speculative="eagle"), be("r2", "pool", speculative="off")
    )
    assert r.registry.pool_speculation("pool") == "eagle"
    assert [a.key for a in r.arms(REPLICAS)] == ["pool:upstream-eagle"]
    assert r.registry.loads()["pool"].speculative


def test_a_group_may_not_take_a_backends_name_nor_a_colon() -> None:
    with pytest.raises(ValueError, match="may not share a backend's name"):
        Settings(embedded={"enabled": False}, backends=[be("a", "b"), be("b")])
    with pytest.raises(ValueError):
        Settings(embedded={"enabled": False}, backends=[be("a", "pool:x")])
    with pytest.raises(ValueError):
        Settings(embedded={"enabled": False}, backends=[be("a", "my pool")])


# ---- the route ---------------------------------------------------------------------------------------


CODE = "Write a python function to sort a list"  # the rules: a speculative pool
CHAT = "Tell me something."  # open chat: a plain pool


def test_the_route_lists_the_chosen_pools_members_first() -> None:
    r = make_router(be("spec", speculative="ngram"), *(be(n, "pool") for n in REPLICAS))
    pools = {
        "r0": "pool:upstream",
        "r1": "pool:upstream",
        "r2": "pool:upstream",
        "spec": "spec:upstream-ngram",
    }
    # Open chat: the plain pool, though configured after the speculative server; its replicas lead
    # (in the order affinity gives them), the other pool follows for failover.
    d = route(r, chat(CHAT))
    assert d.chosen_arm == "pool:upstream" and d.workload_class == "open_chat"
    assert sorted(d.backends[:3]) == REPLICAS and d.backends[3] == "spec"
    assert d.affinity is not None and d.affinity["group"] == "pool" and d.backends[0] == d.affinity["chosen"]
    assert d.pools == pools and d.spec is None  # an external server decides its own drafts
    # Code: the speculative server first, then the replicas in their configured order (affinity
    # arranges only a group that comes first).
    d = route(r, chat(CODE, temperature=0))
    assert d.chosen_arm == "spec:upstream-ngram" and d.backends == ["spec", *REPLICAS]
    assert d.affinity is None and d.pools == pools
    # Each pool's batch as the policy saw it: the group's is the mean over its replicas.
    upstream(r, "spec")._in_flight.enter()
    for _ in range(3):
        upstream(r, "r0")._in_flight.enter()
    d = route(r, chat(CODE, temperature=0))
    assert d.pool_batches == {"spec:upstream-ngram": 1, "pool:upstream": 1}
    assert d.as_dict()["pool_batches"] == d.pool_batches

    # The configured first backend down: the group is the arm.
    r = make_router(be("solo"), *(be(n, "pool") for n in REPLICAS))
    upstream(r, "solo").probe_ok = False
    d = route(r, chat(CODE, temperature=0))
    assert d.chosen_arm == "pool:upstream"
    assert sorted(d.backends[:3]) == REPLICAS and d.backends[3] == "solo"
    # route() answers the same (its propensity is the policy's chance of the arm it took).
    decided = r.route(chat(CODE, seed=3), Load(backends=r.registry.loads()))
    assert decided.chosen_arm == "pool:upstream" and decided.propensity is not None


def test_a_group_is_up_while_any_replica_is() -> None:
    r = pool(be("solo"))
    for name in ("r0", "r1"):
        upstream(r, name).probe_ok = False
    d = route(r, chat(CHAT))
    assert d.chosen_arm == "pool:upstream" and d.backends[0] == "r2"  # the healthy replica first
    assert d.backends[1:3] in (["r0", "r1"], ["r1", "r0"]) and d.backends[3] == "solo"
    upstream(r, "r2").probe_ok = False
    loads = r.registry.loads()
    assert not loads["pool"].healthy and loads["solo"].healthy
    d = route(r, chat(CHAT))
    assert d.chosen_arm == "solo:upstream" and d.backends[0] == "solo"


def test_served_by_a_member_is_the_pools_arm_and_keeps_the_propensity() -> None:
    r = pool(be("solo"))
    d = r.route(chat("Tell me something.", seed=1), Load(backends=r.registry.loads()))
    assert d.chosen_arm == "pool:upstream" and d.propensity is not None
    propensity = d.propensity
    other = next(n for n in REPLICAS if n != d.backends[0])  # another replica (a failover inside the pool)
    planned_affinity = d.affinity
    d = d.served_by(other, True)
    assert planned_affinity is not None and "hit" not in planned_affinity  # the planned route is as it was
    assert d.arm == "pool:upstream" and d.backend == other and d.propensity == propensity
    out = d.as_dict()
    assert out["arm"] == "pool:upstream" and out["propensity"] == propensity and "chosen_arm" not in out
    assert out["backend"] == other and out["spec"] is None
    assert d.affinity is not None and d.affinity["hit"] is (other == d.affinity["home"])


def test_served_by_another_pool_drops_the_propensity() -> None:
    r = pool(be("solo"))
    d = r.route(chat("Tell me something.", seed=1), Load(backends=r.registry.loads()))
    assert d.chosen_arm == "pool:upstream" and d.propensity is not None
    d = d.served_by("solo", True)  # every replica failed: the next pool served
    assert d.arm == "solo:upstream" and d.propensity is None
    out = d.as_dict()
    assert out["arm"] == "solo:upstream" and out["chosen_arm"] == "pool:upstream" and "propensity" not in out
    assert d.affinity is not None and d.affinity["hit"] is False


# ---- prefix affinity inside the pool -------------------------------------------------------------------


def home(r: Router, request: ChatCompletionRequest) -> str:
    """The replica the session key hashes to (the ring's first; all are healthy here)."""
    keyed = session_key(request, r.settings.affinity.prompt_chars)
    assert keyed is not None
    return r.affinity.rings["pool"].walk(keyed[1])[0]


def two_users(r: Router, system: str) -> tuple[ChatCompletionRequest, ChatCompletionRequest]:
    """Two conversations sharing `system` whose session keys hash to different replicas."""
    first = chat("How do I reset my password?", system)
    for i in range(100):
        second = chat(f"My order {i} has not arrived, what now?", system)
        if home(r, second) != home(r, first):
            return first, second
    raise AssertionError("no second conversation with another home replica")


def test_a_long_shared_system_prompt_meets_on_one_replica() -> None:
    r = pool()
    st = r.settings.affinity
    assert st.mode == "prefix" and len(LONG_SYSTEM) >= st.min_match_blocks * st.block_chars
    first, second = two_users(r, LONG_SYSTEM)
    p1 = planned(r, first)
    d1 = p1.route
    assert d1.affinity is not None and p1.prefix_blocks
    assert d1.affinity["chosen"] == home(r, first) and d1.affinity["prefix_reason"] == "no match"
    assert d1.affinity["matched_blocks"] == 0 and d1.affinity["prompt_chars"] > len(LONG_SYSTEM)
    assert "blocks" not in d1.affinity  # the hashes are never recorded

    d2 = route(r, second)  # equal load (none): the replica that holds the system prompt takes it
    assert d2.affinity is not None and d2.backends[0] == d1.backends[0] != home(r, second)
    # Its home is where its prompt is cached, not its session hash's replica.
    assert d2.affinity["source"] == "cached" and d2.affinity["home"] == d1.backends[0]
    assert d2.affinity["prefix_reason"] == "prefix"
    shared_blocks = len(LONG_SYSTEM) // st.block_chars
    assert st.min_match_blocks <= d2.affinity["matched_blocks"] == d2.affinity["best_matched_blocks"]
    assert shared_blocks - 1 <= d2.affinity["matched_blocks"] <= shared_blocks + 1


def test_a_short_shared_preamble_does_not_pin_traffic() -> None:
    r = pool()
    assert len(SHORT_SYSTEM) < r.settings.affinity.min_match_blocks * r.settings.affinity.block_chars
    first, second = two_users(r, SHORT_SYSTEM)
    d1, d2 = route(r, first), route(r, second)
    assert d1.backends[0] == home(r, first) and d2.backends[0] == home(r, second)
    assert d1.backends[0] != d2.backends[0]
    assert d2.affinity is not None and d2.affinity["prefix_reason"] == "no match"


def test_load_outweighs_a_cached_prefix_beyond_its_worth() -> None:
    """A prefix worth little (a request in flight weighs a million prompt tokens): one request more
    on the replica holding it sends the next one elsewhere ("load"); at equal load it stays."""
    r = pool(affinity={"tokens_per_request": 1e6})
    first, second = two_users(r, LONG_SYSTEM)
    holder = route(r, first).backends[0]
    assert route(r, chat("Is there a phone number?", LONG_SYSTEM)).backends[0] == holder
    upstream(r, holder)._in_flight.enter()
    d = route(r, second)
    assert d.backends[0] != holder
    assert d.affinity is not None and d.affinity["prefix_reason"] == "load"
    assert d.affinity["matched_blocks"] == 0
    assert d.affinity["best_matched_blocks"] >= r.settings.affinity.min_match_blocks


def test_past_the_bounded_load_cap_the_request_spills() -> None:
    # A prefix worth a lot (one token weighs a request in flight): only the load cap moves it.
    r = pool(affinity={"tokens_per_request": 1.0, "spill_after": 4})
    first, second = two_users(r, LONG_SYSTEM)
    holder = route(r, first).backends[0]
    b = upstream(r, holder)
    for _ in range(3):
        b._in_flight.enter()
    # cap = max(4, ceil(1.25 * (3 + 1) / 3)) = 4: three in flight and this one fit.
    d = route(r, second)
    assert d.backends[0] == holder and d.affinity is not None and d.affinity["prefix_reason"] == "prefix"
    b._in_flight.enter()
    # cap = max(4, ceil(1.25 * (4 + 1) / 3)) = 4: a fifth does not; the next replica takes it.
    d = route(r, chat("Where is my invoice?", LONG_SYSTEM))
    assert d.backends[0] != holder and d.affinity is not None
    assert d.affinity["prefix_reason"] == "load"
    assert d.affinity["best_matched_blocks"] >= r.settings.affinity.min_match_blocks
    assert d.backends[1:].count(holder) == 1  # still in the route, for failover


def test_observe_records_the_blocks_where_a_failover_served_them() -> None:
    r = pool()
    p = planned(r, chat("How do I reset my password?", LONG_SYSTEM))
    d, blocks = p.route, p.prefix_blocks
    assert d.affinity is not None and blocks
    chosen = d.affinity["chosen"]
    other = next(n for n in REPLICAS if n != chosen)
    index = r.affinity.index["pool"]
    assert index.match(blocks, REPLICAS) == {n: len(blocks) if n == chosen else 0 for n in REPLICAS}
    d = d.served_by(other, True)
    r.affinity.observe(d, blocks, cached_tokens=None, prompt_tokens=None)
    assert index.match(blocks, [other]) == {other: len(blocks)}
    # The chosen replica never got the blocks past what it held before; the next conversation on
    # the same system prompt finds it where it went.
    assert index.match(blocks, [chosen]) == {chosen: d.affinity["matched_blocks"]}
    nxt = route(r, chat("My parcel is late.", LONG_SYSTEM))
    assert nxt.affinity is not None and nxt.backends[0] in (chosen, other)
    assert nxt.affinity["matched_blocks"] >= len(LONG_SYSTEM) // r.settings.affinity.block_chars - 1


def test_observe_ignores_a_route_without_prefix_blocks_or_outside_the_group() -> None:
    r = pool(be("solo"))
    index = r.affinity.index["pool"]
    p = planned(r, chat("How do I reset my password?", LONG_SYSTEM))
    d, blocks = p.route, p.prefix_blocks
    assert blocks
    before = {n: index.held(n) for n in REPLICAS}
    chosen = d.affinity["chosen"] if d.affinity else None
    assert chosen in REPLICAS and before[chosen] == len(blocks)
    d = d.served_by("solo", True)  # another pool served: not a replica of this group
    r.affinity.observe(d, blocks, cached_tokens=0, prompt_tokens=100)
    # The chosen replica never got the prompt; solo is not in this group's index.
    assert index.held(chosen) == 0 and index.held("solo") == 0
    assert all(index.held(n) == before[n] for n in REPLICAS if n != chosen)
    after = {n: index.held(n) for n in REPLICAS}
    r.affinity.observe(d, None, cached_tokens=0, prompt_tokens=100)  # nothing to do
    assert {n: index.held(n) for n in REPLICAS} == after


def test_session_mode_still_hashes_the_session_key() -> None:
    r = pool(affinity={"mode": "session"})
    first, second = two_users(r, LONG_SYSTEM)
    for request in (first, second, first):
        p = planned(r, request)
        d = p.route
        assert d.affinity is not None and d.backends[0] == home(r, request)
        assert d.affinity["source"] == "prefix" and d.affinity["home"] == home(r, request)
        assert "prefix_reason" not in d.affinity and p.prefix_blocks is None
    # The ring is the one every process builds from the names alone.
    ring = HashRing(REPLICAS, r.settings.affinity.ring_points)
    keyed = session_key(first, r.settings.affinity.prompt_chars)
    assert keyed is not None and ring.walk(keyed[1])[0] == home(r, first)
    # The `user` field keys the session whatever the prompt.
    a = route(r, chat("one", LONG_SYSTEM, user="alice"))
    b = route(r, chat("two", SHORT_SYSTEM, user="alice"))
    assert a.backends[0] == b.backends[0] and a.affinity is not None and a.affinity["source"] == "user"


def test_an_operators_explain_leaves_the_prefix_index_alone() -> None:
    r = pool()
    request = chat("How do I reset my password?", LONG_SYSTEM)
    asked = r.plan(request, Load(backends=r.registry.loads()), explore=False)
    assert asked.prefix_blocks
    assert r.affinity.index["pool"].match(asked.prefix_blocks, REPLICAS) == dict.fromkeys(REPLICAS, 0)


def test_a_replica_reporting_less_cached_than_matched_is_believed_to_keep_less() -> None:
    r = pool()
    index = r.affinity.index["pool"]
    first = planned(r, chat("How do I reset my password?", LONG_SYSTEM))
    p = planned(r, chat("Where is my invoice?", LONG_SYSTEM))
    d, blocks = p.route, p.prefix_blocks
    assert d.affinity is not None and d.affinity["matched_blocks"] >= r.settings.affinity.min_match_blocks
    assert blocks
    served = d.affinity["chosen"]
    d = d.served_by(served, True)
    full = index.capacity(served)
    chars = d.affinity["prompt_chars"]
    # It reports nothing cached although the index matched the whole system prompt: evicted, or a
    # burst that beat the first prefill; only the third such report in a row shrinks the belief.
    for _ in range(2):
        r.affinity.observe(d, blocks, cached_tokens=0, prompt_tokens=chars // 4)
        assert index.capacity(served) == full
    r.affinity.observe(d, blocks, cached_tokens=0, prompt_tokens=chars // 4)
    shrunk = index.capacity(served)
    assert shrunk >= r.settings.affinity.index_blocks // 16
    assert shrunk < full and index.held(served) <= shrunk
    assert index.match(blocks, [served])[served] == len(blocks)  # prefilled now
    # Reports that agree let the belief grow back.
    matched_tokens = d.affinity["matched_blocks"] * r.settings.affinity.block_chars * (chars // 4) // chars
    for _ in range(3):
        r.affinity.observe(d, blocks, cached_tokens=matched_tokens + 64, prompt_tokens=chars // 4)
    assert shrunk < index.capacity(served) <= full
    assert first.prefix_blocks


def test_prompts_match_only_within_their_prefix_cache_scope() -> None:
    r = pool()
    index = r.affinity.index["pool"]
    loads = Load(backends=r.registry.loads())
    first, second = two_users(r, LONG_SYSTEM)
    alice_plan = r.plan(first, loads, scope="tenant-a")
    alice = alice_plan.route
    assert alice_plan.prefix_blocks and alice.affinity is not None
    # Another tenant's request with the same system prompt learns nothing of it.
    mallory = r.route(second, Load(backends=r.registry.loads()), scope="tenant-b")
    assert mallory.affinity is not None
    assert mallory.affinity["best_matched_blocks"] == 0 and mallory.affinity["prefix_reason"] == "no match"
    # The same tenant's does.
    again = r.route(second, Load(backends=r.registry.loads()), scope="tenant-a")
    assert again.affinity is not None and again.affinity["prefix_reason"] == "prefix"
    assert again.backends[0] == alice.backends[0]
    # Nobody's (prefix_cache_scope off): no match, and nothing recorded to match later.
    held = {n: index.held(n) for n in REPLICAS}
    nobody = planned(r, first, scope=None)
    assert nobody.route.affinity is not None and nobody.route.affinity["best_matched_blocks"] == 0
    assert nobody.prefix_blocks is None and {n: index.held(n) for n in REPLICAS} == held


def test_a_request_not_served_leaves_no_blocks_behind() -> None:
    r = pool()
    index = r.affinity.index["pool"]
    p = planned(r, chat("How do I reset my password?", LONG_SYSTEM))
    d = p.route
    assert d.affinity is not None and p.prefix_blocks
    chosen = d.affinity["chosen"]
    assert index.held(chosen) == len(p.prefix_blocks)
    r.affinity.undo(d, p.prefix_blocks)  # refused (an SLO 429) or failed on every backend
    assert index.held(chosen) == 0


def test_a_routes_listed_backends_are_a_failover_plan_not_a_pool_to_spread_over() -> None:
    plan = {"m": {"backends": ["main", "spare"]}}
    r = make_router(be("main"), be("spare", speculative="ngram"), routes=plan)
    manager = r.policy.manager if r.policy is not None else None
    assert manager is not None
    manager.state.rules.exploration_rate = manager.state.rules.exploration_cap = 1.0
    manager._install({"version": 9, "artifact": manager.state.as_dict()})
    picked = {route(r, chat(CODE, temperature=0)).chosen_arm for _ in range(30)}
    assert picked == {"main:upstream"}  # never explored onto the spare, though code would speculate
    upstream(r, "main").probe_ok = False
    assert route(r, chat(CODE, temperature=0)).chosen_arm == "spare:upstream-ngram"  # its turn now
    # Without the route, both serve the model and the policy chooses (and explores) across them.
    free = make_router(be("main"), be("spare", speculative="ngram"))
    free.policy.manager.state.rules.exploration_rate = 1.0  # type: ignore[union-attr]
    arms = {route(free, chat(CODE, temperature=0)).chosen_arm for _ in range(30)}
    assert arms == {"main:upstream", "spare:upstream-ngram"}
