"""Alembic: empty -> head -> base -> head on SQLite and PostgreSQL, with no drift from the metadata."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.tables import metadata

VIEWS = {"v_acceptance_by_class", "v_route_performance", "v_recent_errors"}


def _tables(url: str) -> tuple[set[str], set[str]]:
    engine = schema.make_engine(url)
    try:
        insp = inspect(engine)
        return set(insp.get_table_names()), set(insp.get_view_names())
    finally:
        engine.dispose()


def _columns(url: str, table: str) -> set[str]:
    engine = schema.make_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def _insert_request(url: str, **values: object) -> None:
    """One minimal request row, written with plain SQL (the metadata is at head, the table may not be)."""
    arrival = "arrival_time" if "arrival_time" in _columns(url, "requests") else "received_at"  # < 0009
    row = {
        "request_id": "r-0005",
        "endpoint": "chat",
        "model": "m",
        "stream": False,
        arrival: dt.datetime.now(dt.UTC),
        "status": 200,
        "outcome": "ok",
        "cancelled": False,
        **values,
    }
    engine = schema.make_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO requests ({', '.join(row)}) VALUES (:{', :'.join(row)})"), row)
    engine.dispose()


def _select(url: str, sql: str) -> list[object]:
    engine = schema.make_engine(url)
    with engine.connect() as conn:
        out = [r[0] for r in conn.execute(text(sql))]
    engine.dispose()
    return out


def _delete_requests(url: str) -> None:
    engine = schema.make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM requests"))
    engine.dispose()


def _request_ids(url: str) -> list[object]:
    return _select(url, "SELECT request_id FROM requests")


def _cached_tokens(url: str) -> list[object]:
    return _select(url, "SELECT cached_tokens FROM requests")


def test_one_head() -> None:
    """Revisions form one chain: each new one is chained on the head before it."""
    from alembic.script import ScriptDirectory

    heads = ScriptDirectory.from_config(schema.alembic_config("sqlite://")).get_heads()
    assert heads == ["0012"]


@pytest.mark.slow
def test_upgrade_downgrade_upgrade(db_url: str) -> None:
    engine = schema.make_engine(db_url)
    assert schema.current_revision(engine) is None
    schema.upgrade(db_url)
    assert schema.current_revision(engine) == schema.head_revision(db_url) == "0012"
    tables, views = _tables(db_url)
    assert {
        "requests",
        "spec_steps",
        "policy_versions",
        "telemetry_quarantine",
        "dashboard_revocations",
        "alembic_version",
    } <= tables
    assert views == VIEWS
    schema.downgrade(db_url, "base")
    assert schema.current_revision(engine) is None
    tables, views = _tables(db_url)
    assert tables <= {"alembic_version"} and views == set()
    schema.upgrade(db_url)
    assert schema.current_revision(engine) == "0012"
    # One step down removes the stored responses, nothing else.
    schema.downgrade(db_url, "0011")
    assert "responses" not in _tables(db_url)[0] and _tables(db_url)[1] == VIEWS
    schema.upgrade(db_url)
    assert "responses" in _tables(db_url)[0]
    # One step down gives the timing columns their old names back, indexes and view included; a
    # row written at head keeps its values both ways.
    timings = {"arrival_time", "first_token_time", "finished_time", "queue_time_ms"}
    _insert_request(db_url, first_token_time=dt.datetime.now(dt.UTC), queue_time_ms=12.5)
    schema.downgrade(db_url, "0008")
    columns = _columns(db_url, "requests")
    assert not timings & columns and {"received_at", "first_token_at", "finished_at", "queue_ms"} <= columns
    assert _tables(db_url)[1] == VIEWS and _select(db_url, "SELECT queue_ms FROM requests") == [12.5]
    assert _select(db_url, "SELECT count(*) FROM v_recent_errors") == [0]
    schema.upgrade(db_url)
    assert timings <= _columns(db_url, "requests")
    assert _select(db_url, "SELECT queue_time_ms FROM requests") == [12.5]
    # The next removes the sign-out table, nothing else; request rows survive it.
    schema.downgrade(db_url, "0007")
    assert "dashboard_revocations" not in _tables(db_url)[0] and _request_ids(db_url) == ["r-0005"]
    _delete_requests(db_url)
    schema.upgrade(db_url)
    assert "dashboard_revocations" in _tables(db_url)[0]
    schema.downgrade(db_url, "0007")
    # One step down removes the affinity columns, nothing else; rows written at 0007 survive it.
    affinity = {"affinity_group", "affinity_source", "affinity_hit", "propensity"}
    _insert_request(db_url, affinity_group="g", affinity_source="user", affinity_hit=True, propensity=0.5)
    schema.downgrade(db_url, "0006")
    assert not affinity & _columns(db_url, "requests") and _tables(db_url)[1] == VIEWS
    assert _request_ids(db_url) == ["r-0005"]
    schema.upgrade(db_url)
    assert affinity <= _columns(db_url, "requests")
    assert _select(db_url, "SELECT affinity_hit FROM requests") == [None]
    _delete_requests(db_url)
    # The next removes the draft-tree columns, nothing else; rows written at 0006 survive it.
    _insert_request(db_url, num_tree_drafts=3, mean_draft_nodes=5.5)
    schema.downgrade(db_url, "0005")
    assert not {"num_tree_drafts", "mean_draft_nodes"} & _columns(db_url, "requests")
    assert "depth" not in _columns(db_url, "spec_steps") and _tables(db_url)[1] == VIEWS
    assert _request_ids(db_url) == ["r-0005"]
    schema.upgrade(db_url)
    assert {"num_tree_drafts", "mean_draft_nodes"} <= _columns(db_url, "requests")
    assert "depth" in _columns(db_url, "spec_steps")
    assert _select(db_url, "SELECT num_tree_drafts FROM requests") == [None]
    _delete_requests(db_url)
    # The next removes the cached-token column, nothing else; rows written at 0005 survive it.
    _insert_request(db_url, cached_tokens=7)
    schema.downgrade(db_url, "0004")
    assert "cached_tokens" not in _columns(db_url, "requests") and _tables(db_url)[1] == VIEWS
    assert _request_ids(db_url) == ["r-0005"]
    schema.upgrade(db_url)
    assert "cached_tokens" in _columns(db_url, "requests")
    assert _cached_tokens(db_url) == [None]  # what the downgrade dropped does not come back
    # The next gives the speculation columns their old names back, views included.
    schema.downgrade(db_url, "0003")
    columns = _columns(db_url, "requests")
    assert {"num_spec_steps", "num_accepted_draft_tokens", "acceptance_histogram"} <= columns
    assert "num_drafts" not in columns and _tables(db_url)[1] == VIEWS
    schema.upgrade(db_url)
    assert {"num_drafts", "num_accepted_tokens", "num_accepted_tokens_per_pos"} <= _columns(
        db_url, "requests"
    )
    # The next removes the quarantine table and the client id column, nothing else.
    schema.downgrade(db_url, "0002")
    tables, views = _tables(db_url)
    assert "telemetry_quarantine" not in tables and {"requests", "policy_versions"} <= tables
    assert "client_request_id" not in _columns(db_url, "requests") and views == VIEWS
    schema.upgrade(db_url)
    assert "client_request_id" in _columns(db_url, "requests")
    # One more down removes only the policy table; the request telemetry stays.
    schema.downgrade(db_url, "0001")
    tables, views = _tables(db_url)
    assert "policy_versions" not in tables and {"requests", "spec_steps"} <= tables and views == VIEWS
    schema.upgrade(db_url)
    assert schema.current_revision(engine) == "0012"
    engine.dispose()


def test_0008_replaces_bare_key_hashes_with_labels_that_group_but_reveal_nothing(db_url: str) -> None:
    import hashlib

    schema.upgrade(db_url, "0007")
    bare = {k: "key-" + hashlib.sha256(k.encode()).hexdigest()[:12] for k in ("sk-a", "sk-b")}
    for i, key in enumerate(("sk-a", "sk-a", "sk-b")):
        _insert_request(db_url, request_id=f"r{i}", api_key_id=bare[key])
    _insert_request(db_url, request_id="r-open", api_key_id=None)
    schema.upgrade(db_url)
    ids = dict(
        zip(
            _select(db_url, "SELECT request_id FROM requests ORDER BY request_id"),
            _select(db_url, "SELECT api_key_id FROM requests ORDER BY request_id"),
            strict=True,
        )
    )
    assert ids["r-open"] is None
    assert ids["r0"] == ids["r1"] != ids["r2"]  # one key's rows still group together
    for rid in ("r0", "r2"):
        label = str(ids[rid])
        assert label.startswith("legacy-") and label not in bare.values()
        assert not any(h[4:] in label for h in bare.values())


def test_no_drift_between_models_and_migrations(db_url: str) -> None:
    schema.upgrade(db_url)
    engine = schema.make_engine(db_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(ctx, metadata)
    engine.dispose()
    assert diff == []


def test_views_answer_on_an_empty_database(db_url: str) -> None:
    schema.upgrade(db_url)
    engine = schema.make_engine(db_url)
    with engine.connect() as conn:
        for view in VIEWS:
            assert conn.execute(text(f"SELECT * FROM {view}")).fetchall() == []
    engine.dispose()


def test_ensure_schema_upgrades_only_when_allowed(pg_url: str, sqlite_url: str) -> None:
    import pytest

    pg = schema.make_engine(pg_url)
    with pytest.raises(schema.SchemaOutdatedError, match="specgate db upgrade"):
        schema.ensure_schema(pg, pg_url, auto_upgrade=False)
    assert schema.current_revision(pg) is None  # never migrated behind the operator's back
    pg.dispose()
    lite = schema.make_engine(sqlite_url)
    schema.ensure_schema(lite, sqlite_url, auto_upgrade=True)
    assert schema.current_revision(lite) == "0012"
    lite.dispose()


@pytest.mark.slow
def test_db_command_and_plain_alembic(pg_url: str, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    run = [sys.executable, "-m", "specgate.gateway.cli.main", "db"]
    out = subprocess.run([*run, "upgrade", "--url", pg_url], capture_output=True, text=True, check=True)
    assert "current: 0012" in out.stdout
    out = subprocess.run(
        [*run, "downgrade", "base", "--url", pg_url], capture_output=True, text=True, check=True
    )
    assert "current: none" in out.stdout
    # The repository's alembic.ini works with the alembic command itself.
    alembic = [sys.executable, "-m", "alembic", "-x", f"url={pg_url}"]
    subprocess.run([*alembic, "upgrade", "head"], cwd=root, check=True, capture_output=True)
    out = subprocess.run([*alembic, "current"], cwd=root, check=True, capture_output=True, text=True)
    assert "0012 (head)" in out.stdout
