"""The loop around `Engine.step` that the engine benchmarks share: prompts in (all at once, or at
most N in flight), every token timed as it leaves a step, the engine's counters per request.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specgate.bench import models
from specgate.bench.workload import BenchRequest
from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.outputs import RequestStats, SpecStats
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import SpecParams

_RUNS = itertools.count()


def build(model: str | None = None, threads: int | None = None, **config: Any) -> Engine:
    """An engine on `model` (a path, a bench/models.py name, or None: the default model), quiet,
    its GGUF conversions cached where the gateway keeps them."""
    import torch
    import transformers

    from specgate.gateway.settings import default_cache_dir

    if threads:
        torch.set_num_threads(threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = models.resolve(model)
    cfg = EngineConfig(model=path, convert_cache_dir=str(default_cache_dir()), num_threads=threads, **config)
    return Engine(cfg)


def prompt_ids(engine: Engine, reqs: Sequence[BenchRequest]) -> list[list[int]]:
    """Each request as the embedded backend renders it (chat template, tools)."""
    from specgate.gateway.backends.embedded.chat_template import render_chat

    return [list(render_chat(engine.tokenizer, r.messages, r.tools)) for r in reqs]


@dataclass(slots=True)
class Answer:
    tokens: list[int]
    times: list[float]  # perf_counter when each token left its step
    stats: RequestStats  # the engine's counters when the request finished

    @property
    def tpot_ms(self) -> float | None:
        """Time from the first token to the last, per token after the first."""
        if len(self.times) < 2:
            return None
        return (self.times[-1] - self.times[0]) * 1e3 / (len(self.times) - 1)

    @property
    def decode_rate(self) -> float | None:
        """Tokens after the first per second after the first."""
        tpot = self.tpot_ms
        return 1e3 / tpot if tpot else None


@dataclass(slots=True)
class Batch:
    answers: list[Answer]  # in prompt order
    start: float
    steps: list[float]  # perf_counter after each step

    @property
    def seconds(self) -> float:
        return self.steps[-1] - self.start if self.steps else 0.0

    @property
    def tokens(self) -> int:
        return sum(len(a.tokens) for a in self.answers)

    @property
    def spec(self) -> list[SpecStats]:
        return [a.stats.spec for a in self.answers if a.stats.spec is not None]

    def after_first_tokens(self) -> tuple[int, float]:
        """Tokens and seconds from the step in which the last request got its first token to the
        end: a long prompt's prefill (cached for every arm but the first) would otherwise weigh more
        than decoding."""
        start = max(a.times[0] for a in self.answers)
        return sum(t > start for a in self.answers for t in a.times), self.steps[-1] - start

    def all_decoding(self) -> tuple[int, float]:
        """Tokens and seconds while every request decodes: after the last first token, before the
        step in which the first one finishes (from there the batch is smaller)."""
        start = max(a.times[0] for a in self.answers)
        first_end = min(a.times[-1] for a in self.answers)
        window = [t for t in self.steps if start < t < first_end]
        if not window:
            return 0, 0.0
        tokens = sum(start < t <= window[-1] for a in self.answers for t in a.times)
        return tokens, window[-1] - start


def run(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    spec: SpecParams | None = None,
    concurrency: int = 0,
    ignore_eos: bool = True,
    cache_scope: str | None = "",
    prefix_salt: str | None = "",
) -> Batch:
    """Greedy answers to `prompts`, at most `concurrency` in flight (0: all at once). `cache_scope`
    and `prefix_salt` as `Engine.add_request` takes them (None: nothing shared)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    run_id = next(_RUNS)
    pending = list(enumerate(prompts))
    limit = concurrency or len(prompts)
    tokens: dict[int, list[int]] = {}
    times: dict[int, list[float]] = {}
    answers: dict[int, Answer] = {}
    in_flight = 0
    start = time.perf_counter()
    steps: list[float] = []
    while pending or engine.has_unfinished():
        while pending and in_flight < limit:
            i, ids = pending.pop(0)
            rid = f"bench-{run_id}-{i}"
            engine.add_request(rid, list(ids), params, spec, cache_scope=cache_scope, prefix_salt=prefix_salt)
            in_flight += 1
        outs = engine.step()
        now = time.perf_counter()
        steps.append(now)
        for out in outs:
            i = int(out.request_id.rsplit("-", 1)[1])
            tokens.setdefault(i, []).extend(out.new_token_ids)
            times.setdefault(i, []).extend([now] * len(out.new_token_ids))
            if out.stats is not None:  # its finished output
                answers[i] = Answer(tokens[i], times[i], out.stats)
                in_flight -= 1
    return Batch([answers[i] for i in range(len(prompts))], start, steps)
