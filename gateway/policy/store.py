"""Policy versions and the telemetry the policy learns from, in the telemetry database.

`SqlPolicyStore` keeps versions in `policy_versions` (one `active`); `MemoryPolicyStore` keeps them
for the life of the process when telemetry is disabled. Both read nothing of the policy's meaning:
a version's artifact is an opaque JSON document here.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any, Protocol

from sqlalchemy import Engine, insert, select, update

from specgate.gateway.policy.lease import Lease, try_lock, try_retrain_lease
from specgate.gateway.telemetry.tables import policy_versions, requests, spec_steps
from specgate.policies.goodput import TrainingRow

Version = dict[str, Any]

MIN_COMPLETION_TOKENS = 4  # shorter answers say more about prefill than about the arm
MAX_STEP_ROWS = 200_000  # the newest measured steps a step cost curve is fitted on


def _utc(value: Any) -> dt.datetime | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return dt.datetime.fromtimestamp(value, tz=dt.UTC)
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


def _public(row: dict[str, Any]) -> Version:
    out = dict(row)
    for key in ("created_at", "promoted_at", "window_start", "window_end"):
        stamp = _utc(out.get(key))
        out[key] = stamp.isoformat() if stamp else None
    return out


class PolicyStore(Protocol):
    def active(self) -> Version | None: ...
    def active_version(self) -> int | None: ...
    def get(self, version: int) -> Version | None: ...
    def recent(self, limit: int) -> list[Version]: ...
    def add(self, values: dict[str, Any]) -> int: ...
    def activate(self, version: int) -> None: ...
    def training_rows(self, since: float) -> list[TrainingRow]: ...
    def step_rows(self, since: float) -> list[tuple[int, float]]:
        """(batch tokens, step ms) of the engine steps of requests since then (spec_steps)."""
        ...

    def retrain_lease(self) -> Lease | None:
        """The right to retrain now, for every gateway on this store (None: another holds it)."""
        ...


class SqlPolicyStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def retrain_lease(self) -> Lease | None:
        return try_retrain_lease(self.engine)

    def active(self) -> Version | None:
        with self.engine.connect() as conn:
            row = (
                conn.execute(
                    select(policy_versions)
                    .where(policy_versions.c.status == "active")
                    .order_by(policy_versions.c.version.desc())
                    .limit(1)
                )
                .mappings()
                .first()
            )
        return _public(dict(row)) if row else None

    def active_version(self) -> int | None:
        """The active version's number alone (cheap enough to ask every few seconds)."""
        t = policy_versions
        with self.engine.connect() as conn:
            version = conn.execute(
                select(t.c.version).where(t.c.status == "active").order_by(t.c.version.desc()).limit(1)
            ).scalar()
        return None if version is None else int(version)

    def get(self, version: int) -> Version | None:
        with self.engine.connect() as conn:
            row = (
                conn.execute(select(policy_versions).where(policy_versions.c.version == version))
                .mappings()
                .first()
            )
        return _public(dict(row)) if row else None

    def recent(self, limit: int) -> list[Version]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(policy_versions).order_by(policy_versions.c.version.desc()).limit(limit)
            ).mappings()
            return [_public(dict(r)) for r in rows]

    def add(self, values: dict[str, Any]) -> int:
        values = {"created_at": dt.datetime.now(dt.UTC), **values}
        for stamp in ("window_start", "window_end", "promoted_at"):
            values[stamp] = _utc(values.get(stamp))
        with self.engine.begin() as conn:
            result = conn.execute(insert(policy_versions).values(**values))
            key = result.inserted_primary_key
            assert key is not None
            return int(key[0])

    def activate(self, version: int) -> None:
        """Make `version` the only active one, in one transaction."""
        t = policy_versions
        with self.engine.begin() as conn:
            conn.execute(
                update(t).where(t.c.status == "active", t.c.version != version).values(status="retired")
            )
            conn.execute(
                update(t)
                .where(t.c.version == version)
                .values(status="active", promoted_at=dt.datetime.now(dt.UTC))
            )

    def step_rows(self, since: float) -> list[tuple[int, float]]:
        s, r = spec_steps.c, requests.c
        query = (
            select(s.batch_tokens, s.step_ms)
            .join(requests, requests.c.request_id == s.request_id)
            .where(r.arrival_time >= _utc(since), s.batch_tokens > 0, s.step_ms > 0)
            .order_by(s.id.desc())
            .limit(MAX_STEP_ROWS)
        )
        with self.engine.connect() as conn:
            return [(int(row.batch_tokens), float(row.step_ms)) for row in conn.execute(query)]

    def training_rows(self, since: float) -> list[TrainingRow]:
        r = requests.c
        query = select(
            r.arrival_time,
            r.route,
            r.features,
            r.workload_class,
            r.tokens_per_s,
            r.tpot_ms,
            r.ttft_ms,
            r.e2e_ms,
            r.stream,
            r.num_draft_tokens,
            r.num_accepted_tokens,
            r.propensity,
        ).where(
            r.outcome == "ok",
            r.arrival_time >= _utc(since),
            r.tokens_per_s > 0,
            r.completion_tokens >= MIN_COMPLETION_TOKENS,
            r.features.is_not(None),
        )
        out = []
        with self.engine.connect() as conn:
            for row in conn.execute(query):
                arm = (row.route or {}).get("arm")
                if not arm or not isinstance(row.features, dict):
                    continue
                stamp = _utc(row.arrival_time)
                ttft, tpot = row.ttft_ms, row.tpot_ms
                if not row.stream and ttft is not None and row.e2e_ms and ttft >= 0.99 * row.e2e_ms:
                    # A whole answer's TTFT equal to its whole time is not a measurement: rows from
                    # before external backends' own timings were read recorded it so (and a TPOT
                    # near 0 with it).
                    ttft = tpot = None
                out.append(
                    TrainingRow(
                        arm,
                        {k: float(v) for k, v in row.features.items() if isinstance(v, (int, float))},
                        float(row.tokens_per_s),
                        tpot,
                        row.workload_class,
                        stamp.timestamp() if stamp else 0.0,
                        row.num_draft_tokens,
                        row.num_accepted_tokens,
                        row.propensity if row.propensity is not None and 0 < row.propensity <= 1 else None,
                        ttft,
                    )
                )
        return out


class MemoryPolicyStore:
    """Versions for a gateway without a telemetry database: kept until the process exits."""

    def __init__(self) -> None:
        self._rows: list[Version] = []
        self._lock = threading.Lock()
        self._retraining = threading.Lock()

    def retrain_lease(self) -> Lease | None:
        return try_lock(self._retraining)

    def active(self) -> Version | None:
        return next((dict(r) for r in reversed(self._rows) if r["status"] == "active"), None)

    def active_version(self) -> int | None:
        row = self.active()
        return None if row is None else int(row["version"])

    def get(self, version: int) -> Version | None:
        return next((dict(r) for r in self._rows if r["version"] == version), None)

    def recent(self, limit: int) -> list[Version]:
        return [dict(r) for r in reversed(self._rows)][:limit]

    def add(self, values: dict[str, Any]) -> int:
        with self._lock:
            version = len(self._rows) + 1
            row: dict[str, Any] = {c.name: None for c in policy_versions.columns}
            row.update(values, version=version, created_at=dt.datetime.now(dt.UTC))
            self._rows.append(_public(row))
            return version

    def activate(self, version: int) -> None:
        with self._lock:
            for row in self._rows:
                if row["version"] == version:
                    row.update(status="active", promoted_at=dt.datetime.now(dt.UTC).isoformat())
                elif row["status"] == "active":
                    row["status"] = "retired"

    def training_rows(self, since: float) -> list[TrainingRow]:
        return []

    def step_rows(self, since: float) -> list[tuple[int, float]]:
        return []
