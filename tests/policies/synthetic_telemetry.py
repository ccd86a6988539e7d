"""Synthetic telemetry with a known answer: ngram doubles goodput on code, halves it on open chat,
and every speculative arm loses more than plain decoding as the batch grows."""

from __future__ import annotations

import math
import random
from typing import Any

from specgate.policies.classes import WORKLOAD_CLASSES
from specgate.policies.goodput import TrainingRow

BASE_TPS = 20.0
NGRAM_GAIN = {"code": 2.0, "open_chat": 0.5}


def features(label: str, running: int, rng: random.Random, temperature: float = 0.0) -> dict[str, float]:
    probs = {c: 0.02 for c in WORKLOAD_CLASSES}
    probs[label] = 1.0 - 0.02 * (len(WORKLOAD_CLASSES) - 1)
    out = {f"p_{c}": p for c, p in probs.items()}
    out.update(
        log_prompt_tokens=math.log1p(rng.randint(50, 400)),
        log_max_tokens=math.log1p(128),
        temperature=temperature,
        top_p=1.0,
        copyability=rng.uniform(0.0, 0.3),
        tools_or_json=0.0,
        load_running=float(running),
        load_queue=0.0,
        # The live signals a test gateway reports (step time, batch tokens) depend on the machine;
        # constant here, so that a model fitted on these rows gives them no weight.
        load_log_batch_tokens=0.0,
        load_kv_usage=min(1.0, running / 64),
        load_log_step_ms=0.0,
    )
    return out


def true_goodput(arm: str, label: str, running: int) -> float:
    """tokens/s per request: speculation's gain decays with the batch (verification is no longer free)."""
    if arm.endswith(":off"):
        return BASE_TPS * math.exp(-0.01 * running)
    return BASE_TPS * NGRAM_GAIN.get(label, 1.0) * math.exp(-0.06 * running)


def rows(
    n: int, seed: int = 0, classes: tuple[str, ...] = ("code", "open_chat"), max_running: int = 40
) -> list[TrainingRow]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = classes[i % len(classes)]
        arm = rng.choice(["embedded:off", "embedded:ngram"])
        running = rng.randint(0, max_running)
        tps = true_goodput(arm, label, running) * math.exp(rng.gauss(0.0, 0.1))
        drafted = 100 if arm.endswith("ngram") else None
        accepted = (70 if label == "code" else 20) if drafted else None
        out.append(
            TrainingRow(
                arm,
                features(label, running, rng),
                tps,
                1000.0 / tps,
                label,
                1_000_000.0 + i,
                drafted,
                accepted,
                0.5,  # the logged arm is drawn uniformly from two
            )
        )
    return out


def insert(engine: Any, n: int, seed: int, max_running: int = 8) -> None:
    """`rows(n)` as finished requests in a telemetry database, ending now (inside any window)."""
    import datetime as dt
    import time
    import uuid

    from sqlalchemy import insert as sql_insert

    from specgate.gateway.telemetry.tables import requests

    now = time.time()
    with engine.begin() as conn:
        for i, row in enumerate(rows(n, seed=seed, max_running=max_running)):
            at = dt.datetime.fromtimestamp(now - (n - i), tz=dt.UTC)
            conn.execute(
                sql_insert(requests).values(
                    request_id=f"synthetic-{uuid.uuid4().hex}",
                    endpoint="chat",
                    model="m",
                    stream=False,
                    arrival_time=at,
                    finished_time=at,
                    status=200,
                    outcome="ok",
                    cancelled=False,
                    completion_tokens=64,
                    tokens_per_s=row.tokens_per_s,
                    tpot_ms=row.tpot_ms,
                    backend="embedded",
                    spec_method=row.arm.split(":")[1],
                    route={"arm": row.arm},
                    features=row.features,
                    workload_class=row.label,
                    num_draft_tokens=row.draft_tokens,
                    num_accepted_tokens=row.accepted_tokens,
                    propensity=row.propensity,
                    policy="rules",
                    policy_version="1",
                )
            )
