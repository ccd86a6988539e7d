"""bench_engine's served row: the same prompts through `specgate serve`, streamed, one at a time.

The server is started as `specgate bench serve` starts its own (the engine in its engine-core
process, as users run it); the client is a plain streaming HTTP reader on the same machine.
Token-id prompts go to /v1/completions, so the server decodes exactly what the engine rows decode.
bench_engine alternates its requests with the engine's own batch-1 requests, so machine noise falls
on both alike.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from specgate.bench.serve.harness import start_local_gateway


def _stream(client: httpx.Client, model: str, ids: list[int], max_tokens: int) -> tuple[int, float, float]:
    """(completion tokens, seconds from send to the last token, TPOT ms after the first token)."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "spec": {"method": "off"},
    }
    start = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    return tokens, last - start, (last - first) * 1e3 / max(tokens - 1, 1)


class ServedGateway:
    """`specgate serve` started here (engine core process, `--compile` sizes), stopped on exit."""

    def __init__(self, compile_sizes: str, threads: int, out: Path) -> None:
        args = argparse.Namespace(model=None, dtype=None, threads=threads, compile=compile_sizes)
        self._args, self._out = args, out
        self.model = ""

    def __enter__(self) -> ServedGateway:
        # bench serve's own start-up: same command line, data directory and readiness wait.
        self.server, url = start_local_gateway(self._args, self._out)
        self.client = httpx.Client(base_url=url, timeout=600)
        self.model = self.client.get("/v1/models").json()["data"][0]["id"]
        return self

    def stream(self, ids: list[int], max_tokens: int) -> tuple[int, float, float]:
        """(completion tokens, seconds from send to the last token, TPOT ms after the first token)."""
        return _stream(self.client, self.model, ids, max_tokens)

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.server.terminate()
        self.server.wait(60)
