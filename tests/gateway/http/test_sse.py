"""SSE events: one `data:` line each, whatever the text holds, read back by line readers intact."""

from __future__ import annotations

import json

import httpx
import pytest

from specgate.gateway.http.sse import sse

TRICKY = "a\u2028b\u2029c\x85d\x0be\x1cf é 😀"  # every character str.splitlines breaks on, and more


@pytest.mark.parametrize("extra", [{}, {"n": 2**70}, {"x": float("nan")}])
def test_an_event_is_one_line_for_every_line_reader(extra: dict) -> None:
    # {} takes orjson's path; a 70-bit integer and NaN the standard library's.
    obj = {"choices": [{"delta": {"content": TRICKY}}], **extra}
    event = sse(obj)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    lines = list(httpx.Response(200, content=event).iter_lines())  # httpx splits like splitlines
    assert lines == [event[:-2].decode(), ""]
    decoded = json.loads(lines[0][len("data: ") :])
    assert decoded["choices"][0]["delta"]["content"] == TRICKY
    if "n" in extra:
        assert decoded["n"] == 2**70
    if "x" in extra:
        assert decoded["x"] is None
