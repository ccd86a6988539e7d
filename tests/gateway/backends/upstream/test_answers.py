"""The pure parts of reading an upstream's answers, on hand-made inputs (the hostile-upstream tests
drive the same code through real HTTP)."""

from __future__ import annotations

import email.utils
import re
import time

import pytest

from specgate.gateway.backends.upstream.answers import (
    MAX_MODELS,
    MAX_RETRY_AFTER,
    Malformed,
    json_object,
    listed_model_ids,
    relayable,
    retry_after_seconds,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2", 2.0),
        ("0.5", 0.5),
        ("-3", 0.0),
        ("1e9", MAX_RETRY_AFTER),
        ("nan", None),
        ("inf", None),
        ("", None),
    ],
)
def test_retry_after_seconds_are_finite_and_capped(value: str, expected: float | None) -> None:
    assert retry_after_seconds(value) == expected


def test_retry_after_may_be_an_http_date() -> None:
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    seconds = retry_after_seconds(later)
    assert seconds is not None and 25 <= seconds <= 31
    assert retry_after_seconds("Mon, 99 Foo 2026 99:99:99 GMT") is None


def test_listed_model_ids_keep_only_names_that_could_be_ours() -> None:
    listing = {
        "data": [{"id": "good"}, {"id": ""}, {"id": "x" * 257}, {"id": "bad\nname"}, {"id": 7}, "junk"]
    }
    assert listed_model_ids(listing) == ["good"]
    assert listed_model_ids({"data": "nope"}) == [] and listed_model_ids([1, 2]) == []
    many = {"data": [{"id": f"m{i}"} for i in range(MAX_MODELS + 10)]}
    assert len(listed_model_ids(many)) == MAX_MODELS


def test_a_whole_body_with_impossible_usage_is_malformed_but_a_stream_chunk_only_loses_the_count() -> None:
    raw = b'{"choices": [], "usage": {"prompt_tokens": -1, "completion_tokens": 3}}'
    with pytest.raises(Malformed, match=r"usage\.prompt_tokens"):
        json_object(raw, "application/json")
    chunk = json_object(raw, "application/json", whole=False)
    assert chunk["usage"] == {"prompt_tokens": None, "completion_tokens": 3}


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"<html>", "not JSON (text/html)"),
        (b"[1, 2]", "not an object"),
        (b'{"choices": {"a": 1}}', "choices"),
        (b'{"usage": 3}', "usage that is not an object"),
        (b'{"a":' * 200 + b"1" + b"}" * 200, "nested deeper"),
    ],
)
def test_bodies_of_the_wrong_shape_are_malformed(raw: bytes, words: str) -> None:
    with pytest.raises(Malformed, match=re.escape(words)):
        json_object(raw, "text/html" if raw.startswith(b"<") else "application/json")


def test_cached_tokens_that_cannot_be_true_are_dropped_not_fatal() -> None:
    body = json_object(
        b'{"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 9}}}', "application/json"
    )
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] is None


def test_an_event_is_relayed_as_it_came_only_when_nothing_in_it_was_changed() -> None:
    assert relayable('{"choices": []}', {"choices": []})
    assert not relayable('{"usage": {}}', {"usage": {}})
    assert not relayable('{"x": NaN}', {"x": None})
    assert not relayable('{"a":\n1}', {"a": 1})
