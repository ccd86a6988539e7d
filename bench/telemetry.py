"""`specgate bench telemetry`: the telemetry writer's sustained insert rate on SQLite and PostgreSQL.
(bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

from specgate.bench import launch
from specgate.bench.stats import table
from specgate.engine.vocab import LoadSnapshot, SpecParams
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.records import RequestRecord
from specgate.gateway.telemetry.spool import Spool
from specgate.gateway.telemetry.writer import TelemetryWriter
from specgate.policies.load import BackendLoad, Load


def make_record(i: int) -> RequestRecord:
    """A realistic request record: a routed, speculating, streamed (every other) chat request."""
    now, model = time.time(), "SmolLM2-135M-Instruct"
    features = {"prompt_tokens": 300, "code_fraction": 0.8}
    spec_params = SpecParams("ngram", "goodput", 0, 8)
    route = RouteDecision(
        model, ["embedded"], spec_params, reason="bench", features=features, workload_class="code"
    )
    route.served_by("embedded", external=False)
    spec = {"method": "ngram", "num_drafts": 40, "num_draft_tokens": 160, "num_accepted_tokens": 88}
    spec |= {"num_accepted_tokens_per_pos": [30, 25, 18, 15], "mean_acceptance_length": 3.2}
    spec["draft_acceptance_rate"] = 0.55
    load = Load(
        LoadSnapshot(num_running=12, num_waiting=2, kv_cache_usage=0.4), {"embedded": BackendLoad(12)}
    )
    return RequestRecord(
        f"bench-{uuid.uuid4().hex}",
        "chat",
        model,
        now - 0.5,
        stream=i % 2 == 0,
        status=200,
        backend="embedded",
        api_key_id="key-0123456789ab",
        route=route,
        prompt_tokens=300,
        completion_tokens=128,
        first_token_time=now - 0.4,
        finish_reason="length",
        spec_decoding=spec,
        load=load,
        finished_time=now,
    )


def insert_rate(url: str, rows: int, batch_size: int) -> tuple[float, float]:
    schema.upgrade(url)
    records = [make_record(i) for i in range(rows)]
    with tempfile.TemporaryDirectory() as tmp:
        w = TelemetryWriter(schema.make_engine(url), Spool(Path(tmp) / "spool.jsonl"), batch_size=batch_size)
        w.start()
        t0 = time.perf_counter()
        for rec in records:
            w.submit(rec)
        submit_s = time.perf_counter() - t0
        assert w.flush(timeout=600)
        total_s = time.perf_counter() - t0
        w.close()
        assert w.counters.spooled == 0 and w.counters.written == rows
    return rows / total_s, submit_s / rows * 1e6


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--pg-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--no-pg", action="store_true", help="SQLite only")


def run(args: argparse.Namespace) -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(["SQLite (WAL)", *insert_rate(f"sqlite:///{tmp}/bench.db", args.rows, args.batch_size)])
    if not args.no_pg:
        name = f"specgate_bench_{uuid.uuid4().hex[:8]}"
        with launch.postgres_database(args.pg_url.replace("+psycopg", ""), name):
            url = args.pg_url.rsplit("/", 1)[0] + f"/{name}"
            rows.append(["PostgreSQL", *insert_rate(url, args.rows, args.batch_size)])
    cells = [[db, args.rows, args.batch_size, f"{rate:,.0f}", f"{cost:.1f}"] for db, rate, cost in rows]
    head = ["database", "rows", "batch", "rows/s (committed)", "submit cost (us/row)"]
    print("\n".join(table(head, cells)))
    return 0
