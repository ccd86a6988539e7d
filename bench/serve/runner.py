"""Sending the requests: the official `openai` async client, streaming, timing every chunk."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import openai

from specgate.bench.serve.datasets import BenchRequest
from specgate.bench.serve.metrics import RequestResult

# An arm is how requests ask to be served: "policy" leaves speculation to the gateway's router;
# anything else forces it through specgate's `spec` extension ("plain" turns it off).
POLICY, PLAIN = "policy", "plain"


def arm_body(arm: str) -> dict[str, Any] | None:
    if arm == POLICY:
        return None
    return {"spec": {"method": "off" if arm == PLAIN else arm}}


async def send(
    client: openai.AsyncOpenAI, model: str, req: BenchRequest, arm: str, request_id: str, temperature: float
) -> RequestResult:
    res = RequestResult(request_id, req.category, arm, sent_at=time.perf_counter())
    kwargs: dict[str, Any] = {}
    if req.tools:
        kwargs["tools"] = req.tools
    create: Any = client.chat.completions.create  # the typed overloads do not take dict messages
    try:
        stream = await create(
            model=model,
            messages=req.messages,
            max_tokens=req.max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=arm_body(arm),
            extra_headers={"x-request-id": request_id},
            **kwargs,
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                delta = chunk.choices[0].delta
                if delta.content or delta.tool_calls:
                    res.chunk_times.append(now)
            if chunk.usage is not None:
                res.output_tokens = chunk.usage.completion_tokens
                res.prompt_tokens = chunk.usage.prompt_tokens
            metrics = (chunk.model_extra or {}).get("metrics")
            if isinstance(metrics, dict):
                res.spec = metrics.get("spec_decoding") or {}
                res.route = metrics.get("route") or {}
        res.done_at = time.perf_counter()
        res.ok = True  # an answer with no text (an immediate end of sequence) is still an answer
    except openai.APIError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def closed_loop(
    make: Callable[[int], Any], n: int, concurrency: int, on_done: Callable[[], None]
) -> list[RequestResult]:
    """`concurrency` workers, each sending the next request as soon as its last one finished."""
    results: list[RequestResult | None] = [None] * n
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            results[i] = await make(i)
            on_done()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return [r for r in results if r is not None]


async def open_loop(
    make: Callable[[int], Any],
    offsets: Sequence[float],
    max_concurrency: int | None,
    on_done: Callable[[], None],
) -> list[RequestResult]:
    """Requests leave at their scheduled offsets whatever the server's state (optionally capped)."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(i: int, at: float) -> RequestResult:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            res: RequestResult = await make(i)
        else:
            async with gate:
                res = await make(i)
        on_done()
        return res

    return list(await asyncio.gather(*(one(i, at) for i, at in enumerate(offsets))))
