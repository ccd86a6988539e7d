"""A request's record is built once and then only read: every part of it, nested values included."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from collections.abc import Callable
from typing import Any

import pytest

from specgate.engine.vocab import LoadSnapshot, SpecParams, SpecStep
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.telemetry.records import RequestRecord
from specgate.gateway.telemetry.rows import request_row, step_rows
from specgate.policies.load import BackendLoad, Load


def record() -> RequestRecord:
    route = RouteDecision(
        "m",
        ["embedded", "vllm"],
        SpecParams("ngram", "goodput", 0, 8),
        features={"temperature": 0.0, "class_probs": [0.9, 0.1]},
        predictions={"embedded:ngram": {"tps": 40.0, "spread": 2.0}},
        affinity={"group": "pool", "home": "embedded", "chosen": "embedded"},
        pools={"vllm": "vllm:upstream"},
        slo={"ttft_ms": 500.0},
        pool_batches={"vllm:upstream": 3},
    ).served_by("embedded", external=False)
    return RequestRecord(
        "req-1",
        "chat",
        "m",
        arrival_time=1.0,
        stream=False,
        route=route,
        load=Load(LoadSnapshot(num_running=2, num_waiting=1), {"vllm": BackendLoad(1, num_running=3)}),
        spec_decoding={"num_drafts": 2, "num_accepted_tokens_per_pos": [2, 1]},
        upstream={"timings": {"predicted_ms": 3.0}},
        spec_steps=[SpecStep(3, 2, 7, 12.5, 3), SpecStep(3, 1, 7, 11.0, 3)],
    )


MUTATIONS: dict[str, Callable[[RequestRecord], Any]] = {
    "a field": lambda r: setattr(r, "status", 500),
    "the route": lambda r: setattr(r.route, "backend", "vllm"),
    "the route's candidates": lambda r: r.route.backends.append("x"),
    "the route's features": lambda r: r.route.features.__setitem__("temperature", 2.0),
    "a nested feature list": lambda r: r.route.features["class_probs"].append(0.0),
    "a prediction": lambda r: r.route.predictions["embedded:ngram"].__setitem__("tps", 1.0),
    "the affinity": lambda r: r.route.affinity.__setitem__("hit", False),
    "the affinity, cleared": lambda r: r.route.affinity.clear(),
    "the pools": lambda r: r.route.pools.update({"x": "y"}),
    "the slo": lambda r: r.route.slo.pop("ttft_ms"),
    "the speculation setting": lambda r: setattr(r.route.spec, "k_max", 64),
    "the load": lambda r: setattr(r.load, "engine", None),
    "the engine's load": lambda r: setattr(r.load.engine, "num_running", 0),
    "the backends' load": lambda r: r.load.backends.__setitem__("x", BackendLoad()),
    "a backend's load": lambda r: setattr(r.load.backends["vllm"], "in_flight", 9),
    "the counters": lambda r: r.spec_decoding.__setitem__("num_drafts", 0),
    "a nested counter list": lambda r: r.spec_decoding["num_accepted_tokens_per_pos"].append(1),
    "the upstream fields": lambda r: r.upstream["timings"].__setitem__("predicted_ms", 0.0),
    "the steps": lambda r: r.spec_steps.append(SpecStep(1, 1, 1, 1.0, 1)),
    "a step": lambda r: setattr(r.spec_steps[0], "accepted", 0),
}


@pytest.mark.parametrize("what", MUTATIONS)
def test_no_part_of_a_record_can_be_changed(what: str) -> None:
    rec = record()
    before = request_row(rec), step_rows(rec)
    with pytest.raises((AttributeError, TypeError, dataclasses.FrozenInstanceError)):
        MUTATIONS[what](rec)
    assert (request_row(rec), step_rows(rec)) == before


def test_a_frozen_record_still_serializes_copies_and_pickles() -> None:
    rec = record()
    row = request_row(rec)
    assert json.loads(json.dumps(row["route"])) == row["route"]  # read-only mappings are dicts to JSON
    assert (
        row["route"]["affinity"]["hit"] is True and row["load_running"] == 2 and row["load_queue_depth"] == 1
    )
    for clone in (copy.deepcopy(rec), pickle.loads(pickle.dumps(rec))):
        assert request_row(clone) == row and step_rows(clone) == step_rows(rec)
        with pytest.raises(TypeError):
            clone.route.features["temperature"] = 1.0  # type: ignore[index, union-attr]


def test_served_by_leaves_the_planned_route_as_it_was() -> None:
    planned = RouteDecision(
        "m", ["a", "b"], None, affinity={"home": "a"}, chosen_arm="a:upstream", propensity=0.5
    )
    served = planned.served_by("b", external=True)
    assert (served.backend, served.arm, served.propensity, served.affinity) == (
        "b",
        "b:upstream",
        None,  # another pool served: the chosen arm's chance no longer weighs this outcome
        {"home": "a", "hit": False},
    )
    assert planned.backend is None and planned.propensity == 0.5 and planned.affinity == {"home": "a"}
