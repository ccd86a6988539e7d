"""What the peer arm sends: tools rendered as specgate renders them, the peer's body, and token
counts from a stream that carries no usage (llama-cpp-python's)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from specgate.bench.serve.datasets import BenchRequest
from specgate.bench.serve.options import add_arguments
from specgate.bench.serve.peer_arm import peer_request, settings
from specgate.bench.serve.peer_server import PEER
from specgate.bench.serve.runner import PLAIN, POLICY, send
from tests.bench.serve.test_peer_server import write_gguf

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_tools_go_into_a_system_message_when_the_template_cannot_render_them() -> None:
    req = BenchRequest("tool_call", [{"role": "user", "content": "call f"}], 8, [TOOL])
    out = peer_request(req, chat_template="{{ messages }}")
    assert out.tools is None and out.max_tokens == 8 and out.category == "tool_call"
    assert [m["role"] for m in out.messages] == ["system", "user"]
    assert json.dumps(TOOL["function"], separators=(",", ":")) in out.messages[0]["content"]
    native = peer_request(req, chat_template="{% for t in tools %}{% endfor %}")
    assert native.tools == [TOOL] and native.messages == [{"role": "user", "content": "call f"}]
    plain = BenchRequest("qa", [{"role": "user", "content": "hi"}], 8)
    assert peer_request(plain, None) is plain


def chunk(content: str | None, finish: str | None = None, usage: Any = None) -> Any:
    delta = SimpleNamespace(content=content, tool_calls=None)
    return SimpleNamespace(
        choices=[SimpleNamespace(delta=delta, finish_reason=finish)], usage=usage, model_extra={}
    )


class FakeClient:
    """Streams the given chunks and remembers the request body."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks: list[Any] = chunks
        self.kwargs: dict[str, Any] = {}
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **kwargs: Any) -> AsyncIterator[Any]:
        self.kwargs = kwargs

        async def stream() -> AsyncIterator[Any]:
            for c in self.chunks:
                yield c

        return stream()


def sent(chunks: list[Any], arm: str, extra: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    client = FakeClient(chunks)
    req = BenchRequest("qa", [{"role": "user", "content": "hi"}], 5)
    res = asyncio.run(send(client, "m", req, arm, "r", 0.0, extra))  # type: ignore[arg-type]
    return res, client.kwargs


def test_without_usage_a_length_answer_holds_max_tokens() -> None:
    res, kwargs = sent([chunk("ab"), chunk("c"), chunk(None, "length")], PEER, {"logit_bias": {"2": -100.0}})
    assert res.ok and res.output_tokens == 5  # two chunks, but cut at max_tokens = 5
    assert kwargs["extra_body"] == {"logit_bias": {"2": -100.0}}  # no specgate `spec` for the peer
    assert kwargs["extra_headers"] == {}  # llama-cpp-python refuses ids that are not UUIDs
    res, _ = sent([chunk("a"), chunk("b"), chunk(None, "stop")], PEER, None)
    assert res.output_tokens == 2


def test_usage_wins_and_specgate_arms_merge_their_spec_with_extra() -> None:
    usage = SimpleNamespace(completion_tokens=3, prompt_tokens=7)
    res, kwargs = sent([chunk("a", "length"), chunk(None, None, usage)], PLAIN, {"ignore_eos": True})
    assert res.output_tokens == 3 and res.prompt_tokens == 7
    assert kwargs["extra_body"] == {"spec": {"method": "off"}, "ignore_eos": True}
    assert kwargs["extra_headers"] == {"x-request-id": "r"}


def test_settings_from_the_command_line(tmp_path: Path) -> None:
    gguf = write_gguf(tmp_path / "m.gguf")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", str(gguf), "--peer", "llama-cpp", "--ignore-eos"])
    peer = settings(args)
    assert peer["arm"] == PEER and peer["gguf"] == str(gguf) and peer["threads"] == os.cpu_count()
    assert peer["command"][peer["command"].index("--model") + 1] == str(gguf)
    assert peer["url"].endswith(peer["command"][peer["command"].index("--port") + 1])
    assert peer["body"]["logit_bias"] == {"0": -100.0, "2": -100.0}
    args = p.parse_args(["--model", str(gguf), "--peer", "llama-cpp", "--no-ignore-eos", "--threads", "1"])
    peer = settings(args)
    assert "logit_bias" not in peer["body"] and peer["threads"] == 1


def test_each_specgate_arm_gets_a_prefix_cache_of_its_own_and_the_peer_none() -> None:
    """An arm measured after another must not find the same prompts cached (the peer starts cold)."""
    client = FakeClient([chunk("a", "stop")])
    req = BenchRequest("qa", [{"role": "user", "content": "hi"}], 5)
    for arm, body in (
        (POLICY, {"cache_salt": "run-policy-c1"}),
        (PLAIN, {"cache_salt": "run-plain-c1", "spec": {"method": "off"}}),
        (PEER, None),
    ):
        asyncio.run(send(client, "m", req, arm, "r", 0.0, None, f"run-{arm}-c1"))  # type: ignore[arg-type]
        assert client.kwargs["extra_body"] == body, arm
