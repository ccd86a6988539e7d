"""Where an external speculative pool stops paying (policies/crossover.py), measured on telemetry;
kept in a policy version (state.py), fitted by retraining (training/retrain.py), obeyed by the
guards."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable

import pytest

from specgate.engine.vocab import LoadSnapshot
from specgate.policies.arms import Arm
from specgate.policies.crossover import MIN_ROWS, NEVER, pool_crossovers
from specgate.policies.decision import DecisionContext
from specgate.policies.goodput import TrainingRow
from specgate.policies.load import BackendLoad, Load
from specgate.policies.rule_policy import RulePolicy
from specgate.policies.rules import RuleConfig
from specgate.policies.state import PolicyState
from specgate.policies.training.retrain import retrain
from tests.policies import synthetic_telemetry as synth

SPEC = Arm.upstream("spec", "ngram")
PLAIN = Arm.upstream("plain", None)
Tpot = Callable[[int], float]  # TPOT ms by the serving backend's batch


def spec_tpot(b: int) -> float:
    return 10.0 + 2.0 * b


def plain_tpot(b: int) -> float:
    return 20.0 + 0.5 * b


def row(arm: Arm, batch: int, tpot: float, label: str, rng: random.Random, i: int = 0) -> TrainingRow:
    """A finished request on `arm` whose backend had `batch` requests running and waiting; the
    engine's load (the plain names) is random, and so is the other pool's."""
    waiting = rng.randint(0, batch)
    own = BackendLoad(num_running=batch - waiting, num_waiting=waiting)
    other = BackendLoad(num_running=rng.randint(0, 60))
    backends = {arm.backend: own, **{a.backend: other for a in (SPEC, PLAIN) if a.backend != arm.backend}}
    load = Load(LoadSnapshot(num_running=rng.randint(0, 60), num_waiting=rng.randint(0, 10)), backends)
    feats = {**synth.features(label, 0, rng), **load.features()}
    return TrainingRow(arm.key, feats, 1000.0 / tpot, tpot, label, float(i), propensity=0.5)


def rows(
    n: int,
    spec: Tpot = spec_tpot,
    plain: Tpot = plain_tpot,
    label: str = "code",
    seed: int = 0,
    max_batch: int = 30,
    noise: float = 0.2,
) -> list[TrainingRow]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        arm = (SPEC, PLAIN)[i % 2]
        batch = rng.randint(0, max_batch)
        tpot = (spec if arm == SPEC else plain)(batch) + rng.gauss(0.0, noise)
        out.append(row(arm, batch, tpot, label, rng, i))
    return out


def test_the_crossover_is_the_least_batch_where_the_spec_pool_is_no_faster() -> None:
    # 10 + 2b >= 20 + 0.5b from b = 6.67: 7.
    out = pool_crossovers(rows(100))
    assert out == {f"code:{SPEC.key}": 7.0}  # per class only; nothing for the plain pool


def test_the_crossover_reads_the_serving_backends_batch_and_not_the_engines() -> None:
    # Each row's batch is its own backend's running + waiting (split at random by `row`); the
    # engine's load and the other pool's are noise. Lines fitted on either would find nothing.
    out = pool_crossovers(rows(200, seed=4, noise=0.0))
    assert out[f"code:{SPEC.key}"] == 7.0
    # Another crossing: 10 + 2b >= 41 + 0.5b from b = 20.67: 21.
    other = pool_crossovers(rows(200, plain=lambda b: 41.0 + 0.5 * b, max_batch=60))
    assert other[f"code:{SPEC.key}"] == 21.0


def test_each_class_with_enough_rows_gets_its_own_crossover() -> None:
    # Code drafts well (10 + 2b); open chat less so (10 + 1.1b against 20 + 0.5b: from b = 16.67).
    code = rows(60, seed=1)
    chat = rows(60, spec=lambda b: 10.0 + 1.1 * b, label="open_chat", seed=2, max_batch=40, noise=0.05)
    qa = rows(MIN_ROWS - 1, label="qa", seed=3)  # too few spec rows of its own (5)
    out = pool_crossovers([*code, *chat, *qa])
    assert out[f"code:{SPEC.key}"] == 7.0
    assert out[f"open_chat:{SPEC.key}"] == 17.0
    assert f"qa:{SPEC.key}" not in out
    assert SPEC.key not in out  # no line over all classes: it would mix the two


def test_a_class_without_plain_rows_of_its_own_is_measured_against_all_plain_rows() -> None:
    spec_only = [r for r in rows(40, label="rag", seed=5) if r.arm == SPEC.key]
    out = pool_crossovers([*rows(60, seed=1), *spec_only])
    assert out[f"rag:{SPEC.key}"] == 7.0


def test_a_spec_pool_faster_at_every_batch_never_crosses() -> None:
    out = pool_crossovers(rows(100, spec=lambda b: 5.0 + 0.1 * b))
    assert out[f"code:{SPEC.key}"] == NEVER
    # Slower from the start: no batch at which it pays.
    assert pool_crossovers(rows(100, spec=lambda b: 30.0 + 2.0 * b))[f"code:{SPEC.key}"] == 0.0


def test_too_few_rows_or_no_spread_in_batch_give_no_crossover() -> None:
    assert pool_crossovers(rows(2 * (MIN_ROWS - 1))) == {}  # MIN_ROWS - 1 per pool
    plain = [r for r in rows(40) if r.arm == PLAIN.key]
    spec = [r for r in rows(40, seed=9) if r.arm == SPEC.key]
    assert pool_crossovers([*plain, *spec[: MIN_ROWS - 1]]) == {}
    assert pool_crossovers([*plain, *spec[:MIN_ROWS]]) == {f"code:{SPEC.key}": 7.0}
    assert pool_crossovers(rows(100, max_batch=0)) == {}  # every request at batch 0
    flat_spec = [r for r in rows(100, max_batch=0) if r.arm == SPEC.key]
    assert pool_crossovers([*flat_spec, *plain]) == {}
    # Rows without a measured TPOT do not count.
    unmeasured = [TrainingRow(r.arm, r.features, r.tokens_per_s, None, r.label) for r in rows(100)]
    assert pool_crossovers(unmeasured) == {}


def test_no_plain_pool_means_no_crossover() -> None:
    assert pool_crossovers([r for r in rows(100) if r.arm == SPEC.key]) == {}


def test_rows_from_embedded_arms_are_ignored() -> None:
    rng = random.Random(7)
    embedded = []
    for i in range(100):
        batch = rng.randint(0, 30)
        # The engine speculating terribly and decoding plainly at a constant 1 ms: neither is a pool.
        embedded.append(row(Arm("embedded", "ngram"), batch, 500.0 + 9.0 * batch, "code", rng, i))
        embedded.append(row(Arm("embedded", "off"), batch, 1.0 + 0.01 * batch, "code", rng, i))
    base = rows(100)
    assert pool_crossovers([*base, *embedded]) == pool_crossovers(base) == {f"code:{SPEC.key}": 7.0}
    # Embedded plain decoding is not a plain pool to compare against.
    spec_and_embedded = [*(r for r in base if r.arm == SPEC.key), *embedded]
    assert pool_crossovers(spec_and_embedded) == {}


def test_the_best_plain_pool_is_the_one_to_beat() -> None:
    other = Arm.upstream("other", "off")
    assert other.key == "other:upstream"
    rng = random.Random(8)
    better = [row(other, b, 15.0 + 0.25 * b, "code", rng, i) for i, b in enumerate(range(0, 40, 2))]
    # 10 + 2b >= 15 + 0.25b from b = 2.86: 3 (the slower plain pool would give 7).
    assert pool_crossovers([*rows(100), *better])[f"code:{SPEC.key}"] == 3.0


def test_policy_state_keeps_the_crossovers_and_its_policy_obeys_them() -> None:
    crossovers = {f"qa:{SPEC.key}": 30.0, f"code:{SPEC.key}": 7.0}
    state = PolicyState(RuleConfig(), crossovers=crossovers)
    back = PolicyState.from_dict(json.loads(json.dumps(state.as_dict())))
    assert back.crossovers == crossovers
    older = state.as_dict()
    del older["crossovers"]  # a version saved before crossovers were measured
    assert PolicyState.from_dict(older).crossovers == {}
    policy = back.build(seed=0)
    assert isinstance(policy, RulePolicy) and policy.crossovers == crossovers

    def pick(label: str, spec_batch: int) -> Arm:
        load = Load(backends={"spec": BackendLoad(num_running=spec_batch), "plain": BackendLoad()})
        c = DecisionContext(label, 0.95, {"temperature": 0.0}, load, [SPEC, PLAIN])
        return policy.decide(c, explore=False).arm

    assert pick("code", 6) == SPEC and pick("code", 7) == PLAIN
    assert pick("qa", 20) == SPEC and pick("qa", 30) == PLAIN  # the class's, not the rules' 16
    assert pick("rag", 500) == SPEC  # none measured: no constant stands in


@pytest.fixture(scope="module")
def retrained() -> PolicyState:
    data = rows(300, seed=11)
    for r in data:  # goodput the pools' goodput models can learn (tokens/s = 1000 / TPOT)
        assert math.isclose(r.tokens_per_s * (r.tpot_ms or 0.0), 1000.0)
    return retrain(data, RuleConfig(), PolicyState()).state


def test_retraining_measures_the_crossovers(retrained: PolicyState) -> None:
    assert retrained.kind == "learned"
    assert retrained.crossovers == {f"code:{SPEC.key}": 7.0}
    assert (
        PolicyState.from_dict(json.loads(json.dumps(retrained.as_dict()))).crossovers == retrained.crossovers
    )
    policy = retrained.build(seed=0)
    load = Load(backends={"spec": BackendLoad(num_running=8), "plain": BackendLoad(num_running=8)})
    c = DecisionContext("code", 0.95, synth.features("code", 0, random.Random(0)), load, [SPEC, PLAIN])
    decision = policy.decide(c, explore=False)
    assert decision.arm == PLAIN and "measured 7" in decision.reason
