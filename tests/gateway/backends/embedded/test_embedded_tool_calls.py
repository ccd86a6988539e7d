"""The embedded backend turns `<tool_call>` blocks in the model's output into OpenAI `tool_calls`."""

from __future__ import annotations

import json

from specgate.engine.outputs import RequestOutput, RequestStats
from specgate.engine.sampling_params import SamplingParams
from specgate.gateway.backends.base import BackendCall
from specgate.gateway.backends.embedded.chunks import ChunkWriter
from specgate.gateway.backends.embedded.prompt import Prepared
from specgate.gateway.protocol.schemas import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
PIECES = [
    "Let me check.",
    " <tool_",
    'call>{"name": "get_weather",',
    ' "arguments": {"city": "Oslo"}}</tool_call>',
]


def _call(stream: bool) -> tuple[BackendCall, Prepared]:
    req = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "weather?"}],
        tools=TOOLS,
        stream=stream,  # type: ignore[list-item]
        stream_options={"include_usage": True} if stream else None,
    )
    call = BackendCall("r1", "chat", "m", req.model_dump(exclude_unset=True), req, created=0)
    return call, Prepared([1, 2, 3], SamplingParams(max_tokens=50), "chatcmpl-r1", None, tools=True)


def _outputs() -> list[RequestOutput]:
    stats = RequestStats(arrival_ts=0.0, num_prompt_tokens=3, num_output_tokens=len(PIECES))
    return [
        RequestOutput("r1", [i], text, True, "stop", stats)  # the counters: once, with the last
        if i == len(PIECES) - 1
        else RequestOutput("r1", [i], text, False, None)
        for i, text in enumerate(PIECES)
    ]


def test_stream_emits_content_then_tool_call_deltas() -> None:
    call, prep = _call(stream=True)
    writer = ChunkWriter(call, prep, str)
    chunks = []
    for out in _outputs():
        chunks += writer.write(out)
        if out.finished:
            chunks += writer.finish(out)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me check. "  # the tag never leaks into content
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["tool_calls"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(PIECES)


def test_whole_message_has_tool_calls_and_remaining_content() -> None:
    from specgate.gateway.backends.embedded.chunks import chat_message

    msg = chat_message("".join(PIECES), parse_tools=True)
    assert msg["content"] == "Let me check. " and msg["tool_calls"][0]["function"]["name"] == "get_weather"
    only_call = chat_message('<tool_call>{"name": "f"}</tool_call>', True)
    assert only_call["content"] is None and only_call["tool_calls"][0]["function"]["arguments"] == "{}"
    assert chat_message("".join(PIECES), parse_tools=False) == {
        "role": "assistant",
        "content": "".join(PIECES),
    }


def test_a_stream_cut_by_length_keeps_its_complete_tool_calls() -> None:
    """A call that closed before max_tokens cut the answer is still a tool call (as in the body);
    the finish reason stays "length"."""
    call, prep = _call(stream=True)
    writer = ChunkWriter(call, prep, str)
    stats = RequestStats(arrival_ts=0.0, num_prompt_tokens=3, num_output_tokens=2)
    outs = [
        RequestOutput(
            "r1", [0], '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', False, None
        ),
        RequestOutput("r1", [1], "\n<tool_", True, "length", stats),
    ]
    chunks = []
    for out in outs:
        chunks += writer.write(out)
    chunks += writer.finish(outs[-1])
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    finals = [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert finals == ["length"]
