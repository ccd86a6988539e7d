"""What one request sends and records: an arm's `spec` extension, the body of specgate's arms and of
a peer's, token counts from a stream without usage (llama-cpp-python's), the per-request timings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from specgate.bench.client import PEER, PLAIN, POLICY, RequestResult, arm_body, send, spec_of
from specgate.bench.workload import BenchRequest
from specgate.gateway.protocol.schemas import SpecRequest


def test_plain_and_methods_force_the_method_alone() -> None:
    assert spec_of("plain") == {"method": "off"}
    assert spec_of("ngram") == {"method": "ngram"}
    assert arm_body(POLICY) is None
    assert arm_body("suffix", cache_salt="s") == {"cache_salt": "s", "spec": {"method": "suffix"}}


def test_a_fixed_chain_is_a_static_k_without_trees_that_the_gateway_accepts() -> None:
    spec = spec_of("ngram:k3")
    fixed = {"controller": "static", "num_speculative_tokens": 3, "max_tree_nodes": 0}
    assert spec == {"method": "ngram", **fixed}
    parsed = SpecRequest.model_validate(spec)
    assert (parsed.controller, parsed.num_speculative_tokens, parsed.max_tree_nodes) == ("static", 3, 0)


@pytest.mark.parametrize("arm", ["ngram:3", "ngram:k0", "ngram:k", "ngram:kx", "ngram:k-1"])
def test_a_malformed_fixed_chain_is_refused(arm: str) -> None:
    with pytest.raises(ValueError, match="METHOD:kN"):
        spec_of(arm)


def test_per_request_timings() -> None:
    r = RequestResult("a", "code", "ngram", 10.0, ok=True, output_tokens=5, chunk_times=[10.2, 10.3, 10.5])
    r.done_at = 10.6
    assert r.ttft == pytest.approx(0.2) and r.e2e == pytest.approx(0.6)
    assert r.tpot == pytest.approx((0.6 - 0.2) / 4)  # chunks may carry several tokens: TPOT uses tokens
    assert r.itls == pytest.approx([0.1, 0.2])


def chunk(content: str | None, finish: str | None = None, usage: Any = None, metrics: Any = None) -> Any:
    delta = SimpleNamespace(content=content, tool_calls=None)
    extra = {"metrics": metrics} if metrics else {}
    return SimpleNamespace(
        choices=[SimpleNamespace(delta=delta, finish_reason=finish)], usage=usage, model_extra=extra
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
    assert res.ok and res.output_tokens == 5 and res.text == "abc"  # two chunks, but cut at max_tokens
    assert kwargs["extra_body"] == {"logit_bias": {"2": -100.0}}  # no specgate `spec` for the peer
    assert kwargs["extra_headers"] == {}  # llama-cpp-python refuses ids that are not UUIDs
    res, _ = sent([chunk("a"), chunk("b"), chunk(None, "stop")], PEER, None)
    assert res.output_tokens == 2 and res.finish == "stop"


def test_usage_and_metrics_win_and_specgate_arms_merge_their_spec_with_extra() -> None:
    details = SimpleNamespace(cached_tokens=4)
    usage = SimpleNamespace(completion_tokens=3, prompt_tokens=7, prompt_tokens_details=details)
    metrics = {"spec_decoding": {"num_drafts": 2}, "route": {"backend": "b"}, "num_steps": 3}
    res, kwargs = sent([chunk("a", "length"), chunk(None, None, usage, metrics)], PLAIN, {"ignore_eos": True})
    assert (res.output_tokens, res.prompt_tokens, res.cached_tokens) == (3, 7, 4)
    assert res.spec == {"num_drafts": 2} and res.route == {"backend": "b"} and res.steps == 3
    assert kwargs["extra_body"] == {"spec": {"method": "off"}, "ignore_eos": True}
    assert kwargs["extra_headers"] == {"x-request-id": "r"}


def test_each_specgate_arm_gets_a_prefix_cache_of_its_own_and_the_peer_none() -> None:
    """An arm measured after another must not find the same prompts cached (the peer starts cold);
    a request's own body fields go with it."""
    client = FakeClient([chunk("a", "stop")])
    req = BenchRequest("qa", [{"role": "user", "content": "hi"}], 5, extra={"response_format": {"type": "x"}})
    for arm, body in (
        (POLICY, {"cache_salt": "run-policy-c1"}),
        (PLAIN, {"cache_salt": "run-plain-c1", "spec": {"method": "off"}}),
        (PEER, {}),
    ):
        asyncio.run(send(client, "m", req, arm, "r", 0.0, None, f"run-{arm}-c1"))  # type: ignore[arg-type]
        assert client.kwargs["extra_body"] == {**body, "response_format": {"type": "x"}}, arm
