"""A stub OpenAI-compatible chat server: each request waits as a batching server would make it wait
(a scripted cost model), or, `canned`, is answered at once with three words (bench/README.md, "The
stub server"). `specgate bench stub` runs one (every PoolConfig field is a flag); `command` is a stub
process's command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import random
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from specgate.policies.features import copyability  # the gateway's own feature, read the same way

_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_TEXT = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
FILLER = ["the", "of", "and", "to", "a", "in", "that", "is", "for", "it", "as", "with", "on", "this"]
CANNED = ["Hello", " there", "!"]


@dataclass(slots=True)
class PoolConfig:
    """Every knob of one stub server; each is a command-line flag of the same name (dashes)."""

    model: str = "stub-pool"
    name: str = "stub"  # this server's name in /stats and response ids
    canned: bool = False  # answer at once, three words, no cost model
    speculative: bool = False
    num_spec_tokens: int = 4  # K: drafts verified per sequence and step
    verify_share: float = 1.0  # a draft's verification cost, in shares of a sequence's step cost
    accept_base: float = 0.1  # acceptance p on a prompt with nothing to copy
    accept_copy: float = 0.75  # added to p at full copyability
    copy_saturation: float = 0.12  # copyability at which p reaches accept_base + accept_copy
    step_base_ms: float = 20.0  # a decode step's fixed cost (weights read once per step)
    step_per_seq_ms: float = 1.5  # its cost per running sequence
    prefill_base_ms: float = 5.0
    prefill_ms_per_token: float = 0.05
    max_running: int = 64
    cache_blocks: int = 4096  # prefix cache capacity in blocks (0: none)
    block_tokens: int = 16
    chars_per_token: float = 4.0
    kv_tokens: int = 262_144  # KV capacity for kv_cache_usage_perc
    default_max_tokens: int = 256
    time_scale: float = 1.0  # multiplies every modelled duration (tests run faster)
    seed: int = 0

    def args(self) -> list[str]:
        """This config as command-line flags (what differs from the defaults)."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value, flag = getattr(self, f.name), f.name.replace("_", "-")
            if value != f.default and isinstance(value, bool):
                out.append(f"--{flag}" if value else f"--no-{flag}")
            elif value != f.default:
                out += [f"--{flag}", str(value)]
        return out


def render_chat(messages: list[dict[str, Any]]) -> str:
    """Messages as one prefix-stable text: a later turn's rendering starts with an earlier one's."""
    return "".join(f"<|{m.get('role', 'user')}|>\n{_content(m.get('content'))}\n" for m in messages)


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else json.dumps(content)


@dataclass
class Outcome:
    """One request's result: its tokens in emission order (one list per event) and its metrics."""

    prompt_tokens: int
    cached_tokens: int = 0
    pieces: list[list[str]] = field(default_factory=list)
    queue_ms: float = 0.0  # arrival to admission
    ttft_ms: float = 0.0  # admission to the first token (vLLM's: from scheduling)
    generation_ms: float = 0.0  # the first token to the last
    spec_steps: int = 0
    histogram: list[int] = field(default_factory=list)
    finish_reason: str = "length"

    @property
    def completion_tokens(self) -> int:
        return sum(len(p) for p in self.pieces)

    @property
    def text(self) -> str:
        return "".join(t for p in self.pieces for t in p)

    def metrics(self, speculative: bool, k: int) -> dict[str, Any]:
        n = self.completion_tokens
        ms = {"queue_time": self.queue_ms, "time_to_first_token": self.ttft_ms}
        ms["generation_time"] = self.generation_ms
        out: dict[str, Any] = {f"{k}_ms": round(v, 3) for k, v in ms.items()}
        out["mean_itl_ms"] = round(self.generation_ms / (n - 1), 3) if n > 1 else None
        if speculative:
            spec = {"num_spec_steps": self.spec_steps, "num_draft_tokens": self.spec_steps * k}
            spec["num_accepted_draft_tokens"] = sum(i * c for i, c in enumerate(self.histogram))
            out["speculative_decoding"] = {**spec, "acceptance_histogram": list(self.histogram)}
        return out

    def usage(self) -> dict[str, Any]:
        n = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        cached = {"cached_tokens": self.cached_tokens}
        return {**n, "total_tokens": sum(n.values()), "prompt_tokens_details": cached}


Events = AsyncGenerator[tuple[Outcome, list[str]], None]


class Pool:
    """The scripted server: admission, prefill, decode steps, prefix cache and counters."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.block_chars = max(1, round(config.block_tokens * config.chars_per_token))
        # The prefix cache: an LRU over chained block hashes of the rendered prompts (and answers).
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.running = self.waiting = self.kv_tokens_used = 0
        self._slots: asyncio.Semaphore | None = None
        self._prefill = asyncio.Lock()
        # Counters, as a server's /metrics would count them.
        self.requests = self.cache_queries = self.cache_hits = 0
        self.drafts = self.draft_tokens = self.accepted = 0

    def tokens(self, text: str) -> int:
        return max(1, math.ceil(len(text) / self.config.chars_per_token))

    def acceptance(self, copy: float) -> float:
        c = self.config
        level = min(1.0, copy / c.copy_saturation) if c.copy_saturation > 0 else 1.0
        return min(0.98, max(0.0, c.accept_base + c.accept_copy * level))

    def step_ms(self, running: int) -> float:
        """One decode step's duration with `running` sequences in the batch (time scale applied)."""
        c = self.config
        verify = 1 + c.num_spec_tokens * c.verify_share if c.speculative else 1
        per_seq = c.step_per_seq_ms * running * verify
        return (c.step_base_ms + per_seq) * c.time_scale

    def tokens_per_step(self, p: float) -> float:
        """Expected tokens a step emits at acceptance `p`: 1 on a plain server."""
        k = self.config.num_spec_tokens if self.config.speculative else 0
        return sum(p**i for i in range(k + 1))  # 1 + sum of P(the first i drafts accepted)

    def ms_per_token(self, running: int, copy: float) -> float:
        """Expected decode milliseconds per output token at a batch of `running` (the cost model)."""
        return self.step_ms(running) / self.tokens_per_step(self.acceptance(copy))

    def hashes(self, text: str) -> list[bytes]:
        out, h, size = [], b"", self.block_chars
        for i in range(0, len(text) - size + 1, size):
            block = text[i : i + size].encode("utf-8", "surrogatepass")
            h = hashlib.blake2b(h + block, digest_size=16).digest()
            out.append(h)
        return out

    def cache(self, text: str) -> None:
        for h in self.hashes(text) if self.config.cache_blocks else []:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.config.cache_blocks:
            self.blocks.popitem(last=False)

    async def serve(self, prompt: str, max_tokens: int, source: str, stop: asyncio.Event) -> Events:
        """Run one request; yields (outcome, the event's tokens) as they are due. `prompt`: the
        rendered prompt (its length and blocks), cached after the request with its answer; `source`:
        the text the answer copies and copyability reads."""
        c = self.config
        self._slots = self._slots or asyncio.Semaphore(c.max_running)
        t0 = time.perf_counter()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        prompt_tokens = reserved = self.tokens(prompt)
        self.kv_tokens_used += reserved
        try:
            self.requests += 1
            out = Outcome(prompt_tokens, queue_ms=(time.perf_counter() - t0) * 1e3)
            out.histogram = [0] * (c.num_spec_tokens + 1)
            seed = hashlib.blake2b(f"{c.seed}\x00{prompt}".encode("utf-8", "surrogatepass"), digest_size=8)
            rng = random.Random(int.from_bytes(seed.digest(), "big"))
            # The answer: the source's words from a random point, as a model that copies would write them.
            words = source.split() or FILLER
            start = rng.randrange(len(words))
            words = [" " + w for w in words[start:] + words[:start]]
            p = self.acceptance(copyability(source))
            async with self._prefill:
                # Matched when its turn comes: a prefill just ahead of it may have cached its prefix.
                hashes = self.hashes(prompt)
                blocks = next((i for i, h in enumerate(hashes) if h not in self.blocks), len(hashes))
                for h in hashes[:blocks]:  # touched as used
                    self.blocks.move_to_end(h)
                # The last prompt token is always computed (it yields the first output token).
                out.cached_tokens = min(blocks, (prompt_tokens - 1) // c.block_tokens) * c.block_tokens
                self.cache_queries += prompt_tokens
                self.cache_hits += out.cached_tokens
                prefill_ms = c.prefill_base_ms + (prompt_tokens - out.cached_tokens) * c.prefill_ms_per_token
                await asyncio.sleep(prefill_ms * c.time_scale / 1e3)
                self.cache(prompt)
            first = due = time.perf_counter()
            out.ttft_ms = (first - t0) * 1e3 - out.queue_ms
            while out.completion_tokens < max_tokens:
                if stop.is_set():
                    out.finish_reason = "abort"
                    return
                n = 1
                if out.pieces:  # the first token comes with the prefill; then one step an event
                    due += self.step_ms(self.running) / 1e3
                    n += self._draft(out, rng, p)
                    # Absolute deadlines: event-loop lateness of one step does not add up over steps.
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                start = out.completion_tokens
                emitted = [words[(start + i) % len(words)] for i in range(min(n, max_tokens - start))]
                out.pieces.append(emitted)
                self.kv_tokens_used += len(emitted)
                reserved += len(emitted)
                out.generation_ms = (time.perf_counter() - first) * 1e3
                yield out, emitted
            self.cache(prompt + out.text + "\n")  # as the next turn renders the answer
        finally:
            self.kv_tokens_used -= reserved
            self.running -= 1
            self._slots.release()

    def _draft(self, out: Outcome, rng: random.Random, p: float) -> int:
        """A speculative step's accepted drafts (each accepted with p, until the first rejection)."""
        c = self.config
        if not c.speculative:
            return 0
        accepted = 0
        while accepted < c.num_spec_tokens and rng.random() < p:
            accepted += 1
        out.spec_steps += 1
        out.histogram[accepted] += 1
        self.drafts += 1
        self.draft_tokens += c.num_spec_tokens
        self.accepted += accepted
        return accepted

    def metrics_text(self) -> str:
        """Prometheus text exposition in vLLM's names."""
        kv = min(1.0, self.kv_tokens_used / self.config.kv_tokens)
        series: dict[str, tuple[str, float]] = {"num_requests_running": ("gauge", self.running)}
        series |= {"num_requests_waiting": ("gauge", self.waiting), "kv_cache_usage_perc": ("gauge", kv)}
        series["prefix_cache_queries_total"] = ("counter", self.cache_queries)
        series["prefix_cache_hits_total"] = ("counter", self.cache_hits)
        if self.config.speculative:
            series["spec_decode_num_drafts_total"] = ("counter", self.drafts)
            series["spec_decode_num_draft_tokens_total"] = ("counter", self.draft_tokens)
            series["spec_decode_num_accepted_tokens_total"] = ("counter", self.accepted)
        labels = f'engine="0",model_name="{self.config.model}"'
        lines = []
        for name, (kind, value) in series.items():
            lines += [f"# HELP vllm:{name} {name}", f"# TYPE vllm:{name} {kind}"]
            lines.append(f"vllm:{name}{{{labels}}} {float(value)}")
        return "\n".join(lines) + "\n"


async def _canned(prompt_tokens: int) -> Events:
    """Three words at once: the least a backend can cost (what is measured past it is the gateway)."""
    out = Outcome(prompt_tokens, finish_reason="stop")
    for word in CANNED:
        out.pieces.append([word])
        yield out, [word]


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = _JSON) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length]})
    await send({"type": "http.response.body", "body": body})


async def _event(send: Any, payload: dict[str, Any] | None) -> None:
    """One server-sent event; None: the last one, [DONE]."""
    body = b"data: [DONE]\n\n" if payload is None else b"data: " + _dumps(payload) + b"\n\n"
    await send({"type": "http.response.body", "body": body, "more_body": payload is not None})


def _error(message: str, kind: str = "invalid_request_error") -> bytes:
    return _dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})


class StubPoolApp:
    """The raw ASGI app around one `Pool`: /v1/chat/completions, /v1/models, /health, /stats, /metrics."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.pool = Pool(config)
        self._ids = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, c = scope["path"], self.config
        model = {"id": c.model, "object": "model", "owned_by": "stub", "created": 0}
        models = {"object": "list", "data": [model]}
        if scope["method"] == "GET" and path in ("/v1/models", "/health", "/stats"):
            stats = {"name": c.name, "speculative": c.speculative, "requests": self.pool.requests}
            await _send(send, 200, _dumps({"/v1/models": models, "/health": {}, "/stats": stats}[path]))
        elif scope["method"] == "GET" and path == "/metrics":
            await _send(send, 200, self.pool.metrics_text().encode(), _TEXT)
        elif scope["method"] != "POST" or path != "/v1/chat/completions":
            await _send(send, 404, _error("not found", "not_found_error"))
        else:
            await self._complete(receive, send)

    async def _complete(self, receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body, more = body + message.get("body", b""), message.get("more_body", False)
        try:
            req = json.loads(body)
        except ValueError:
            req = None
        if not isinstance(req, dict) or not isinstance(req.get("messages"), list) or not req["messages"]:
            await _send(send, 400, _error("the body must be a JSON object with a non-empty messages list"))
            return
        limit = req.get("max_completion_tokens") or req.get("max_tokens")
        limit = self.config.default_max_tokens if limit is None else limit
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            await _send(send, 400, _error("max_tokens must be a non-negative integer"))
            return
        msgs = [m for m in req["messages"] if isinstance(m, dict)]
        prompt = render_chat(msgs) + "<|assistant|>\n"
        source = "\n".join(_content(m.get("content")) for m in msgs)
        self._ids += 1
        rid = f"chatcmpl-{self.config.name}-{self._ids}"
        base = {"id": rid, "created": int(time.time()), "model": self.config.model}
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(_watch_disconnect(receive, stop))
        events = _canned(9) if self.config.canned else self.pool.serve(prompt, limit, source, stop)
        empty = Outcome(self.pool.tokens(prompt))  # max_tokens 0: the prompt was still prefilled
        try:
            # aclosing: a send that fails mid-stream still ends the request's accounting at once.
            async with contextlib.aclosing(events) as steps:
                if req.get("stream"):
                    usage = bool((req.get("stream_options") or {}).get("include_usage"))
                    await self._stream(base, steps, empty, usage, send)
                else:
                    await self._whole(base, steps, empty, send)
        finally:
            watcher.cancel()

    def _metrics(self, out: Outcome) -> dict[str, Any]:
        return out.metrics(self.config.speculative and not self.config.canned, self.config.num_spec_tokens)

    async def _whole(self, base: dict[str, Any], steps: AsyncIterator[Any], out: Outcome, send: Any) -> None:
        async for out, _ in steps:  # noqa: B007 (the last outcome is the answer)
            pass
        message = {"role": "assistant", "content": out.text}
        choice = {"index": 0, "message": message, "finish_reason": out.finish_reason, "logprobs": None}
        body = {**base, "object": "chat.completion", "choices": [choice], "usage": out.usage()}
        await _send(send, 200, _dumps({**body, "metrics": self._metrics(out)}))

    async def _stream(
        self, base: dict[str, Any], steps: AsyncIterator[Any], out: Outcome, usage: bool, send: Any
    ) -> None:
        base = {**base, "object": "chat.completion.chunk"}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {**base, "choices": [choice]}

        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        await _event(send, chunk({"role": "assistant", "content": ""}))
        async for out, tokens in steps:  # noqa: B007 (the last outcome is the answer)
            await _event(send, chunk({"content": "".join(tokens)}))
        last = chunk({}, out.finish_reason)
        if usage:
            await _event(send, last)
            last = {**base, "choices": [], "usage": out.usage()}
        await _event(send, {**last, "metrics": self._metrics(out)})  # vLLM's: on the last chunk
        await _event(send, None)


async def _watch_disconnect(receive: Any, stop: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    stop.set()


def command(config: PoolConfig, port: int) -> list[str]:
    """The command line of a stub process on `port` (what `launch.running` starts)."""
    cli = [sys.executable, "-m", "specgate.gateway.cli.main", "bench", "stub", "--port", str(port)]
    return [*cli, *config.args()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    for f in dataclasses.fields(PoolConfig):
        flag, value = "--" + f.name.replace("_", "-"), f.default
        if isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            p.add_argument(flag, type=type(value), default=value)


def config_of(args: argparse.Namespace) -> PoolConfig:
    return PoolConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PoolConfig)})


def run(args: argparse.Namespace) -> int:
    import uvicorn

    # uvicorn's loop and http "auto": uvloop and httptools where they are installed (uvicorn[standard]).
    app = StubPoolApp(config_of(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", lifespan="off")
    return 0
