"""Latency targets (SLOs) end to end: the x-slo-ttft-ms / x-slo-tpot-ms headers, a key's defaults and
the gateway's; the row's slo_ttft_ms / slo_tpot_ms / slo_met; a learned policy that keeps to the arms
predicted to meet them, refusing (429 slo_unattainable) or serving by the arm with the most headroom
when none is.

Live gateways in front of the scripted upstream (two external backends, `a` and `b`, on one fake),
each writing its rows to a SQLite file that the tests read back.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from specgate.engine.vocab import LoadSnapshot
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.telemetry.records import RequestRecord
from specgate.gateway.telemetry.rows import request_row
from specgate.policies.goodput import GoodputModel, TrainingRow
from specgate.policies.load import BackendLoad, Load
from specgate.policies.rules import RuleConfig
from specgate.policies.state import PolicyState
from tests.gateway.fake_upstream import HTTP, FakeUpstream, Reply, backend, running_gateway
from tests.gateway.live import ADMIN_HEADERS, LiveGateway, stored_row
from tests.policies import synthetic_telemetry as synth

pytestmark = pytest.mark.timeout(90)

PUBLIC, UPSTREAM = "public-model", "upstream-model"
KEY = "sk-slo-plain-0123456789"  # no latency targets of its own
SLO_KEY = "sk-slo-targets-0123456789"  # slo_ttft_ms 1234, slo_tpot_ms 56
TTFT_KEY = "sk-slo-ttft-only-0123456789"  # slo_ttft_ms 777 only
API_KEYS = [
    {"key": KEY},
    {"key": SLO_KEY, "slo_ttft_ms": 1234, "slo_tpot_ms": 56},
    {"key": TTFT_KEY, "slo_ttft_ms": 777},
]
HEADERS = ("x-slo-ttft-ms", "x-slo-tpot-ms")
# What a vLLM server with per-request metrics says of a non-streamed answer (its own TTFT and TPOT).
VLLM_TIMINGS = {"time_to_first_token_ms": 41.5, "generation_time_ms": 40.0, "mean_itl_ms": 10.0}


class Gateway:
    def __init__(self, live: LiveGateway, fake: FakeUpstream, db: sa.Engine) -> None:
        self.live, self.fake, self.db = live, fake, db

    def post(
        self,
        headers: dict[str, str] | None = None,
        key: str = KEY,
        stream: bool = False,
        reply: Reply | None = None,
    ) -> tuple[httpx.Response, dict[str, Any]]:
        """One chat request; its response and the row the writer stored for it."""
        if reply is not None:
            self.fake.script(reply)
        rid = f"slo-{uuid.uuid4().hex}"
        body = {"model": PUBLIC, "messages": [{"role": "user", "content": "Say hello"}], "stream": stream}
        sent = {"authorization": f"Bearer {key}", "x-request-id": rid, **(headers or {})}
        r = HTTP.post(f"{self.live.url}/v1/chat/completions", json=body, headers=sent)
        return r, self.row(rid)

    def row(self, rid: str) -> dict[str, Any]:
        return stored_row(self.db, rid)

    def install(self, state: PolicyState) -> int:
        """Route by `state` from now on: stored as a version, then made active through the admin
        API (a rollback to it), as an operator restores any stored version."""
        manager = self.live.services.policy
        assert manager is not None
        version = manager.store.add(
            {
                "kind": state.kind,
                "source": "edit",
                "status": "retired",
                "parent_version": manager.version,
                "artifact": state.as_dict(),
                "note": "test: a model of a and b",
            }
        )
        r = HTTP.post(f"{self.live.url}/admin/policy/rollback/{version}", headers=ADMIN_HEADERS)
        assert r.status_code == 200, r.text
        assert r.json()["policy"]["kind"] == "learned"
        return int(r.json()["policy"]["version"])


@contextmanager
def gateway(tmp: Path, **overrides: Any) -> Iterator[Gateway]:
    url = f"sqlite:///{tmp}/telemetry-{uuid.uuid4().hex[:8]}.db"
    telemetry = {"url": url, "auto_upgrade": True, "flush_interval": 0.02}
    overrides.setdefault("api_keys", API_KEYS)
    overrides.setdefault("policy", {"seed": 0})
    with FakeUpstream(models=(UPSTREAM,)) as fake:
        backends = [backend(n, fake, models={PUBLIC: UPSTREAM}) for n in ("a", "b")]
        with running_gateway(*backends, telemetry=telemetry, **overrides) as live:
            db = sa.create_engine(url)
            try:
                yield Gateway(live, fake, db)
            finally:
                db.dispose()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway with keys of their own targets and none of its own, the rules policy."""
    with gateway(tmp_path_factory.mktemp("slo")) as gw:
        yield gw


@pytest.fixture
def gw(served: Gateway) -> Gateway:
    served.fake.reset()
    return served


def route_of(r: httpx.Response) -> dict[str, Any]:
    route: dict[str, Any] = r.json()["metrics"]["route"]
    return route


# ---- the headers -------------------------------------------------------------------------------------

BAD = [
    "0",
    "-1",
    "abc",
    "nan",
    "NaN",
    "inf",
    "1e99",
    "10000001",
    "",
    "1" * 40,
    "0" * 39 + "5",
]  # the last: 5, in 40 chars


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("value", BAD, ids=repr)
def test_a_bad_target_is_refused_naming_the_header_and_the_row_is_kept(
    gw: Gateway, header: str, value: str
) -> None:
    r, row = gw.post({header: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == header and err["code"] == "invalid_value" and header in err["message"]
    assert err["type"] == "invalid_request_error"
    assert (row["status"], row["outcome"], row["error_code"]) == (400, "error", "invalid_value")
    assert row["slo_ttft_ms"] is None and row["slo_tpot_ms"] is None and row["slo_met"] is None
    assert gw.fake.posts() == []  # refused before any backend was asked


def test_targets_land_in_the_row_and_the_route(gw: Gateway) -> None:
    r, row = gw.post({"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "40.5"})
    assert r.status_code == 200, r.text
    route = route_of(r)
    assert route["slo"] == {"ttft_ms": 250.0, "tpot_ms": 40.5}
    assert route["slo_headroom"] is None  # the rules predict no latency
    assert (row["slo_ttft_ms"], row["slo_tpot_ms"]) == (250.0, 40.5)
    # A non-streamed answer without the backend's own timings: its TTFT is unknown, so is the verdict.
    assert row["ttft_ms"] is None and row["slo_met"] is None
    # Without targets: nothing in the route, NULL in the row.
    r, row = gw.post()
    assert r.status_code == 200 and "slo" not in route_of(r)
    assert (row["slo_ttft_ms"], row["slo_tpot_ms"], row["slo_met"]) == (None, None, None)


@pytest.mark.parametrize(("target", "met"), [("10000000", True), ("0.001", False)])
def test_a_stream_is_judged_by_the_ttft_the_gateway_saw(gw: Gateway, target: str, met: bool) -> None:
    r, row = gw.post({"x-slo-ttft-ms": target}, stream=True)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert row["ttft_ms"] is not None and row["slo_ttft_ms"] == float(target)
    assert row["slo_met"] is met


def test_a_target_whose_latency_is_unknown_is_not_judged(gw: Gateway) -> None:
    # A one-token stream has a TTFT but no time per output token.
    r, row = gw.post(
        {"x-slo-ttft-ms": "1000000", "x-slo-tpot-ms": "1000000"}, stream=True, reply=Reply.ok("one")
    )
    assert r.status_code == 200 and row["completion_tokens"] == 1
    assert row["ttft_ms"] is not None and row["tpot_ms"] is None and row["slo_met"] is None
    # The TTFT target alone is judged.
    r, row = gw.post({"x-slo-ttft-ms": "1000000"}, stream=True, reply=Reply.ok("one"))
    assert row["slo_met"] is True


@pytest.mark.parametrize(
    ("headers", "met"),
    [
        ({"x-slo-ttft-ms": "1000000", "x-slo-tpot-ms": "1000000"}, True),
        ({"x-slo-ttft-ms": "0.001"}, False),
        ({"x-slo-tpot-ms": "5"}, False),  # 10 ms per token as the backend measured it
        ({"x-slo-tpot-ms": "20"}, True),
    ],
)
def test_a_whole_answer_is_judged_by_the_backends_own_timings(
    gw: Gateway, headers: dict[str, str], met: bool
) -> None:
    r, row = gw.post(headers, reply=Reply.ok("one two three four five", extra={"metrics": VLLM_TIMINGS}))
    assert r.status_code == 200, r.text
    # The backend's own 41.5 ms, but never later than its answer arrived (the fake answers at once).
    assert row["ttft_ms"] is not None and 0 < row["ttft_ms"] <= min(41.5 + row["e2e_ms"], row["e2e_ms"])
    assert row["tpot_ms"] == pytest.approx(10.0)
    assert row["slo_met"] is met


def test_a_failed_request_is_not_judged(gw: Gateway) -> None:
    gw.fake.script(*(Reply.error(400, "bad request upstream") for _ in range(2)))
    r, row = gw.post({"x-slo-ttft-ms": "100000"})
    assert r.status_code == 400
    assert row["slo_ttft_ms"] == 100000.0 and row["slo_met"] is None


def test_a_keys_defaults_apply_where_the_request_sends_none(gw: Gateway) -> None:
    r, row = gw.post(key=SLO_KEY)
    assert r.status_code == 200 and route_of(r)["slo"] == {"ttft_ms": 1234.0, "tpot_ms": 56.0}
    assert (row["slo_ttft_ms"], row["slo_tpot_ms"]) == (1234.0, 56.0)
    # A header replaces its own target only.
    r, row = gw.post({"x-slo-ttft-ms": "99"}, key=SLO_KEY)
    assert (row["slo_ttft_ms"], row["slo_tpot_ms"]) == (99.0, 56.0)
    # Another key's targets are not this one's.
    r, row = gw.post(key=KEY)
    assert (row["slo_ttft_ms"], row["slo_tpot_ms"]) == (None, None)
    r, row = gw.post(key=TTFT_KEY)
    assert (row["slo_ttft_ms"], row["slo_tpot_ms"]) == (777.0, None)


def test_the_gateways_defaults_apply_last(tmp_path: Path) -> None:
    with gateway(tmp_path, slo={"ttft_ms": 500, "tpot_ms": 50}) as gw:
        _, row = gw.post(key=KEY)
        assert (row["slo_ttft_ms"], row["slo_tpot_ms"]) == (500.0, 50.0)
        _, row = gw.post({"x-slo-tpot-ms": "7"}, key=KEY)
        assert (row["slo_ttft_ms"], row["slo_tpot_ms"]) == (500.0, 7.0)
        _, row = gw.post(key=SLO_KEY)  # the key's own targets win over the gateway's
        assert (row["slo_ttft_ms"], row["slo_tpot_ms"]) == (1234.0, 56.0)


def test_a_key_that_sets_one_target_keeps_the_gateways_other(tmp_path: Path) -> None:
    with gateway(tmp_path, slo={"ttft_ms": 500, "tpot_ms": 50}) as gw:
        _, row = gw.post(key=TTFT_KEY)
        assert (row["slo_ttft_ms"], row["slo_tpot_ms"]) == (777.0, 50.0)


# ---- a learned policy keeps to the arms predicted to meet the targets --------------------------------

# a: the better goodput, but slow to its first token; b: slower decoding, quicker to start.
ARMS = {
    "a:upstream": {"tokens_per_s": 80.0, "ttft_ms": 5000.0, "tpot_ms": 12.5},
    "b:upstream": {"tokens_per_s": 40.0, "ttft_ms": 2000.0, "tpot_ms": 25.0},
}


def learned_state() -> PolicyState:
    """A goodput model of the two pools fitted on synthetic rows; exploration and Thompson sampling
    off, so that every decision is the model's own."""
    rng = random.Random(3)
    rows = []
    for arm, truth in ARMS.items():
        for i in range(60):
            noise = math.exp(rng.gauss(0.0, 0.05))
            rows.append(
                TrainingRow(
                    arm,
                    synth.features("open_chat", rng.randint(0, 4), rng),
                    truth["tokens_per_s"] * noise,
                    truth["tpot_ms"] / noise,
                    "open_chat",
                    1_000_000.0 + i,
                    ttft_ms=truth["ttft_ms"] / noise,
                )
            )
    model = GoodputModel.fit(rows, min_arm_rows=20)
    assert sorted(model.arms) == sorted(ARMS)
    rules = RuleConfig(exploration_rate=0.0, exploration_cap=0.0, thompson_scale=0.0)
    return PolicyState(rules=rules, model=model)


def test_the_learned_policy_serves_within_the_targets_or_by_the_most_headroom(tmp_path: Path) -> None:
    with gateway(tmp_path) as gw:
        gw.install(learned_state())
        # No targets: the better goodput.
        r, row = gw.post()
        assert r.status_code == 200 and route_of(r)["arm"] == "a:upstream", route_of(r)
        assert row["policy"] == "learned" and row["load_backend_batch"] == 0
        # A target only b is predicted to meet: b, with its headroom (3000 / ~2000).
        r, row = gw.post({"x-slo-ttft-ms": "3000"})
        route = route_of(r)
        assert r.status_code == 200 and route["arm"] == "b:upstream" and route["backend"] == "b"
        assert route["slo"] == {"ttft_ms": 3000.0} and 1.3 < route["slo_headroom"] < 1.7
        assert "SLO: " in route["reason"] and "a:upstream" in route["reason"].split("SLO: ", 1)[1]
        assert row["slo_ttft_ms"] == 3000.0 and row["slo_met"] is None  # a whole answer: TTFT unknown
        # A target nobody is predicted to meet, and the operator serves those anyway: the arm with
        # the most headroom (100 / ~2000 against 100 / ~5000).
        r, row = gw.post({"x-slo-ttft-ms": "100"})
        route = route_of(r)
        assert r.status_code == 200 and route["arm"] == "b:upstream", route
        assert route["slo"] == {"ttft_ms": 100.0} and 0.03 < route["slo_headroom"] < 0.07
        assert "SLO: " in route["reason"] and "most headroom" in route["reason"]
        assert row["status"] == 200 and row["slo_ttft_ms"] == 100.0
        # Streamed: the gateway times it; the fake answers at once, well within 100 ms.
        r, row = gw.post({"x-slo-ttft-ms": "100"}, stream=True)
        assert r.status_code == 200 and row["backend"] == "b" and row["slo_met"] is True


def test_with_reject_on_an_unattainable_target_is_refused(tmp_path: Path) -> None:
    with gateway(tmp_path, slo={"reject": True}, retry_after_seconds=3) as gw:
        # The rules predict no latency: nothing to refuse by.
        r, _ = gw.post({"x-slo-ttft-ms": "1"})
        assert r.status_code == 200
        gw.install(learned_state())
        gw.fake.reset()
        r, row = gw.post({"x-slo-ttft-ms": "100"})
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "slo_unattainable" and err["type"] == "rate_limit_error"
        assert r.headers["retry-after"] == "3"
        assert (row["status"], row["error_code"]) == (429, "slo_unattainable")
        assert gw.fake.posts() == []  # no backend was asked
        # A target one arm meets is served by it; no target at all, as before.
        r, _ = gw.post({"x-slo-ttft-ms": "3000"})
        assert r.status_code == 200 and route_of(r)["arm"] == "b:upstream"
        r, _ = gw.post()
        assert r.status_code == 200 and route_of(r)["arm"] == "a:upstream"
        # A key's default target is refused alike.
        r, _ = gw.post(key=SLO_KEY)  # ttft 1234 ms: nobody is predicted under ~2000
        assert r.status_code == 429 and r.json()["error"]["code"] == "slo_unattainable"


# ---- the new columns in a real row ---------------------------------------------------------------------


def test_prefix_and_load_columns_in_a_real_row(tmp_path: Path) -> None:
    """A replica group of two behind the gateway: the row keeps the blocks the index matched on
    the chosen replica and the serving backend's batch as the router saw it."""
    url = f"sqlite:///{tmp_path}/telemetry-prefix.db"
    telemetry = {"url": url, "auto_upgrade": True, "flush_interval": 0.02}
    system = "You are the support assistant of Example Corp; answer politely. " * 12
    with FakeUpstream(models=(UPSTREAM,)) as fake:
        members = [backend(n, fake, models={PUBLIC: UPSTREAM}, replica_group="pool") for n in ("r0", "r1")]
        affinity = {"block_chars": 64, "min_match_blocks": 4}  # 780 characters: 12 blocks
        with running_gateway(*members, telemetry=telemetry, affinity=affinity) as live:
            gw = Gateway(live, fake, sa.create_engine(url))
            try:
                rows = []
                for text in ("How do I reset my password?", "Where is my parcel?"):
                    rid = f"slo-prefix-{uuid.uuid4().hex}"
                    body = {
                        "model": PUBLIC,
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": text},
                        ],
                    }
                    r = HTTP.post(f"{live.url}/v1/chat/completions", json=body, headers={"x-request-id": rid})
                    assert r.status_code == 200, r.text
                    assert route_of(r)["arm"] == "pool:upstream"
                    rows.append((route_of(r), gw.row(rid)))
            finally:
                gw.db.dispose()
    (_, row1), (route2, row2) = rows
    assert row1["prefix_matched_blocks"] == 0 and row1["load_backend_batch"] == 0
    assert row1["affinity_group"] == "pool"
    # The second conversation found the shared system prompt on the first one's replica.
    assert row2["backend"] == row1["backend"] == route2["affinity"]["chosen"]
    assert row2["prefix_matched_blocks"] == route2["affinity"]["matched_blocks"] >= 12
    assert row2["load_backend_batch"] == 0


def record(backend: str, load: Load, route: RouteDecision | None = None) -> RequestRecord:
    now = time.time()
    return RequestRecord(
        "req-1",
        "chat",
        PUBLIC,
        now - 1.0,
        False,
        backend=backend,
        route=route,
        status=200,
        load=load,
        first_token_time=now - 0.5,
        finished_time=now,
        completion_tokens=11,
    )


def test_the_new_columns_of_an_external_backends_row() -> None:
    route = RouteDecision(
        model=PUBLIC,
        backends=["r0", "r1"],
        spec=None,
        slo={"ttft_ms": 600.0, "tpot_ms": 60.0},
        pools={"r0": "pool:upstream", "r1": "pool:upstream"},
        affinity={"group": "pool", "source": "prefix", "home": "r0", "chosen": "r1", "matched_blocks": 9},
    ).served_by("r1", True)
    scraped = BackendLoad(in_flight=2, num_running=6, num_waiting=3)  # its /metrics: 6 running, 3 queued
    row = request_row(record("r1", Load(backends={"r0": BackendLoad(1), "r1": scraped}), route))
    assert row["load_backend_batch"] == 9 and row["prefix_matched_blocks"] == 9
    assert (row["slo_ttft_ms"], row["slo_tpot_ms"]) == (600.0, 60.0)
    assert row["slo_met"] is True  # 500 ms to the first token, 50 ms for each of ten more
    row = request_row(record("r0", Load(backends={"r0": BackendLoad(2), "r1": scraped})))
    assert row["load_backend_batch"] == 2  # not scraped: the gateway's own count
    assert row["prefix_matched_blocks"] is None and row["slo_met"] is None


def test_the_embedded_engines_batch_is_the_one_the_router_saw() -> None:
    load = Load(LoadSnapshot(num_waiting=3, num_running=5), {"embedded": BackendLoad(1, external=False)})
    assert load.batch_of("embedded") == 8
    assert request_row(record("embedded", load))["load_backend_batch"] == 8
