"""Stored responses on SQLite and PostgreSQL: saved whole, found only by their owner, deleted once."""

from __future__ import annotations

import pytest

from specgate.gateway.telemetry import responses_store, schema
from specgate.gateway.telemetry.responses_store import ResponseStore, StoredResponse

ITEMS = [
    {
        "type": "message",
        "role": "user",
        "id": "msg_1",
        "content": [{"type": "input_text", "text": "hé \u2028 \\u0000"}],
    }
]
OUTPUT = [
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "f",
        "arguments": "{}",
        "status": "completed",
    }
]


def _row(response_id: str, owner: str) -> StoredResponse:
    return StoredResponse(
        response_id=response_id,
        owner=owner,
        created_at=1.5,
        model="m",
        status="completed",
        previous_response_id=None,
        input_tokens=3,
        output_tokens=4,
        input_items=ITEMS,
        output_items=OUTPUT,
        response={"id": response_id, "object": "response", "output": OUTPUT, "metadata": {"k": "v"}},
    )


def test_save_get_delete_by_owner(db_url: str) -> None:
    schema.upgrade(db_url)
    engine = schema.make_engine(db_url)
    try:
        store = ResponseStore(engine)
        store.save(_row("resp_a", "key-a"))
        found = store.get("resp_a", "key-a")
        assert found == _row("resp_a", "key-a")
        assert found.conversation == [*ITEMS, *OUTPUT]
        assert store.get("resp_a", "key-b") is None  # another owner: as if it did not exist
        assert store.get("resp_missing", "key-a") is None
        assert not store.delete("resp_a", "key-b")
        assert store.get("resp_a", "key-a") is not None
        assert store.delete("resp_a", "key-a")
        assert not store.delete("resp_a", "key-a")
        assert store.get("resp_a", "key-a") is None
    finally:
        engine.dispose()


def test_put_is_written_behind_and_readable_at_once(db_url: str) -> None:
    schema.upgrade(db_url)
    engine = schema.make_engine(db_url)
    store = ResponseStore(engine)
    try:
        for i in range(50):
            store.put(_row(f"resp_{i}", "key-a"))
        assert store.get("resp_7", "key-a") == _row("resp_7", "key-a")  # queued or written: found
        assert store.get("resp_7", "key-b") is None
        assert store.flush()
        other = ResponseStore(engine)  # another worker's view: the database alone
        assert other.get("resp_49", "key-a") == _row("resp_49", "key-a")
        assert store.delete("resp_3", "key-a") and other.get("resp_3", "key-a") is None
    finally:
        store.close()
        engine.dispose()


def test_a_refusing_database_keeps_the_queue(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows the database refuses stay readable and are written once it takes them again; a queue
    at MAX_QUEUED refuses new responses (the route answers 503) instead of growing without end."""
    schema.upgrade(sqlite_url)
    engine = schema.make_engine(sqlite_url)
    store = ResponseStore(engine)
    failing = {"on": True}
    real_begin = engine.begin

    def begin():  # type: ignore[no-untyped-def]
        if failing["on"]:
            raise OSError("database down")
        return real_begin()

    monkeypatch.setattr(responses_store, "RETRY_SECONDS", (0.01,))
    monkeypatch.setattr(responses_store, "MAX_QUEUED", 5)
    monkeypatch.setattr(engine, "begin", begin)
    try:
        for i in range(5):
            store.put(_row(f"resp_{i}", "k"))
        assert store.backlogged
        with pytest.raises(RuntimeError, match="full"):
            store.put(_row("resp_x", "k"))
        assert not store.flush(timeout=0.2)
        assert store.get("resp_4", "k") is not None  # still readable from the queue
        failing["on"] = False
        assert store.flush(timeout=5)
        assert ResponseStore(engine).get("resp_4", "k") is not None and not store.backlogged
    finally:
        store.close()
        engine.dispose()
