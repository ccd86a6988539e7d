"""pydantic-ai's `Agent` against the gateway on the default model, through `OpenAIChatModel` (chat
completions) and `OpenAIResponsesModel` (the Responses API) with an `OpenAIProvider` pointed at it:
a plain string, and a pydantic `output_type` by pydantic-ai's default output tool and by
`NativeOutput` (response_format / text.format json_schema)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.clients.shared import API_KEY, EXTRACT, MAX_TOKENS, MODEL, QUESTION, Person

pytest.importorskip("pydantic_ai", reason="pydantic-ai-slim[openai] is a dev dependency")
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODELS = [pytest.param(OpenAIChatModel, id="chat"), pytest.param(OpenAIResponsesModel, id="responses")]


def model_of(kind: Any, base_url: str) -> Any:
    return kind(MODEL, provider=OpenAIProvider(base_url=base_url, api_key=API_KEY))


@pytest.mark.parametrize("kind", MODELS)
def test_plain_string(base_url: str, kind: Any) -> None:
    agent = Agent(model_of(kind, base_url), model_settings={"temperature": 0.0, "max_tokens": MAX_TOKENS})
    result = agent.run_sync(QUESTION)
    assert isinstance(result.output, str) and result.output
    assert result.usage.output_tokens > 0


@pytest.mark.parametrize("native", [pytest.param(False, id="output_tool"), pytest.param(True, id="native")])
@pytest.mark.parametrize("kind", MODELS)
def test_structured_output_type(base_url: str, kind: Any, native: bool) -> None:
    agent = Agent(
        model_of(kind, base_url),
        output_type=NativeOutput(Person) if native else Person,
        model_settings={"temperature": 0.0, "max_tokens": 64},
    )
    assert isinstance(agent.run_sync(EXTRACT).output, Person)
