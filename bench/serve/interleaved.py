"""Arms measured side by side with every server up at once, so that the drift of a shared machine
(up to 18% within minutes on these) lands on every arm alike instead of on whichever ran last.

1 in flight: prompt i goes to every arm in turn, the order rotated by i, so that no arm is always
the first after an idle gap. Arms then compare prompt by prompt: the paired ratio TPOT_reference /
TPOT_arm of one prompt cancels what the prompt itself costs (its length, its class), which differs
far more between prompts than the arms differ on one.

N in flight: closed-loop phases, one arm at a time, in palindrome order (A B B A, A B C C B A), so
that a steady trend over the run adds as much to each arm's mean of its two phases.

`specgate bench serve --peer llama-server` (side_by_side.py) and `specgate bench families serve`
measure this way.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import openai

from specgate.bench.serve.datasets import BenchRequest
from specgate.bench.serve.metrics import RequestResult, bootstrap_interval, geomean, ms, percentile
from specgate.bench.serve.runner import PLAIN, closed_loop, send, warm_up

T = TypeVar("T")
RESAMPLES, BOOTSTRAP_SEED = 2000, 0
ALL = "all"  # the row of every class: the median over classes


@dataclass(slots=True)
class Arm:
    """One way of serving the prompts: a server, the arm runner.send knows it as (a specgate arm,
    or PEER for a server without specgate's fields), and the body fields its requests add."""

    name: str  # in tables and report.json
    base_url: str
    kind: str = PLAIN
    model: str = ""  # "": the server's first /v1/models
    extra: dict[str, Any] = field(default_factory=dict)
    reqs: Sequence[BenchRequest] | None = None  # the prompts as this server must get them, if not as sent
    client: Any = None


Send = Callable[[Arm, int, str], Awaitable[RequestResult]]


def _nothing() -> None:
    return None


def rotation(items: Sequence[T], i: int) -> list[T]:
    """The order of prompt i: `items` rotated left by i."""
    k = i % len(items)
    return [*items[k:], *items[:k]]


def palindrome(items: Sequence[T]) -> list[T]:
    """A B C -> A B C C B A: a linear drift adds the same to every item's pair of phases."""
    return [*items, *items[::-1]]


@dataclass(slots=True)
class Sender:
    """Sends prompt i to an arm in a phase. Every request has a cache salt of its own, so that none
    finds a prompt in specgate's prefix cache, not even its own prompt sent again within a phase (as
    llama-server arms say cache_prompt false). With sampling, prompt i carries seed + i to every arm:
    the same draw on every server that takes a seed."""

    run_id: str
    reqs: Sequence[BenchRequest]
    temperature: float = 0.0
    seed: int | None = None

    async def __call__(self, arm: Arm, i: int, phase: str) -> RequestResult:
        reqs = arm.reqs or self.reqs
        rid = f"{self.run_id}-{arm.name}-{phase}-{i}"
        seed = None if self.temperature == 0 or self.seed is None else self.seed + i
        res = await send(
            arm.client, arm.model, reqs[i % len(reqs)], arm.kind, rid, self.temperature, arm.extra, rid, seed
        )
        res.arm = arm.name  # runner.send names it by kind: two llama-server arms are both PEER there
        return res


async def one_in_flight(
    arms: Sequence[Arm],
    n: int,
    send_one: Send,
    deadline: float | None = None,
    on_done: Callable[[], None] = _nothing,
) -> dict[str, list[RequestResult]]:
    """Prompts 0..n-1, each to every arm in turn, the order rotated prompt by prompt; no new prompt
    after `deadline` (time.monotonic). results[arm][k] of every arm answer the same prompt k."""
    results: dict[str, list[RequestResult]] = {a.name: [] for a in arms}
    for i in range(n):
        if deadline is not None and time.monotonic() > deadline:
            break
        for arm in rotation(arms, i):
            results[arm.name].append(await send_one(arm, i, "c1"))
            on_done()
    return results


@dataclass(slots=True)
class Phase:
    arm: str
    seconds: float
    results: list[RequestResult]

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        tokens = sum(r.output_tokens for r in ok)
        return {
            "arm": self.arm,
            "requests": len(self.results),
            "failed": len(self.results) - len(ok),
            "seconds": self.seconds,
            "tokens": tokens,
            "tok_s": tokens / self.seconds,
        }


async def phases(
    arms: Sequence[Arm],
    n: int,
    in_flight: int,
    send_one: Send,
    deadline: float | None = None,
    on_done: Callable[[], None] = _nothing,
) -> list[Phase]:
    """Closed loops of `n` requests at `in_flight`, one arm at a time, in palindrome order."""
    out: list[Phase] = []
    for k, arm in enumerate(palindrome(arms)):
        if deadline is not None and time.monotonic() > deadline:
            break

        def make(i: int, arm: Arm = arm, phase: str = f"c{in_flight}-{k}") -> Awaitable[RequestResult]:
            return send_one(arm, i, phase)

        t0 = time.perf_counter()
        results = await closed_loop(make, n, in_flight, on_done)
        out.append(Phase(arm.name, time.perf_counter() - t0, results))
    return out


def phase_means(done: Sequence[Phase], names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Per arm: aggregate output tokens/s of each of its phases, in order, and their mean."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        rates = [p.summary()["tok_s"] for p in done if p.arm == name]
        out[name] = {"tok_s": rates, "tok_s_mean": sum(rates) / len(rates) if rates else None}
    return out


@contextlib.asynccontextmanager
async def connected(arms: Sequence[Arm]) -> AsyncIterator[None]:
    """Every arm's client open (and closed after: each load point runs in an event loop of its own),
    its model named and one untimed request answered."""
    try:
        for arm in arms:
            # One retry: llama-server drops a keep-alive connection idle for a few seconds (while the
            # other arms answer), and the next request on it fails before it is sent.
            arm.client = openai.AsyncOpenAI(
                base_url=f"{arm.base_url}/v1", api_key="none", max_retries=1, timeout=1800
            )
            if not arm.model:
                arm.model = (await arm.client.models.list()).data[0].id
            await warm_up(arm.client, arm.model, arm.kind, arm.extra)
        yield
    finally:
        for arm in arms:
            if arm.client is not None:
                await arm.client.close()
                arm.client = None


async def at_point(arms: Sequence[Arm], measure: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """`measure()` with every arm connected, and the 1-minute load average before and after it:
    other work on the machine shows there."""
    async with connected(arms):
        load = os.getloadavg()[0]
        out = await measure()
        out["loadavg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    return out


def arm_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "tpot_ms": [round(t * 1e3, 2) for t in tpots],
        "tpot_p50_ms": ms(percentile(tpots, 50)),
        "ttft_p50_ms": ms(percentile([r.ttft for r in ok if r.ttft is not None], 50)),
        "output_tokens": [r.output_tokens for r in ok],
    }


def class_tpot(results: Sequence[RequestResult]) -> dict[str, float | None]:
    """Median TPOT (ms) per class, classes in their order of appearance."""
    by: dict[str, list[float]] = {}
    for r in results:
        by.setdefault(r.category, [])
        if r.ok and r.tpot is not None:
            by[r.category].append(r.tpot)
    return {cat: ms(percentile(ts, 50)) for cat, ts in by.items()}


def best_of(
    results: dict[str, list[RequestResult]], names: Sequence[str]
) -> tuple[list[RequestResult], dict[str, str]]:
    """Per class, which of the arms `names` has the lower median TPOT there; and the reference that
    answers each prompt with its class's best arm (its results stay paired prompt by prompt)."""
    medians = {n: class_tpot(results[n]) for n in names}
    first = results[names[0]]
    best = {
        cat: min(names, key=lambda n: medians[n].get(cat) or float("inf"))
        for cat in dict.fromkeys(r.category for r in first)
    }
    return [results[best[r.category]][k] for k, r in enumerate(first)], best


def _median_of_geomeans(groups: list[list[float]]) -> float | None:
    return percentile([g for g in (geomean(x) for x in groups) if g is not None], 50)


def _estimate(
    groups: list[list[float]], stat: Callable[[list[list[float]]], float | None], resamples: int, seed: int
) -> dict[str, Any]:
    interval = bootstrap_interval(groups, stat, resamples, seed=seed) if groups else None
    low, high = interval or (None, None)
    return {
        "n": sum(len(g) for g in groups),
        "ratio": stat(groups) if groups else None,
        "low": low,
        "high": high,
    }


def paired_ratios(
    arm: Sequence[RequestResult],
    reference: Sequence[RequestResult],
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, Any]:
    """TPOT_reference / TPOT_arm prompt by prompt (above 1: the arm is faster). Per class: their
    geometric mean and its 95% bootstrap interval (the class's prompts resampled); ALL: the median
    over classes of those, its interval from resampling within every class at once. `arm[k]` and
    `reference[k]` must answer the same prompt; pairs where either failed are left out."""
    by_class: dict[str, list[float]] = {}
    for a, r in zip(arm, reference, strict=True):
        if a.category != r.category:
            raise ValueError(
                f"unpaired results: {a.request_id} ({a.category}), {r.request_id} ({r.category})"
            )
        if a.ok and r.ok and a.tpot and r.tpot:
            by_class.setdefault(a.category, []).append(r.tpot / a.tpot)
    classes = {cat: _estimate([xs], lambda g: geomean(g[0]), resamples, seed) for cat, xs in by_class.items()}
    overall = _estimate(list(by_class.values()), _median_of_geomeans, resamples, seed)
    return {"classes": classes, ALL: {**overall, "classes": len(by_class)}}


def row(r: RequestResult, **extra: Any) -> dict[str, Any]:
    """One request as report.json keeps it."""
    spec = r.spec or {}
    return {
        **extra,
        "request_id": r.request_id,
        "arm": r.arm,
        "category": r.category,
        "ok": r.ok,
        "error": r.error,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "ttft_ms": ms(r.ttft),
        "tpot_ms": ms(r.tpot),
        "e2e_ms": ms(r.e2e),
        "num_drafts": spec.get("num_drafts"),
        "num_accepted_tokens": spec.get("num_accepted_tokens"),
        "route": (r.route.get("spec") or {}).get("method") if r.route else None,
    }
