"""The OpenAI Agents SDK (openai-agents) against the gateway on the default model, through its
Responses model and its chat-completions model: an agent whose `@function_tool` must run, a plain
agent, and one with a pydantic `output_type`. Tracing is off (`set_tracing_disabled`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.gateway.clients.shared import API_KEY, EXTRACT, MAX_TOKENS, MODEL, QUESTION, WEATHER, Person

agents: Any = pytest.importorskip("agents", reason="openai-agents is a dev dependency")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
APIS = ["responses", "chat_completions"]
CITIES: list[str] = []  # the tool's calls


@agents.function_tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    CITIES.append(city)
    return f"It is sunny in {city}."


@pytest.fixture(scope="module", autouse=True)
def _no_tracing() -> Iterator[None]:
    agents.set_tracing_disabled(True)
    yield
    agents.set_default_openai_api("responses")  # the SDK's default, for whoever imports it next


def run(base_url: str, api: str, agent: Any, prompt: str) -> Any:
    async def go() -> Any:
        # A client per run: an AsyncOpenAI belongs to the event loop it first ran on.
        client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_default_openai_api(api)
        try:
            return await agents.Runner.run(agent, prompt, max_turns=3)
        finally:
            await client.close()

    return asyncio.run(go())


@pytest.mark.parametrize("api", APIS)
def test_function_tool_is_called(base_url: str, api: str) -> None:
    """`tool_choice="required"`, one call per turn; the run stops on the tool's output. (Shown the
    tool's result, the 135M model calls the tool again rather than answer: a model limit, so the
    run ends at the first tool instead of looping to max_turns.)"""
    CITIES.clear()
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=MODEL,
        model_settings=agents.ModelSettings(
            temperature=0, max_tokens=64, tool_choice="required", parallel_tool_calls=False
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = run(base_url, api, agent, WEATHER)
    assert len(CITIES) == 1 and CITIES[0]  # the function ran, with a well-formed argument
    assert result.final_output == f"It is sunny in {CITIES[0]}."
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"]


@pytest.mark.parametrize("api", APIS)
def test_plain_and_structured_agents(base_url: str, api: str) -> None:
    settings = agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS)
    plain = run(base_url, api, agents.Agent(name="plain", model=MODEL, model_settings=settings), QUESTION)
    assert isinstance(plain.final_output, str) and plain.final_output
    settings = agents.ModelSettings(temperature=0, max_tokens=64)
    person = agents.Agent(name="person", model=MODEL, model_settings=settings, output_type=Person)
    assert isinstance(run(base_url, api, person, EXTRACT).final_output, Person)
