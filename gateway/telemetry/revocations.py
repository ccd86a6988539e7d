"""Signed-out dashboard sessions in the telemetry database, so that a sign-out holds everywhere.

A session cookie cannot be recalled: until it expires, only a list of refused session ids stops it.
Kept in process memory (and shared memory for `--workers N`) that list dies with the gateway and
never reaches another replica; kept here, every worker, replica and restart reads the same one.
Calls block (SQL): the HTTP layer runs them in a thread, never on the event loop.
"""

from __future__ import annotations

import time

from sqlalchemy import Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from specgate.gateway.telemetry.tables import dashboard_revocations as table


class SessionRevocations:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def add(self, session_id: str, expires_at: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for attempt in range(2):
            try:
                self._add(session_id, expires_at, now)
                return
            except IntegrityError:  # the same session signed out at once elsewhere (two tabs)
                if attempt:
                    raise

    def _add(self, session_id: str, expires_at: float, now: float) -> None:
        with self.engine.begin() as conn:
            # Expired entries refuse nothing any more: each sign-out sweeps them away.
            conn.execute(delete(table).where(table.c.expires_at <= now))
            known = conn.execute(select(table.c.expires_at).where(table.c.session_id == session_id)).first()
            if known is None:
                conn.execute(
                    insert(table).values(session_id=session_id, revoked_at=now, expires_at=expires_at)
                )
            elif known[0] < expires_at:
                conn.execute(
                    update(table).where(table.c.session_id == session_id).values(expires_at=expires_at)
                )

    def revoked(self, session_id: str, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        query = select(table.c.session_id).where(table.c.session_id == session_id, table.c.expires_at > now)
        with self.engine.connect() as conn:
            return conn.execute(query).first() is not None
