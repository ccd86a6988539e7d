"""LiteLLM as a client of the gateway on the default model (`openai/<model>` with `api_base`):
completion, streamed completion, a pydantic `response_format`, and `litellm.responses`, streamed
or not. Its telemetry is off and its model price list is the one in its wheel (no download)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.gateway.clients.shared import API_KEY, EXTRACT, MAX_TOKENS, MODEL, QUESTION, Person

# Before the import: otherwise LiteLLM fetches its model cost map from GitHub when it loads.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
litellm: Any = pytest.importorskip("litellm", reason="litellm is a dev dependency")
litellm.telemetry = False

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    # LiteLLM's own noise: its TypedDicts under pydantic, and its usage model on a Responses answer.
    pytest.mark.filterwarnings("ignore:.*ReadOnly. qualifier:UserWarning"),
    pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning"),
]


def target(base_url: str) -> dict[str, Any]:
    return {"model": f"openai/{MODEL}", "api_base": base_url, "api_key": API_KEY, "temperature": 0}


def test_completion_and_stream(base_url: str) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    r = litellm.completion(messages=messages, max_tokens=MAX_TOKENS, **target(base_url))
    assert isinstance(r, litellm.ModelResponse) and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    chunks = list(
        litellm.completion(messages=messages, max_tokens=MAX_TOKENS, stream=True, **target(base_url))
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_completion_with_a_pydantic_response_format(base_url: str) -> None:
    r = litellm.completion(
        messages=[{"role": "user", "content": EXTRACT}],
        response_format=Person,
        max_tokens=64,
        **target(base_url),
    )
    assert isinstance(Person.model_validate_json(r.choices[0].message.content), Person)


@pytest.mark.skipif(not hasattr(litellm, "responses"), reason="this LiteLLM has no responses()")
def test_responses_and_stream(base_url: str) -> None:
    r = litellm.responses(input=QUESTION, max_output_tokens=MAX_TOKENS, **target(base_url))
    assert r.status == "completed"
    text = "".join(p.text for item in r.output if item.type == "message" for p in item.content)
    assert text
    events = list(
        litellm.responses(input=QUESTION, max_output_tokens=MAX_TOKENS, stream=True, **target(base_url))
    )
    kinds = [str(getattr(e.type, "value", e.type)) for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = [
        e.delta for e in events if str(getattr(e.type, "value", e.type)) == "response.output_text.delta"
    ]
    assert "".join(deltas) == text
