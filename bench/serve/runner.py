"""Sending the requests: the official `openai` async client, streaming, timing every chunk."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

from specgate.bench.serve.datasets import BenchRequest
from specgate.bench.serve.metrics import RequestResult, summarize
from specgate.bench.serve.peer_server import PEER

# An arm is how requests ask to be served: "policy" leaves speculation to the gateway's router;
# anything else forces it through specgate's `spec` extension ("plain" turns it off). "METHOD:kN"
# is the method with a fixed chain of N drafts a step (static controller, no trees): speculation as
# vLLM's num_speculative_tokens configures it, whatever the load or the acceptance.
POLICY, PLAIN = "policy", "plain"


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
    if arm == PEER:  # the peer is not specgate: it knows no `spec` and no `cache_salt`
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
    """One streamed request; `extra` adds body fields (ignore_eos, or the peer's logit_bias)."""
    res = RequestResult(request_id, req.category, arm, sent_at=time.perf_counter())
    body = {**(arm_body(arm, cache_salt) or {}), **(extra or {})}
    finish: str | None = None
    usage = False
    kwargs: dict[str, Any] = {}
    if req.tools:
        kwargs["tools"] = req.tools
    if seed is not None:
        kwargs["seed"] = seed
    create: Any = client.chat.completions.create  # the typed overloads do not take dict messages
    try:
        stream = await create(
            model=model,
            messages=req.messages,
            max_tokens=req.max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=body or None,
            # Only specgate's telemetry needs the id; llama-cpp-python's server refuses (400) any
            # x-request-id that is not a UUID.
            extra_headers={} if arm == PEER else {"x-request-id": request_id},
            **kwargs,
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                delta = chunk.choices[0].delta
                if delta.content or delta.tool_calls:
                    res.chunk_times.append(now)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = True
                res.output_tokens = chunk.usage.completion_tokens
                res.prompt_tokens = chunk.usage.prompt_tokens
            metrics = (chunk.model_extra or {}).get("metrics")
            if isinstance(metrics, dict):
                res.spec = metrics.get("spec_decoding") or {}
                res.route = metrics.get("route") or {}
        res.done_at = time.perf_counter()
        if not usage:
            # llama-cpp-python streams no usage; an answer cut at max_tokens ("length") holds exactly
            # max_tokens tokens, any other is counted by its chunks (one token each there).
            res.output_tokens = req.max_tokens if finish == "length" else len(res.chunk_times)
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


@dataclass(slots=True)
class Plan:
    """What every arm is measured on: the requests, the load points (an int: closed-loop
    concurrency; offsets: an open loop's send times) and the sampling settings."""

    reqs: Sequence[BenchRequest]
    points: Sequence[tuple[str, Sequence[float] | int]]
    run_id: str
    temperature: float = 0.0
    max_concurrency: int | None = None  # open loop cap on requests in flight
    slos: dict[str, float] = field(default_factory=dict)


async def measure(
    client: openai.AsyncOpenAI,
    model: str,
    arms: Sequence[str],
    plan: Plan,
    extra: dict[str, Any] | None,
    on_done: Callable[[], None],
) -> list[dict[str, Any]]:
    """Every arm at every load point: one run dict each, with its summary, its per-request
    `results` and its start time `t0` (both dropped from report.json)."""
    runs: list[dict[str, Any]] = []
    for label, point in plan.points:
        for arm in arms:

            def make(i: int, arm: str = arm, label: str = label) -> Any:
                rid = f"{plan.run_id}-{arm}-{label}-{i}".replace("/", "_").replace("=", "")
                # Each (arm, load point) starts with a cold prefix cache, as the peer does.
                salt = f"{plan.run_id}-{arm}-{label}"
                return send(client, model, plan.reqs[i], arm, rid, plan.temperature, extra, salt)

            t0 = time.perf_counter()
            if isinstance(point, int):
                results = await closed_loop(make, len(plan.reqs), point, on_done)
            else:
                results = await open_loop(make, point, plan.max_concurrency, on_done)
            duration = time.perf_counter() - t0
            runs.append(
                {
                    "arm": arm,
                    "point": label,
                    "summary": summarize(results, duration, plan.slos),
                    "errors": sorted({r.error for r in results if r.error})[:5],
                    "t0": t0,
                    "results": results,
                }
            )
    return runs


async def warm_up(client: openai.AsyncOpenAI, model: str, arm: str, extra: dict[str, Any] | None) -> None:
    """One untimed request per server before the clock starts, so that first-call costs (thread
    pools, lazy allocations) do not land on the first measured request. Its id does not start with
    the run id: the telemetry cross-check does not count it."""
    req = BenchRequest("warm-up", [{"role": "user", "content": "Name three colours."}], 16)
    res = await send(client, model, req, arm, "warm-up", 0.0, extra)
    if not res.ok:
        raise RuntimeError(f"the warm-up request failed: {res.error}")
