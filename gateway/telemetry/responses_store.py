"""Stored Responses API responses in the telemetry database (`tables.responses`).

Every call blocks (SQL): the HTTP layer runs them in a thread (`asyncio.to_thread`), never on the
event loop, as it does the dashboard's queries. Ownership is part of every query: a response is
found only with its owner, so another key's id reads as one that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import Engine, delete, insert, select

from specgate.gateway.telemetry.tables import responses as table


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_id: str
    owner: str
    created_at: float
    model: str
    status: str
    previous_response_id: str | None
    input_tokens: int | None
    output_tokens: int | None
    input_items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    response: dict[str, Any]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one starts from: its input, then its output."""
        return [*self.input_items, *self.output_items]


class ResponseStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def save(self, row: StoredResponse) -> None:
        values = {f.name: getattr(row, f.name) for f in fields(StoredResponse)}
        with self.engine.begin() as conn:
            conn.execute(insert(table).values(**values))

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        query = select(table).where(table.c.response_id == response_id, table.c.owner == owner)
        with self.engine.connect() as conn:
            found = conn.execute(query).mappings().first()
        if found is None:
            return None
        return StoredResponse(**{f.name: found[f.name] for f in fields(StoredResponse)})

    def delete(self, response_id: str, owner: str) -> bool:
        query = delete(table).where(table.c.response_id == response_id, table.c.owner == owner)
        with self.engine.begin() as conn:
            return bool(conn.execute(query).rowcount)
