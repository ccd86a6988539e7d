"""External backends as first-class arms: their load (policies/load.py), their arms (arms.py), the
goodput models that read each arm's own backend's load (goodput.py), the guards (guards.py), the
rules' choice between a speculative and a plain pool (rule_policy.py) and latency targets (SLOs)
in the learned policy."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from specgate.engine.vocab import LoadSnapshot
from specgate.policies.arms import Arm
from specgate.policies.decision import Decision, DecisionContext, Slo
from specgate.policies.exploration import ExplorationBudget
from specgate.policies.goodput import MODEL_FEATURES, ArmModel, GoodputModel, Prediction, TrainingRow, vector
from specgate.policies.guards import safe_arms
from specgate.policies.learned_policy import LearnedPolicy
from specgate.policies.load import ARM_LOAD, MAX_COUNT, BackendLoad, Load, arm_input
from specgate.policies.rule_policy import RulePolicy
from specgate.policies.rules import RuleConfig
from tests.policies import synthetic_telemetry as synth

SPEC = Arm.upstream("spec", "ngram")  # spec:upstream-ngram, a pool that drafts
PLAIN = Arm.upstream("plain", None)  # plain:upstream
POOLS = [SPEC, PLAIN]
EMBEDDED = [Arm("embedded", "off"), Arm("embedded", "ngram")]


def request(label: str, seed: int = 0, temperature: float = 0.0) -> dict[str, float]:
    """A request's features as the router gives them to a policy (no load under any name but the
    plain ones, which the synthetic helper sets to an idle engine)."""
    return synth.features(label, 0, random.Random(seed), temperature)


def pools_load(spec: int, plain: int, engine: int = 0) -> Load:
    """The engine's load (every signal scaled with `engine`) and the two pools' scraped loads."""
    return Load(
        LoadSnapshot(
            num_waiting=engine // 4,
            num_running=engine,
            num_batched_tokens=3 * engine,
            kv_cache_usage=min(1.0, engine / 64),
            step_time=engine / 1e3,
        ),
        backends={
            "spec": BackendLoad(
                num_running=spec, num_waiting=0, kv_cache_usage=min(1.0, spec / 64), speculative=True
            ),
            "plain": BackendLoad(num_running=plain, num_waiting=0, kv_cache_usage=min(1.0, plain / 64)),
            "embedded": BackendLoad(external=False),
        },
    )


def pool_tps(arm: Arm, load: Load) -> float:
    """The synthetic world: the spec pool is fast when idle and slows fast with its own batch; the
    plain pool is slower when idle and slows less with its own. Neither cares about the engine."""
    if arm == SPEC:
        return 40.0 * math.exp(-0.08 * load.backends["spec"].batch)
    return 25.0 * math.exp(-0.03 * load.backends["plain"].batch)


def pool_rows(n: int, seed: int = 0) -> list[TrainingRow]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = ("code", "open_chat")[i % 2]
        arm = rng.choice(POOLS)
        load = pools_load(rng.randint(0, 40), rng.randint(0, 40), rng.randint(0, 60))
        feats = {**synth.features(label, 0, rng, rng.uniform(0.0, 1.2)), **load.features()}
        tps = pool_tps(arm, load) * math.exp(rng.gauss(0.0, 0.1))
        out.append(TrainingRow(arm.key, feats, tps, 1000.0 / tps, label, float(i), propensity=0.5))
    return out


def ctx(
    label: str,
    load: Load,
    arms: list[Arm] | None = None,
    temperature: float = 0.0,
    slo: Slo | None = None,
    tools: bool = False,
) -> DecisionContext:
    feats = request(label, temperature=temperature)
    feats["tools_or_json"] = float(tools)
    return DecisionContext(label, 0.95, feats, load, list(POOLS if arms is None else arms), slo)


# --- Load ---------------------------------------------------------------------------------------


def busy_load() -> Load:
    return Load(
        LoadSnapshot(num_waiting=2, num_running=3, num_batched_tokens=7, kv_cache_usage=0.5, step_time=0.012),
        backends={
            "vllm": BackendLoad(
                in_flight=1, num_running=4, num_waiting=2, kv_cache_usage=0.3, latency_ewma_ms=80.0
            ),
            "group": BackendLoad(in_flight=5, latency_ewma_ms=250.0),  # not scraped
            "embedded": BackendLoad(external=False, in_flight=9),
        },
    )


def test_features_hold_the_engine_under_plain_names_and_each_external_backend_under_its_own() -> None:
    f = busy_load().features()
    prefixed = {f"{b}:{k}" for b in ("vllm", "group") for k in ARM_LOAD}
    assert set(f) == set(ARM_LOAD) | prefixed  # nothing for the embedded backend's entry
    assert f["load_running"] == 3.0 and f["load_queue"] == 2.0
    assert f["load_log_batch_tokens"] == pytest.approx(math.log1p(7))
    assert f["load_log_step_ms"] == pytest.approx(math.log1p(12.0))
    assert f["vllm:load_running"] == 4.0 and f["vllm:load_queue"] == 2.0
    assert f["vllm:load_kv_usage"] == pytest.approx(0.3)
    assert f["vllm:load_log_step_ms"] == pytest.approx(math.log1p(80.0))
    assert f["group:load_running"] == 5.0  # unscraped: the gateway's own in-flight count stands in
    assert f["group:load_queue"] == 0.0


def test_from_features_round_trips_the_engine_and_the_external_backends() -> None:
    load = busy_load()
    back = Load.from_features(load.features())
    e = back.engine
    assert e is not None and (e.num_waiting, e.num_running, e.num_batched_tokens) == (2, 3, 7)
    assert e.kv_cache_usage == pytest.approx(0.5) and e.step_time == pytest.approx(0.012)
    assert set(back.backends) == {"vllm", "group"}
    vllm = back.backends["vllm"]
    assert (vllm.num_running, vllm.num_waiting) == (4, 2) and vllm.external
    assert vllm.kv_cache_usage == pytest.approx(0.3)
    assert vllm.latency_ewma_ms == pytest.approx(80.0)
    group = back.backends["group"]
    assert group.batch == load.backends["group"].batch == 5
    assert group.latency_ewma_ms == pytest.approx(250.0)
    for name in ("vllm", "group"):
        assert back.batch_of(name) == load.batch_of(name)
        assert back.arm_features(name) == pytest.approx(load.arm_features(name))
    assert back.features() == pytest.approx(load.features())


def test_arm_input_puts_the_backends_own_load_under_the_plain_names() -> None:
    f = {**request("code"), **busy_load().features()}
    own = arm_input(f, "vllm")
    for k in ARM_LOAD:
        assert own[k] == f[f"vllm:{k}"]
    # Everything else stays as it was: request features and other backends' keys.
    assert {k: v for k, v in own.items() if k not in ARM_LOAD} == {
        k: v for k, v in f.items() if k not in ARM_LOAD
    }
    assert f["load_running"] == 3.0  # the input is not modified
    assert arm_input(f, "unknown") == f  # no keys of its own: as recorded


def test_an_old_row_without_prefixed_keys_gives_the_engine_features() -> None:
    old = synth.features("code", 12, random.Random(0))  # telemetry from before per-backend load
    load = Load.from_features(old)
    assert load.backends == {} and load.engine is not None and load.engine.num_running == 12
    assert load.arm_features("vllm") == load.engine_features()
    assert arm_input(old, "vllm") == old
    assert vector(old, "vllm:upstream").tolist() == [old.get(n, 0.0) for n in MODEL_FEATURES]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"in_flight": -1},
        {"num_running": -1},
        {"num_waiting": -3},
        {"in_flight": MAX_COUNT + 1},
        {"num_running": MAX_COUNT + 1},
        {"num_waiting": MAX_COUNT + 1},
        {"kv_cache_usage": 1.01},
        {"kv_cache_usage": -0.01},
        {"kv_cache_usage": math.nan},
        {"latency_ewma_ms": math.nan},
        {"latency_ewma_ms": math.inf},
        {"latency_ewma_ms": -1.0},
    ],
)
def test_backend_load_refuses_impossible_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BackendLoad(**kwargs)  # type: ignore[arg-type]


def test_backend_load_accepts_the_edges() -> None:
    BackendLoad(
        in_flight=MAX_COUNT,
        num_running=MAX_COUNT,
        num_waiting=MAX_COUNT,
        kv_cache_usage=1.0,
        latency_ewma_ms=0.0,
    )
    BackendLoad(kv_cache_usage=0.0)


def test_batch_is_the_scraped_running_and_waiting_else_the_gateways_in_flight() -> None:
    assert BackendLoad(in_flight=7).batch == 7
    assert BackendLoad(in_flight=5, num_running=3, num_waiting=4).batch == 7
    assert BackendLoad(in_flight=1, num_running=3).batch == 3
    # A scrape is up to an interval old: never fewer than the gateway's own requests there.
    assert BackendLoad(in_flight=50, num_running=3, num_waiting=4).batch == 50
    assert BackendLoad(in_flight=50, num_running=3, num_waiting=4).features()["load_running"] == 46
    assert BackendLoad(in_flight=0, num_running=0, num_waiting=0).batch == 0
    load = Load(
        LoadSnapshot(num_running=2, num_waiting=1),
        backends={
            "v": BackendLoad(num_running=10, num_waiting=5),
            "e": BackendLoad(external=False, in_flight=99),
        },
    )
    assert load.batch_of("v") == 15
    assert load.batch_of("e") == 3  # the embedded backend's entry: the engine's batch
    assert load.batch_of("unknown") == 3


def test_combine_is_the_mean_over_healthy_replicas_and_healthy_if_any_is() -> None:
    members = [
        BackendLoad(
            in_flight=2,
            num_running=4,
            num_waiting=2,
            kv_cache_usage=0.2,
            latency_ewma_ms=100.0,
            speculative=True,
            acceptance_length=2.0,
        ),
        BackendLoad(
            in_flight=4,
            num_running=10,
            num_waiting=0,
            kv_cache_usage=0.6,
            latency_ewma_ms=300.0,
            acceptance_length=3.0,
        ),
        BackendLoad(
            in_flight=50,
            num_running=100,
            num_waiting=100,
            kv_cache_usage=1.0,
            latency_ewma_ms=5000.0,
            healthy=False,
            acceptance_length=9.0,
        ),
    ]
    group = BackendLoad.combine(members)
    assert group.healthy and group.external
    assert group.batch == 8  # (6 + 10) / 2: the sick replica takes no requests
    assert group.in_flight == 3
    assert group.kv_cache_usage == pytest.approx(0.4)
    assert group.latency_ewma_ms == pytest.approx(200.0)
    assert group.acceptance_length == pytest.approx(2.5)
    assert group.speculative
    sick = BackendLoad.combine([dataclasses.replace(m, healthy=False) for m in members])
    assert not sick.healthy
    assert sick.batch == round((6 + 10 + 200) / 3)  # none is healthy: the mean over all
    unscraped = BackendLoad.combine([BackendLoad(in_flight=4), BackendLoad(in_flight=8)])
    assert unscraped.num_running is None and unscraped.batch == 6


def test_combine_counts_an_unscraped_replicas_in_flight_as_its_batch() -> None:
    group = BackendLoad.combine([BackendLoad(in_flight=10), BackendLoad(num_running=2, num_waiting=0)])
    assert group.batch == 6  # the mean of the replicas' batches, 10 and 2
    with pytest.raises(ValueError):
        BackendLoad.combine([])


def test_odd_speculation_names_make_no_arm() -> None:
    for bad in ("", "upstream", "upstream-ngram", "a:b"):
        with pytest.raises(ValueError):
            Arm.upstream("vllm", bad)


def test_a_row_with_hostile_engine_load_still_rebuilds() -> None:
    hostile = {
        "load_running": float("nan"),
        "load_queue": -3.0,
        "load_log_batch_tokens": 1000.0,
        "load_kv_usage": 7.0,
    }
    load = Load.from_features(hostile)
    assert load.engine is not None
    assert (load.engine.num_running, load.engine.num_waiting, load.engine.kv_cache_usage) == (0, 0, 1.0)
    assert load.engine.num_batched_tokens > 0


# --- Arms ---------------------------------------------------------------------------------------


def test_upstream_arms_are_named_by_their_pools_speculation() -> None:
    assert Arm.upstream("vllm", None).key == "vllm:upstream"
    assert Arm.upstream("vllm", "off").key == "vllm:upstream"
    assert Arm.upstream("vllm", "ngram").key == "vllm:upstream-ngram"
    assert Arm.upstream("vllm", "on").key == "vllm:upstream-on"


@pytest.mark.parametrize(
    ("key", "external", "speculative", "proposer"),
    [
        ("embedded:off", False, False, "off"),
        ("embedded:ngram", False, True, "ngram"),
        ("embedded:eagle", False, True, "eagle"),
        ("vllm:upstream", True, False, "upstream"),
        ("vllm:upstream-ngram", True, True, "ngram"),
        ("vllm:upstream-eagle", True, True, "eagle"),
        ("vllm:upstream-on", True, True, "on"),
    ],
)
def test_arm_kind(key: str, external: bool, speculative: bool, proposer: str) -> None:
    arm = Arm.parse(key)
    assert (arm.external, arm.speculative, arm.proposer) == (external, speculative, proposer)
    assert arm.key == key and Arm.parse(arm.key) == arm


def test_arm_names_are_validated() -> None:
    for bad in ("nocolon", ":upstream", "a:b:upstream", "vllm:"):
        with pytest.raises(ValueError):
            Arm.parse(bad)
    with pytest.raises(ValueError):
        Arm.upstream("a:b", "ngram")


# --- The learned policy over two external pools --------------------------------------------------


@pytest.fixture(scope="module")
def pools_model() -> GoodputModel:
    return GoodputModel.fit(pool_rows(600, seed=1), min_arm_rows=20)


def learned(model: GoodputModel, **rules: float) -> LearnedPolicy:
    # The batch guard is off: what these tests see must come from the learned load effect.
    return LearnedPolicy(RuleConfig(max_batch_for_spec=0, **rules), model, seed=0)  # type: ignore[arg-type]


def test_each_pools_model_reads_its_own_backends_load(pools_model: GoodputModel) -> None:
    assert set(pools_model.arms) == {SPEC.key, PLAIN.key}
    policy = learned(pools_model)
    # Open chat at a high temperature: the rules take the plain pool; an idle spec pool is faster.
    light = policy.decide(ctx("open_chat", pools_load(spec=2, plain=5), temperature=1.0), explore=False)
    assert light.arm == SPEC, light.reason
    # Code: the rules take the spec pool; busy, it is slower than the plain pool.
    busy = policy.decide(ctx("code", pools_load(spec=35, plain=5)), explore=False)
    assert busy.arm == PLAIN, busy.reason
    # A spec pool half busy: which is better depends on the plain pool's own load.
    assert policy.decide(ctx("code", pools_load(spec=12, plain=2)), explore=False).arm == PLAIN
    assert policy.decide(ctx("code", pools_load(spec=12, plain=40)), explore=False).arm == SPEC
    # The fitted load effect is the world's: 40 * exp(-0.08 * batch) tok/s at 2 and at 35 running.
    preds = light.predictions
    assert preds[SPEC.key]["tokens_per_s"] == pytest.approx(40.0 * math.exp(-0.16), rel=0.15)
    assert busy.predictions[SPEC.key]["tokens_per_s"] == pytest.approx(40.0 * math.exp(-2.8), rel=0.3)
    # An external server sets its own K.
    assert light.spec is None


def test_the_pools_decision_does_not_read_the_engines_load(pools_model: GoodputModel) -> None:
    policy = learned(pools_model)
    for spec in (2, 12, 35):
        decisions = []
        for engine in (0, 30, 64):
            c = ctx("code", pools_load(spec=spec, plain=10, engine=engine))
            c.features.update(Load(LoadSnapshot(num_running=engine, num_waiting=engine)).engine_features())
            decisions.append(policy.decide(c, explore=False))
        assert len({d.arm for d in decisions}) == 1
        assert all(d.predictions == decisions[0].predictions for d in decisions)


def test_a_model_fitted_on_old_rows_predicts_from_the_engines_load() -> None:
    # Rows from before per-backend load: the plain names only (the engine's batch then).
    rng = random.Random(5)
    rows = []
    for i in range(200):
        arm = POOLS[i % 2]
        running = rng.randint(0, 40)
        tps = (40.0 * math.exp(-0.08 * running) if arm == SPEC else 25.0) * math.exp(rng.gauss(0, 0.1))
        rows.append(TrainingRow(arm.key, synth.features("code", running, rng), tps, 1000.0 / tps, "code"))
    model = GoodputModel.fit(rows, min_arm_rows=20)
    assert set(model.arms) == {SPEC.key, PLAIN.key}
    idle, busy = (
        model.predict(
            SPEC.key,
            DecisionContext(
                "code", 0.9, request("code"), Load(LoadSnapshot(num_running=r, kv_cache_usage=r / 64)), POOLS
            ).model_input(SPEC),
        )
        for r in (0, 35)
    )
    assert idle.tokens_per_s == pytest.approx(40.0, rel=0.15)
    assert busy.tokens_per_s < idle.tokens_per_s / 5
    # And replayed on its own (old) rows, it reads their engine features.
    row = rows[0]
    assert model.predict(row.arm, row.features).tokens_per_s > 0
    policy = learned(model)
    assert policy.decide(ctx("code", Load.from_features(rows[0].features)), explore=False).arm in POOLS


# --- Guards -------------------------------------------------------------------------------------


def keys(c: DecisionContext, rules: RuleConfig | None = None, **kw: dict[str, float]) -> list[str]:
    arms, _ = safe_arms(c, rules or RuleConfig(), **kw)  # type: ignore[arg-type]
    return [a.key for a in arms]


def test_a_speculative_pool_past_its_measured_crossover_of_its_own_backend_is_dropped() -> None:
    both = [*POOLS, *EMBEDDED]
    crossovers = {f"code:{SPEC.key}": 16.0}
    # Its own batch past the class's crossover, the engine idle: the pool goes, the engine's stay.
    arms, why = safe_arms(
        ctx("code", pools_load(spec=16, plain=0), both), RuleConfig(), crossovers=crossovers
    )
    assert [a.key for a in arms] == [PLAIN.key, *(a.key for a in EMBEDDED)]
    assert "spec:upstream-ngram (batch 16 >= measured 16)" in "; ".join(why)
    assert keys(ctx("code", pools_load(spec=15, plain=0), both), crossovers=crossovers) == [
        a.key for a in both
    ]
    # Nothing measured: no constant stands in (a busy external pool would never be measured).
    assert keys(ctx("code", pools_load(spec=500, plain=0), both)) == [a.key for a in both]
    # The engine's batch is not the pool's: a full engine turns off embedded drafting only.
    full_engine = pools_load(spec=3, plain=0, engine=64)
    assert keys(ctx("code", full_engine, both), crossovers=crossovers) == [
        SPEC.key,
        PLAIN.key,
        "embedded:off",
    ]
    # Waiting requests count; so does the gateway's own in-flight count when it is not scraped.
    queued = Load(backends={"spec": BackendLoad(num_running=10, num_waiting=6), "plain": BackendLoad()})
    assert keys(ctx("code", queued), crossovers=crossovers) == [PLAIN.key]
    unscraped = Load(backends={"spec": BackendLoad(in_flight=20), "plain": BackendLoad()})
    assert keys(ctx("code", unscraped), crossovers=crossovers) == [PLAIN.key]


def test_a_speculative_pool_stays_when_no_plain_pool_remains() -> None:
    busy = pools_load(spec=200, plain=0)
    assert keys(ctx("code", busy, [SPEC])) == [SPEC.key]
    assert keys(ctx("code", busy, [SPEC, *EMBEDDED])) == [SPEC.key, *(a.key for a in EMBEDDED)]
    sick = dataclasses.replace(busy, backends={**busy.backends, "plain": BackendLoad(healthy=False)})
    assert keys(ctx("code", sick)) == [SPEC.key]


def test_only_the_classs_own_measured_crossover_counts() -> None:
    crossovers = {SPEC.key: 30.0, f"qa:{SPEC.key}": 30.0, f"code:{SPEC.key}": 5.0}
    # qa's own 30 holds, not the rules' 16.
    assert keys(ctx("qa", pools_load(spec=20, plain=0)), crossovers=crossovers) == [SPEC.key, PLAIN.key]
    assert keys(ctx("qa", pools_load(spec=30, plain=0)), crossovers=crossovers) == [PLAIN.key]
    # rag has none: an arm-wide figure is not used (it mixes classes), nor any constant.
    assert keys(ctx("rag", pools_load(spec=500, plain=0)), crossovers=crossovers) == [SPEC.key, PLAIN.key]
    # code has: 5.
    arms, why = safe_arms(ctx("code", pools_load(spec=5, plain=0)), RuleConfig(), crossovers=crossovers)
    assert [a.key for a in arms] == [PLAIN.key] and "measured 5" in "; ".join(why)
    assert keys(ctx("code", pools_load(spec=4, plain=0)), crossovers=crossovers) == [SPEC.key, PLAIN.key]
    # No crossover at any batch seen.
    never = {f"code:{SPEC.key}": 1e6}
    assert keys(ctx("code", pools_load(spec=5000, plain=0)), crossovers=never) == [SPEC.key, PLAIN.key]


def test_structured_output_keeps_speculative_pools_and_drops_unsafe_embedded_methods() -> None:
    arms = [*POOLS, *EMBEDDED, Arm("embedded", "draft_model"), Arm.upstream("eagle", "eagle")]
    c = ctx("tool_call", pools_load(spec=0, plain=0), arms, tools=True)
    kept, why = safe_arms(c, RuleConfig())
    assert [a.key for a in kept] == [
        SPEC.key,
        PLAIN.key,
        "embedded:off",
        "embedded:ngram",
        "eagle:upstream-eagle",
    ]
    assert any("structured output" in w for w in why)
    # A JSON request of another class too.
    c = ctx("code", pools_load(spec=0, plain=0), arms, tools=True)
    assert "embedded:draft_model" not in keys(c) and "eagle:upstream-eagle" in keys(c)


# --- The rules across pools ---------------------------------------------------------------------


@pytest.mark.parametrize("order", [POOLS, POOLS[::-1]])
def test_rules_take_the_pool_of_the_class_rules_kind(order: list[Arm]) -> None:
    assert RuleConfig().across_backends
    policy = RulePolicy(RuleConfig(), priors={"code:ngram": 0.8, "code:upstream-ngram": 0.8}, seed=0)
    idle = pools_load(spec=0, plain=0)
    code = policy.decide(ctx("code", idle, order), explore=False)
    assert code.arm == SPEC and "speculative pool spec" in code.reason
    assert code.spec is None  # an external server sets its own K
    chat = policy.decide(ctx("open_chat", idle, order, temperature=1.0), explore=False)
    assert chat.arm == PLAIN and "plain pool plain" in chat.reason
    assert chat.spec is None
    assert policy.decide(ctx("open_chat", idle, order, temperature=0.2), explore=False).arm == SPEC
    off_for_qa = RulePolicy(RuleConfig().merged({"classes": {"qa": {"method": "off"}}}), seed=0)
    assert off_for_qa.decide(ctx("qa", idle, order), explore=False).arm == PLAIN
    assert off_for_qa.decide(ctx("code", idle, order), explore=False).arm == SPEC


def test_without_routing_across_backends_only_the_first_backends_arms() -> None:
    rules = RuleConfig(across_backends=False, exploration_rate=1.0, exploration_cap=1.0)
    idle = pools_load(spec=0, plain=0)
    for first in POOLS:
        order = [first, *(a for a in POOLS if a != first)]
        policy = RulePolicy(rules, seed=0)
        picks = {
            policy.decide(ctx(label, idle, order, temperature=1.0)).arm for label in ("code", "open_chat")
        }
        picks |= {policy.decide(ctx("code", idle, order)).arm for _ in range(30)}
        assert picks == {first}
    explorer = RulePolicy(RuleConfig(exploration_rate=1.0, exploration_cap=1.0), seed=0)
    assert {explorer.decide(ctx("code", idle)).arm for _ in range(30)} == {PLAIN}  # always away from SPEC


# --- SLOs ---------------------------------------------------------------------------------------

FAST = Arm.upstream("fast", None)  # more tokens/s, a long time to the first token
SLOW = Arm.upstream("slow", "ngram")


def slo_rows(n: int, latency: bool = True, seed: int = 0) -> list[TrainingRow]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        arm = (FAST, SLOW)[i % 2]
        load = Load(
            backends={
                "fast": BackendLoad(num_running=rng.randint(0, 8)),
                "slow": BackendLoad(num_running=rng.randint(0, 8)),
            }
        )
        feats = {**synth.features("open_chat", 0, rng, 1.0), **load.features()}
        tps = (50.0 if arm == FAST else 30.0) * math.exp(rng.gauss(0.0, 0.05))
        ttft = (800.0 if arm == FAST else 100.0) * math.exp(rng.gauss(0.0, 0.05))
        out.append(
            TrainingRow(
                arm.key,
                feats,
                tps,
                1000.0 / tps if latency else None,
                "open_chat",
                float(i),
                propensity=0.5,
                ttft_ms=ttft if latency else None,
            )
        )
    return out


@pytest.fixture(scope="module")
def slo_model() -> GoodputModel:
    return GoodputModel.fit(slo_rows(200), min_arm_rows=20)


def slo_ctx(slo: Slo | None, arms: list[Arm] | None = None) -> DecisionContext:
    load = Load(backends={"fast": BackendLoad(num_running=4), "slow": BackendLoad(num_running=4)})
    return ctx("open_chat", load, arms or [FAST, SLOW], temperature=1.0, slo=slo)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, 1e7 + 1])
def test_slo_targets_are_validated(bad: float) -> None:
    with pytest.raises(ValueError):
        Slo(ttft_ms=bad)
    with pytest.raises(ValueError):
        Slo(tpot_ms=bad)


def test_slo_headroom_is_the_worst_ratio_of_target_to_prediction() -> None:
    assert Slo(ttft_ms=1e7, tpot_ms=0.5).as_dict() == {"ttft_ms": 1e7, "tpot_ms": 0.5}
    both = Slo(ttft_ms=200.0, tpot_ms=50.0)
    assert both.headroom(100.0, 100.0) == pytest.approx(0.5)
    assert both.headroom(400.0, 25.0) == pytest.approx(0.5)
    assert both.headroom(50.0, 25.0) == pytest.approx(2.0)
    assert both.headroom(None, 25.0) is None  # a target without its prediction: unknown
    assert both.headroom(100.0, None) is None
    assert Slo(tpot_ms=50.0).headroom(None, 25.0) == pytest.approx(2.0)  # no TTFT target
    assert Slo(ttft_ms=200.0).headroom(0.0, None) == pytest.approx(2e11)  # no division by zero
    assert Slo().headroom(10.0, 10.0) is None
    assert Slo().as_dict() == {}


def test_latency_models_are_fitted_per_arm(slo_model: GoodputModel) -> None:
    c = slo_ctx(None)
    fast = slo_model.predict(FAST.key, c.model_input(FAST))
    slow = slo_model.predict(SLOW.key, c.model_input(SLOW))
    assert fast.ttft_ms == pytest.approx(800.0, rel=0.1) and slow.ttft_ms == pytest.approx(100.0, rel=0.1)
    assert fast.tpot_ms == pytest.approx(20.0, rel=0.1) and slow.tpot_ms == pytest.approx(1000 / 30, rel=0.1)


def decide(model: GoodputModel, slo: Slo | None, **rules: float) -> Decision:
    return LearnedPolicy(RuleConfig(**rules), model, seed=0).decide(slo_ctx(slo), explore=False)  # type: ignore[arg-type]


def test_the_learned_policy_keeps_to_arms_predicted_to_meet_the_targets(slo_model: GoodputModel) -> None:
    free = decide(slo_model, None)
    assert free.arm == FAST and free.slo_headroom is None and not free.slo_miss
    tight = decide(slo_model, Slo(ttft_ms=300.0))
    assert tight.arm == SLOW and not tight.slo_miss, tight.reason
    assert tight.slo_headroom == pytest.approx(3.0, rel=0.1)
    assert "fast:upstream predicted to miss" in tight.reason
    assert tight.as_dict()["slo_headroom"] == tight.slo_headroom
    loose = decide(slo_model, Slo(ttft_ms=2000.0))  # both meet it: goodput chooses
    assert loose.arm == FAST and not loose.slo_miss
    assert loose.slo_headroom == pytest.approx(2.5, rel=0.1)
    by_tpot = decide(slo_model, Slo(tpot_ms=25.0))  # only the fast pool's TPOT meets it
    assert by_tpot.arm == FAST and by_tpot.slo_headroom == pytest.approx(1.25, rel=0.1)


def test_with_no_arm_meeting_the_targets_the_most_headroom_wins(slo_model: GoodputModel) -> None:
    d = decide(slo_model, Slo(ttft_ms=50.0))
    assert d.arm == SLOW and d.slo_miss and d.as_dict()["slo_miss"] is True
    assert d.slo_headroom == pytest.approx(0.5, rel=0.1)
    # Each arm misses one target: the slow pool's TPOT (25 / 33) is nearer than the fast's TTFT.
    d = decide(slo_model, Slo(ttft_ms=300.0, tpot_ms=25.0))
    assert d.arm == SLOW and d.slo_miss and d.slo_headroom == pytest.approx(0.75, rel=0.1)
    assert 0.0 < d.propensity <= 1.0


def test_without_latency_models_targets_filter_nothing() -> None:
    model = GoodputModel.fit(slo_rows(200, latency=False), min_arm_rows=20)
    assert all(m.ttft_coef is None and m.tpot_coef is None for m in model.arms.values())
    d = decide(model, Slo(ttft_ms=50.0, tpot_ms=1.0))
    assert d.arm == FAST and not d.slo_miss and d.slo_headroom is None
    assert "no arm's latency is modelled" in d.reason


def test_exploration_never_takes_an_arm_predicted_to_miss_when_one_meets(slo_model: GoodputModel) -> None:
    rules = RuleConfig(thompson_scale=50.0, exploration_rate=0.5, exploration_cap=1.0)
    unmodelled = Arm.upstream("new", None)
    arms = [FAST, SLOW, unmodelled]
    control = LearnedPolicy(rules, slo_model, budget=ExplorationBudget(1.0), seed=0)
    seen = [control.decide(slo_ctx(None, arms)) for _ in range(300)]
    assert {d.arm for d in seen} == set(arms)  # without targets, sampling reaches every arm
    policy = LearnedPolicy(rules, slo_model, budget=ExplorationBudget(1.0), seed=0)
    picks = [policy.decide(slo_ctx(Slo(ttft_ms=300.0), arms)) for _ in range(300)]
    assert FAST not in {d.arm for d in picks}
    assert all(0.0 < d.propensity <= 1.0 for d in [*seen, *picks])
    assert all(not d.slo_miss for d in picks)


# --- The TTFT model -----------------------------------------------------------------------------


def ttft_rows(with_ttft: int) -> list[TrainingRow]:
    rows = slo_rows(24, seed=3)[::2]  # 12 rows of the fast pool
    return [dataclasses.replace(r, ttft_ms=r.ttft_ms if i < with_ttft else None) for i, r in enumerate(rows)]


def test_the_ttft_model_needs_five_rows_that_know_it() -> None:
    assert GoodputModel.fit(ttft_rows(4), 5).arms[FAST.key].ttft_coef is None
    fitted = GoodputModel.fit(ttft_rows(5), 5).arms[FAST.key]
    assert fitted.ttft_coef is not None
    c = slo_ctx(None)
    assert fitted.predict(vector(c.model_input(FAST), FAST.key)).ttft_ms == pytest.approx(800.0, rel=0.2)
    none = GoodputModel.fit(ttft_rows(4), 5).predict(FAST.key, c.model_input(FAST))
    assert none.ttft_ms is None and "ttft_ms" not in none.as_dict()
    # A non-positive TTFT is not a measurement.
    zeros = [dataclasses.replace(r, ttft_ms=0.0) for r in ttft_rows(12)]
    assert GoodputModel.fit(zeros, 5).arms[FAST.key].ttft_coef is None


def test_the_arm_model_round_trips_and_reads_older_dicts(slo_model: GoodputModel) -> None:
    c = slo_ctx(None)
    for arm in (FAST, SLOW):
        m = slo_model.arms[arm.key]
        x = vector(c.model_input(arm), arm.key)
        back = ArmModel.from_dict(json.loads(json.dumps(m.as_dict())))
        assert back.predict(x) == m.predict(x)
        old = m.as_dict()
        del old["ttft_coef"], old["ttft_intercept"]  # a version saved before TTFT was modelled
        older = ArmModel.from_dict(old)
        assert older.ttft_coef is None
        p = older.predict(x)
        assert p.ttft_ms is None and p.tpot_ms == m.predict(x).tpot_ms and p.log_mean == m.predict(x).log_mean
    whole = GoodputModel.from_dict(json.loads(json.dumps(slo_model.as_dict())))
    assert whole.predict(SLOW.key, c.model_input(SLOW)) == slo_model.predict(SLOW.key, c.model_input(SLOW))


def test_a_group_of_replicas_each_at_the_limit_is_still_a_load() -> None:
    # Each replica may say 1e6 running and 1e6 waiting: the group's mean batch is held at the limit
    # rather than refused (a refusal here would fail every request's routing).
    full = BackendLoad(num_running=MAX_COUNT, num_waiting=MAX_COUNT)
    group = BackendLoad.combine([full, full])
    assert group.num_running == MAX_COUNT and group.batch == MAX_COUNT


def test_slo_unjudged_arms_count_only_when_the_policy_can_still_take_them() -> None:
    slow = Arm.upstream("slow", None)
    blind = Arm.upstream("blind", None)  # a goodput model, no latency model
    new = Arm.upstream("new", None)  # no model at all: exploration may take it
    preds = {
        slow: Prediction(math.log(50.0), 0.1, tpot_ms=10.0, ttft_ms=5000.0),
        blind: Prediction(math.log(50.0), 0.1, tpot_ms=None, ttft_ms=None),
    }
    slo = Slo(ttft_ms=1000.0)
    why: list[str] = []
    modelled, arms, miss, headroom = LearnedPolicy._within_slo(slo, [slow, blind], [slow, blind], preds, why)
    assert modelled == [slow] and arms == [slow] and miss  # blind cannot be chosen: a miss
    assert headroom[slow] == 0.2
    modelled, arms, miss, _ = LearnedPolicy._within_slo(slo, [slow, blind, new], [slow, blind], preds, why)
    assert modelled == [slow] and arms == [slow, new] and not miss  # new might meet it
