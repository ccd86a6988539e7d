"""Sending requests: the official `openai` async client, streaming, timing every chunk; closed and
open loops of them. An arm is how requests ask to be served: "policy" leaves it to the gateway's
router; "plain", a method, or "METHOD:kN" (a fixed chain of N drafts, static controller, no trees)
force it through specgate's `spec` extension. PEER (llama.cpp) gets no `spec`, cache_salt nor id.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

from specgate.bench.workload import BenchRequest, user

POLICY, PLAIN, PEER = "policy", "plain", "llama.cpp"


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times are perf_counter seconds."""

    request_id: str
    category: str
    arm: str
    sent_at: float
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    done_at: float | None = None
    text: str = ""
    finish: str | None = None
    spec: dict[str, Any] = field(default_factory=dict)  # metrics.spec_decoding from the gateway
    route: dict[str, Any] = field(default_factory=dict)  # metrics.route
    steps: int | None = None  # metrics.num_steps: the engine's forward passes for this request

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1): a chunk may carry several tokens."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def goodput(self) -> float:
        """Output tokens per second from send to the end (0 for a request that did not end)."""
        return self.output_tokens / self.e2e if self.e2e else 0.0

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def spec_of(arm: str) -> dict[str, Any]:
    """The `spec` extension that forces an arm ("plain", a method, or "METHOD:kN")."""
    if arm == PLAIN:
        return {"method": "off"}
    method, _, fixed = arm.partition(":")
    if not fixed:
        return {"method": method}
    if not (fixed.startswith("k") and fixed[1:].isdigit() and int(fixed[1:]) > 0):
        raise ValueError(f"arm {arm!r}: a fixed chain is METHOD:kN with N > 0")
    k = int(fixed[1:])
    return {"method": method, "controller": "static", "num_speculative_tokens": k, "max_tree_nodes": 0}


def arm_body(arm: str, cache_salt: str | None = None) -> dict[str, Any] | None:
    """specgate's extension fields for an arm; `cache_salt` gives the arm a prefix cache of its own, so
    that an arm measured after another does not find the same prompts already cached."""
    if arm == PEER:
        return None
    body: dict[str, Any] = {} if cache_salt is None else {"cache_salt": cache_salt}
    if arm != POLICY:
        body["spec"] = spec_of(arm)
    return body or None


async def send(
    client: openai.AsyncOpenAI,
    model: str,
    req: BenchRequest,
    arm: str,
    request_id: str,
    temperature: float,
    extra: dict[str, Any] | None = None,
    cache_salt: str | None = None,
    seed: int | None = None,
) -> RequestResult:
    """One streamed request; `extra` and the request's own `extra` add body fields."""
    res = RequestResult(request_id, req.category, arm, sent_at=time.perf_counter())
    body = {**(arm_body(arm, cache_salt) or {}), **(extra or {}), **req.extra}
    params: dict[str, Any] = {"model": model, "messages": req.messages, "max_tokens": req.max_tokens}
    params |= {"temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    params |= {"extra_body": body or None} | ({"tools": req.tools} if req.tools else {})
    params |= {"seed": seed} if seed is not None else {}
    # Only specgate's telemetry needs the id; llama-cpp-python's server refuses (400) any
    # x-request-id that is not a UUID.
    params["extra_headers"] = {} if arm == PEER else {"x-request-id": request_id}
    create: Any = client.chat.completions.create  # the typed overloads do not take dict messages
    usage, parts = False, []
    try:
        stream = await create(**params)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                delta = chunk.choices[0].delta
                if delta.content or delta.tool_calls:
                    res.chunk_times.append(now)
                    parts.append(delta.content or "")
                res.finish = chunk.choices[0].finish_reason or res.finish
            if chunk.usage is not None:
                usage = True
                res.output_tokens = chunk.usage.completion_tokens
                res.prompt_tokens = chunk.usage.prompt_tokens
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                res.cached_tokens = getattr(details, "cached_tokens", None) or 0
            if isinstance(metrics := (chunk.model_extra or {}).get("metrics"), dict):
                res.spec, res.route = metrics.get("spec_decoding") or {}, metrics.get("route") or {}
                res.steps = metrics.get("num_steps")
        res.done_at = time.perf_counter()
        if not usage:
            # llama-cpp-python streams no usage; an answer cut at max_tokens ("length") holds exactly
            # max_tokens tokens, any other is counted by its chunks (one token each there).
            res.output_tokens = req.max_tokens if res.finish == "length" else len(res.chunk_times)
        res.text = "".join(parts)
        res.ok = True  # an answer with no text (an immediate end of sequence) is still an answer
    except openai.APIError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


Make = Callable[[int], Awaitable[RequestResult]]  # sends request i
OnDone = Callable[[], None]  # called as each request ends (a progress bar's update)
ByArm = dict[str, list[RequestResult]]  # results by arm, in the same request order for every arm


async def closed_loop(
    make: Make, n: int, concurrency: int, on_done: OnDone = lambda: None
) -> list[RequestResult]:
    """`concurrency` workers, each sending the next request once its last one finished; results in order."""
    results: list[RequestResult | None] = [None] * n
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            results[i] = await make(i)
            on_done()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return [r for r in results if r is not None]


async def open_loop(
    make: Make, offsets: Sequence[float], max_concurrency: int | None, on_done: OnDone = lambda: None
) -> list[RequestResult]:
    """Requests leave at their scheduled offsets whatever the server's state (optionally capped)."""
    gate = asyncio.Semaphore(max_concurrency or len(offsets) or 1)
    start = time.perf_counter()

    async def one(i: int, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with gate:
            res = await make(i)
        on_done()
        return res

    return list(await asyncio.gather(*(one(i, at) for i, at in enumerate(offsets))))


async def warm_up(client: openai.AsyncOpenAI, model: str, arm: str, extra: dict[str, Any] | None) -> None:
    """One untimed request per server before the clock starts, so that first-call costs (thread
    pools, lazy allocations) do not land on the first measured request. Its id does not start with
    a run id: telemetry cross-checks do not count it."""
    req = BenchRequest("warm-up", user("Name three colours."), 16)
    res = await send(client, model, req, arm, "warm-up", 0.0, extra)
    if not res.ok:
        raise RuntimeError(f"the warm-up request failed: {res.error}")
