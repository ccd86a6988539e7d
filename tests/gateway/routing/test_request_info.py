from __future__ import annotations

from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.gateway.routing.request_info import request_info


def test_chat_request_info() -> None:
    req = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
            {"role": "assistant", "content": "Checking."},
            {"role": "user", "content": "And in Bergen?"},
        ],
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "current weather"}}],
        max_completion_tokens=64,
        temperature=0.3,
    )
    info = request_info(req)
    assert info.text == "You are terse.\n\nWeather in Oslo?\n\nAnd in Bergen?"
    assert info.last_user == "And in Bergen?" and info.num_messages == 4
    assert info.tool_names == ["get_weather"] and info.tool_descriptions == ["current weather"]
    assert (info.max_tokens, info.temperature, info.top_p, info.json_mode) == (64, 0.3, 1.0, False)


def test_json_mode_and_forced_tool_choice() -> None:
    msgs = [{"role": "user", "content": "x"}]
    assert request_info(
        ChatCompletionRequest(model="m", messages=msgs, response_format={"type": "json_object"})
    ).json_mode
    forced = ChatCompletionRequest(
        model="m",
        messages=msgs,
        tool_choice="required",
        tools=[{"type": "function", "function": {"name": "f"}}],
    )
    assert request_info(forced).json_mode
    assert not request_info(
        ChatCompletionRequest(model="m", messages=msgs, response_format={"type": "text"})
    ).json_mode


def test_completion_request_info() -> None:
    info = request_info(CompletionRequest(model="m", prompt="def f(x):", max_tokens=8, top_p=0.9))
    assert (info.text, info.max_tokens, info.top_p, info.temperature) == ("def f(x):", 8, 0.9, 1.0)
    ids = request_info(CompletionRequest(model="m", prompt=[1, 2, 3, 4]))
    assert ids.text == "" and ids.approx_prompt_tokens == 4
