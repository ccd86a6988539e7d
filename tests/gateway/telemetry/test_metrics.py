"""Prometheus series the gateway derives from request records: the prefix-cache counters count what a
backend reported and nothing else, and no value in a record can break /metrics."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specgate.gateway.telemetry.metrics import Metrics
from specgate.gateway.telemetry.records import RequestRecord

QUERIED = "specgate_prefix_cache_queried_tokens_total"
HITS = "specgate_prefix_cache_hit_tokens_total"


def _metrics() -> Metrics:
    m = Metrics()
    m.models = lambda: {"m": None}
    return m


def _record(prompt: object, cached: object, model: str = "m", outcome: str = "ok") -> RequestRecord:
    now = time.time()
    return RequestRecord(
        "r",
        "chat",
        model,
        arrival_time=now,
        stream=False,
        backend="embedded",
        status=200,
        outcome=outcome,
        prompt_tokens=prompt,  # type: ignore[arg-type]
        cached_tokens=cached,  # type: ignore[arg-type]
        finished_time=now,
    )


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.name in (QUERIED, HITS):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


LABELS = (("backend", "embedded"), ("model", "m"))


def test_queried_and_hit_tokens_count_reported_hits() -> None:
    m = _metrics()
    m.observe(_record(10, 4))
    m.observe(_record(6, 0))
    m.observe(_record(8, 8, outcome="cancelled"))  # the lookup happened whatever came after
    samples = _samples(m)
    assert samples[(QUERIED, LABELS)] == 24 and samples[(HITS, LABELS)] == 12


def test_a_backend_that_does_not_report_hits_is_not_counted() -> None:
    m = _metrics()
    m.observe(_record(10, None))
    m.observe(_record(None, 3))
    assert _samples(m) == {}


@pytest.mark.parametrize(
    ("prompt", "cached"),
    [(-1, 0), (10, -3), (True, 1), (10, False), (2**40, 1), (10, 2**40), (10.0, 4), (10, "4"), ("10", 4)],
)
def test_hostile_counts_are_skipped_and_metrics_still_render(prompt: object, cached: object) -> None:
    m = _metrics()
    m.observe(_record(prompt, cached))
    m.observe(_record(10, 4))  # the next request counts as usual
    samples = _samples(m)
    assert samples[(QUERIED, LABELS)] == 10 and samples[(HITS, LABELS)] == 4


def test_hits_never_exceed_what_was_queried() -> None:
    m = _metrics()
    m.observe(_record(10, 25))
    samples = _samples(m)
    assert samples[(QUERIED, LABELS)] == 10 and samples[(HITS, LABELS)] == 10


def test_a_model_nobody_serves_cannot_mint_a_series() -> None:
    m = _metrics()
    m.observe(_record(10, 4, model='\ud800 evil\n{model="x"}'))
    samples = _samples(m)
    assert samples == {
        (QUERIED, (("backend", "embedded"), ("model", "unknown"))): 10,
        (HITS, (("backend", "embedded"), ("model", "unknown"))): 4,
    }


def test_multiprocess_mode_refuses_a_process_where_prometheus_client_started_without_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Set after prometheus_client was imported, the directory would be ignored and /metrics would
    show one worker's numbers as if they were all of them: refused, loudly. (The aggregation itself
    needs fresh processes: tests/gateway/serve/test_supervisor.py.)"""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        Metrics(multiprocess=True)
    single = Metrics()
    assert single.view is single.registry  # one process: its own registry, as ever
