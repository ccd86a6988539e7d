"""Stored responses on SQLite and PostgreSQL: saved whole, found only by their owner, deleted once."""

from __future__ import annotations

from specgate.gateway.telemetry import schema
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
