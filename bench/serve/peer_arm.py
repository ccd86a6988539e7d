"""The llama.cpp arm of `specgate bench serve --peer llama-cpp`: the same requests at the same load
points, sent by the same client code to llama.cpp's server on the same GGUF, after specgate's arms
(the gateway is stopped by then: on two cores, the servers must not share the machine)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
from pydantic import TypeAdapter

from specgate.bench.serve import peer_server
from specgate.bench.serve.datasets import BenchRequest
from specgate.bench.serve.peer_server import PEER
from specgate.bench.serve.runner import Plan, measure, warm_up


def peer_request(req: BenchRequest, chat_template: str | None) -> BenchRequest:
    """The request as specgate's engine sees it. Where the chat template cannot render tools
    (SmolLM2's), specgate writes them into a system message; llama-cpp-python would drop them,
    and the peer would answer a shorter prompt. So the peer gets them the way specgate renders them."""
    if not req.tools:
        return req
    from specgate.gateway.backends.embedded.chat_template import normalize_messages
    from specgate.gateway.protocol.schemas import Message

    parsed = TypeAdapter(list[Message]).validate_python(req.messages)
    messages, tools = normalize_messages(
        SimpleNamespace(chat_template=chat_template), parsed, req.tools, None
    )
    return BenchRequest(req.category, messages, req.max_tokens, tools, dict(req.extra))


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The peer's GGUF, command line and request body, resolved before any arm runs, so that a
    model llama.cpp cannot load fails the run at once rather than after specgate's arms."""
    gguf = peer_server.gguf_path(args.model)
    threads = args.threads or os.cpu_count() or 1
    port = peer_server.free_port()
    eog = peer_server.eog_token_ids(gguf) if args.ignore_eos else []
    return {
        "arm": PEER,
        "gguf": str(gguf),
        "threads": threads,
        "url": f"http://127.0.0.1:{port}",
        "command": peer_server.command(gguf, port, threads, gguf.stem, args.peer_n_ctx),
        "body": peer_server.request_body(eog),
    }


def run(peer: dict[str, Any], plan: Plan, out: Path, on_done: Callable[[], None]) -> list[dict[str, Any]]:
    """The peer's runs (one per load point), with the server up only meanwhile."""
    template = peer_server.chat_template(Path(peer["gguf"]))
    reqs = [peer_request(r, template) for r in plan.reqs]
    log = out / "llama-cpp.server.log"
    with peer_server.running(peer["command"], log, f"{peer['url']}/v1/models"):
        return asyncio.run(_measure(peer, dataclasses.replace(plan, reqs=reqs), on_done))


async def _measure(peer: dict[str, Any], plan: Plan, on_done: Callable[[], None]) -> list[dict[str, Any]]:
    client = openai.AsyncOpenAI(base_url=f"{peer['url']}/v1", api_key="none", max_retries=0, timeout=600)
    model = Path(peer["gguf"]).stem  # the server's --model_alias
    await warm_up(client, model, PEER, peer["body"])
    return await measure(client, model, [PEER], plan, peer["body"], on_done)
