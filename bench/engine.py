"""`specgate bench engine`: how fast the engine decodes a model, beside llama.cpp and `specgate serve`,
at batch 1 and alone at --concurrency. (bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from specgate.bench import engine_run, launch, models, workload
from specgate.bench.stats import number, over, percentile, table

# A system answers one prompt: (tokens, seconds from send to the last token, TPOT ms or None).
System = Callable[[list[int], int], tuple[int, float, float | None]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default="engine,llama.cpp,served", help="of engine, llama.cpp, served")
    p.add_argument("--prompts", type=int, default=4, help="prompts at batch 1 (categories alternate)")
    p.add_argument("--max-prompt-tokens", type=int, default=400)
    p.add_argument("--concurrency", default="4,16", help="the engine alone at these loads (empty: none)")
    launch.options(p, model=None, max_tokens=64, reps=2, compile="", dtype="auto", threads=None)


def run(args: argparse.Namespace) -> int:
    import torch

    sizes = tuple(int(s) for s in args.compile.split(",") if s)
    engine = engine_run.build(args.model, args.threads, dtype=args.dtype, compile_sizes=sizes)
    reqs = workload.shipped(args.prompts, args.max_tokens, workload.CATEGORIES[:-1], args.max_prompt_tokens)
    ids = engine_run.prompt_ids(engine, reqs)[: args.prompts]
    threads = torch.get_num_threads()
    n = args.max_tokens
    names = args.systems.split(",")
    with contextlib.ExitStack() as stack:
        systems = {name: stack.enter_context(_system(name, engine, args, threads)) for name in names}
        for system in systems.values():  # first calls pay one-off costs
            system(ids[0][:32], 8)
        got: dict[str, list[tuple[int, float, float | None]]] = defaultdict(list)
        for k, prompt in enumerate(ids * args.reps):
            for name in names[k % len(names) :] + names[: k % len(names)]:
                got[name].append(systems[name](prompt, n))
    tokens = {name: sum(t for t, _, _ in rs) for name, rs in got.items()}
    rates = {name: tokens[name] / sum(s for _, s, _ in rs) for name, rs in got.items()}
    tpot = {name: percentile([x for *_, x in rs if x is not None], 50) for name, rs in got.items()}
    print(f"{engine.model_name}, {engine.config.dtype}, {threads} threads, {n} greedy tokens an answer")
    print(f"batch 1: {len(ids)} prompts x {args.reps} rounds, systems in rotating order")
    vs = {name: number(over(rates[name], rates.get("llama.cpp")), 2) for name in names}
    rows = [[name, tokens[name], number(rates[name]), number(tpot[name], 2), vs[name]] for name in names]
    print("\n".join(table(["system", "tokens", "tok/s", "TPOT p50 ms", "vs llama.cpp"], rows)))
    if "llama.cpp" in tpot and "engine" in tpot:
        print(f"TPOT llama.cpp / engine: {number(over(tpot['llama.cpp'], tpot['engine']), 2)}")
    loads = [int(c) for c in args.concurrency.split(",") if c]
    for c in loads:
        batch = engine_run.run(engine, (ids * c)[:c], n, concurrency=c, prefix_salt=None)
        print(f"engine, {c} concurrent: {batch.tokens / batch.seconds:.1f} tok/s aggregate")
    return 0


@contextlib.contextmanager
def _system(name: str, engine: Any, args: argparse.Namespace, threads: int) -> Iterator[System]:
    if name == "engine":
        yield lambda ids, n: _engine(engine, ids, n)
    elif name == "llama.cpp":
        from llama_cpp import Llama

        gguf = str(models.gguf_path(args.model))
        yield _llama(Llama(model_path=gguf, n_threads=threads, n_ctx=4096, verbose=False))
    elif name == "served":
        with served(args, Path(tempfile.mkdtemp(prefix="bench-engine-"))) as stream:
            yield stream
    else:
        raise ValueError(f"unknown system {name!r}")


def _engine(engine: Any, ids: list[int], n: int) -> tuple[int, float, float | None]:
    batch = engine_run.run(engine, [ids], n, prefix_salt=None)  # no prefix cache: every row prefills
    return batch.tokens, batch.seconds, batch.answers[0].tpot_ms


def _llama(llm: Any) -> System:
    def answer(ids: list[int], n: int) -> tuple[int, float, float | None]:
        start, tokens = time.perf_counter(), llm.generate(ids, temp=0.0, top_k=1, reset=True)
        stamps = [time.perf_counter() for _ in itertools.islice(tokens, n)]  # it never stops by itself
        return len(stamps), stamps[-1] - start, (stamps[-1] - stamps[0]) * 1e3 / max(1, len(stamps) - 1)

    return answer


@contextlib.contextmanager
def served(args: argparse.Namespace, out: Path) -> Iterator[System]:
    """`specgate serve` on the same model (engine core process, the same compiled sizes)."""
    options = {"model": models.resolve(args.model), "threads": args.threads, "compile": args.compile}
    with (
        launch.specgate(out / "specgate.log", options, data=out / "gateway-data") as server,
        httpx.Client(base_url=server.url, timeout=600) as client,
    ):
        model = client.get("/v1/models").json()["data"][0]["id"]
        yield lambda ids, n: stream_completion(client, model, ids, n)


def stream_completion(
    client: httpx.Client, model: str, ids: Sequence[int], max_tokens: int
) -> tuple[int, float, float]:
    """Token ids streamed through /v1/completions, plain, exactly `max_tokens` long: (completion
    tokens, seconds from send to the last token, TPOT ms after the first token)."""
    body = {"model": model, "prompt": list(ids), "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True}, "spec": {"method": "off"}}
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for event in (json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")):
            if event.get("choices") and event["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
            tokens = int(event["usage"]["completion_tokens"]) if event.get("usage") else tokens
    return tokens, last - start, (last - first) * 1e3 / max(tokens - 1, 1)
