"""Database URLs, engines and schema versions of the telemetry store (Alembic underneath).

The embedded default (a SQLite file in the user's data directory) is upgraded automatically at
start; any other database is never migrated behind the operator's back: an outdated schema stops
the gateway with a message naming the command to run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from platformdirs import user_data_dir
from sqlalchemy import Engine, create_engine, event

from specgate.gateway.keyring import private_dir, private_file


class SchemaOutdatedError(RuntimeError):
    pass


def default_data_dir() -> Path:
    return Path(os.environ.get("SPECGATE_DATA_DIR") or user_data_dir("specgate"))


def default_url() -> str:
    return f"sqlite:///{default_data_dir() / 'telemetry.db'}"


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def make_engine(
    url: str, *, connect_timeout: float | None = None, statement_timeout: float | None = None, **kwargs: Any
) -> Engine:
    """An engine for `url`. PostgreSQL gets connect and statement timeouts, so a database that hangs
    costs the writer seconds, not forever (the rows spool meanwhile)."""
    if is_sqlite(url):
        path = url.split("///", 1)[-1].split("?", 1)[0]
        if path and path != ":memory:" and not path.startswith("file:"):
            private_sqlite(Path(path))
        engine = create_engine(url, connect_args={"timeout": 30}, **kwargs)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            # WAL: readers never block the writer, and several writers queue on the lock.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    connect_args: dict[str, Any] = {}
    if url.startswith("postgresql"):
        if connect_timeout is not None:
            connect_args["connect_timeout"] = max(1, round(connect_timeout))
        if statement_timeout is not None:
            connect_args["options"] = f"-c statement_timeout={round(statement_timeout * 1000)}"
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args, pool_timeout=30, **kwargs)


def private_sqlite(db: Path) -> None:
    """The database file and its WAL and shared-memory files readable by their owner only (SQLite
    gives the -wal and -shm files the database file's mode), in a directory made 0700 (ours:
    the default data directory is tightened too, a folder the operator chose is not)."""
    private_dir(db.parent, tighten=db.parent == default_data_dir())
    private_file(db)
    for suffix in ("-wal", "-shm", "-journal"):
        side = db.with_name(db.name + suffix)
        if side.exists():
            private_file(side)


def alembic_config(url: str) -> Config:
    import specgate.migrations as migrations

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision(url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def ensure_schema(engine: Engine, url: str, auto_upgrade: bool) -> None:
    """Upgrade (embedded default) or refuse to run on a schema that is not at head."""
    head = head_revision(url)
    current = current_revision(engine)
    if current == head:
        return
    if auto_upgrade:
        upgrade(url)
        return
    raise SchemaOutdatedError(
        f"the telemetry database is at revision {current or 'none (empty)'}, this specgate needs {head}; "
        f"run `specgate db upgrade --url <URL>` (or set telemetry.auto_upgrade) and start again"
    )
