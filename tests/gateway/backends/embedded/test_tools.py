"""Hermes-style tool calls: prompting a template without tool support, and parsing calls back."""

from __future__ import annotations

import json

import pytest

from specgate.gateway.backends.embedded.chat_template import normalize_messages
from specgate.gateway.backends.embedded.tools import ToolCallParser, template_supports_tools
from specgate.gateway.protocol.schemas import ChatMessage

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _feed_all(parser: ToolCallParser, pieces: list[str]) -> str:
    return "".join(parser.feed(p) for p in pieces)


@pytest.mark.parametrize("split", [1, 3, 7, 100])
def test_parser_splits_content_and_calls_however_the_text_arrives(split: int) -> None:
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> done'
    parser = ToolCallParser()
    shown = _feed_all(parser, [text[i : i + split] for i in range(0, len(text), split)])
    rest, calls = parser.finish()
    assert shown + rest == "Sure.  done"
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_parser_holds_back_only_a_possible_tag_start() -> None:
    parser = ToolCallParser()
    assert parser.feed("a <tool") == "a "
    assert parser.feed("box>") == "<toolbox>"
    assert parser.finish() == ("", [])


def test_bad_or_unclosed_blocks_stay_content() -> None:
    parser = ToolCallParser()
    parser.feed('<tool_call>not json</tool_call><tool_call>{"name": "f"')
    rest, calls = parser.finish()
    assert calls == [] and rest == '<tool_call>not json</tool_call><tool_call>{"name": "f"'


def test_several_calls() -> None:
    parser = ToolCallParser()
    parser.feed(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    )
    rest, calls = parser.finish()
    assert [c["function"]["name"] for c in calls] == ["a", "b"] and rest == ""
    assert calls[1]["function"]["arguments"] == "{}"


class _Tok:
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_template_without_tools_gets_a_system_prompt_and_text_calls() -> None:
    assert not template_supports_tools(_Tok.chat_template) and template_supports_tools("{{ tools }}")
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        ChatMessage(role="developer", content="be nice"),
        ChatMessage(role="user", content=[{"type": "text", "text": "weather?"}]),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", tool_call_id="c1", content="rain"),
    ]
    out, tools = normalize_messages(_Tok(), messages, TOOLS, "required")
    assert tools is None  # rendered into the system message instead
    assert out[0]["role"] == "system" and out[0]["content"].startswith("be nice")
    assert "get_weather" in out[0]["content"] and "must call" in out[0]["content"]
    assert out[1]["content"] == "weather?"
    assert (
        out[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    none, _ = normalize_messages(_Tok(), messages, TOOLS, "none")
    assert none[0]["content"] == "be nice"


def test_whitespace_around_tool_calls_is_not_content() -> None:
    """Parallel calls come one a line: the newlines between them (streamed apart from the blocks)
    are the format's, while text before a call keeps its spaces."""
    from specgate.gateway.backends.embedded.tools import ToolCallParser

    parser = ToolCallParser()
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    shown = "".join(parser.feed(piece) for piece in ["\n", call, "\n", "\n", call, "\n"])
    rest, calls = parser.finish()
    assert shown + rest == "" and len(calls) == 2
    parser = ToolCallParser()
    shown = "".join(parser.feed(piece) for piece in ["Let me check. ", call, " Done."])
    rest, calls = parser.finish()
    assert shown + rest == "Let me check.  Done." and len(calls) == 1
    parser = ToolCallParser()
    assert parser.feed("\n\n") == ""  # it may still turn out to precede a call
    assert parser.feed("plain text \n") == "\n\nplain text \n"
    assert parser.finish() == ("", [])
