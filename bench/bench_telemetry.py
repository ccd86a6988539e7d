"""Sustained insert rate of the telemetry writer on SQLite and PostgreSQL (rows/s).

    python bench/bench_telemetry.py [--rows 20000] [--pg-url postgresql+psycopg://postgres@127.0.0.1/test]

Each run starts from an empty database at head, submits realistic request records as fast as
the producer can, and times until the last row is committed (`flush`). The producer's own cost
per `submit` (what the request path pays) is reported separately.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

from specgate.engine.spec_decode.params import SpecParams
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.records import RequestRecord
from specgate.gateway.telemetry.spool import Spool
from specgate.gateway.telemetry.writer import TelemetryWriter
from specgate.policies.load import BackendLoad, Load


def make_record(i: int) -> RequestRecord:
    now = time.time()
    route = RouteDecision(
        "SmolLM2-135M-Instruct",
        ["embedded"],
        SpecParams("ngram", "goodput", 0, 8),
        reason="bench",
        features={"prompt_tokens": 300, "code_fraction": 0.8},
        workload_class="code",
    )
    route.served_by("embedded", external=False)
    return RequestRecord(
        f"bench-{uuid.uuid4().hex}",
        "chat",
        "SmolLM2-135M-Instruct",
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
        spec_decoding={
            "method": "ngram",
            "num_drafts": 40,
            "num_draft_tokens": 160,
            "num_accepted_tokens": 88,
            "num_accepted_tokens_per_pos": [30, 25, 18, 15],
            "mean_acceptance_length": 3.2,
            "draft_acceptance_rate": 0.55,
        },
        load=Load(
            engine=True, queue_depth=2, running=12, kv_usage=0.4, backends={"embedded": BackendLoad(12)}
        ),
        finished_time=now,
    )


def run(url: str, rows: int, batch_size: int) -> tuple[float, float]:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--pg-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    args = p.parse_args()
    print("| database | rows | batch | rows/s (committed) | submit cost (us/row) |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        rate, cost = run(f"sqlite:///{tmp}/bench.db", args.rows, args.batch_size)
        print(f"| SQLite (WAL) | {args.rows} | {args.batch_size} | {rate:,.0f} | {cost:.1f} |")
    import psycopg

    name = f"specgate_bench_{uuid.uuid4().hex[:8]}"
    admin = args.pg_url.replace("+psycopg", "")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = args.pg_url.rsplit("/", 1)[0] + f"/{name}"
        rate, cost = run(url, args.rows, args.batch_size)
        print(f"| PostgreSQL | {args.rows} | {args.batch_size} | {rate:,.0f} | {cost:.1f} |")
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
