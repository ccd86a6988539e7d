"""A stub OpenAI-compatible inference server whose cost is a scripted model: routing has consequences.

    python bench/stub_pool.py --port 8001 [--speculative] [--model pool-model] [--time-scale 1.0]
        [--max-running 64] [--cache-blocks 4096] [--metrics-flavor vllm|llamacpp]
        [--metrics-mode ok|nan|negative|absurd|garbage|slow|404]   (every knob: --help)

No model runs: each request sleeps as a batching server would make it wait, so that which pool or
replica a gateway picks shows in wall time. The cost model (times in ms, multiplied by --time-scale):

- admission: at most `max_running` requests run; the others wait, FIFO (`num_requests_waiting`);
- prefill: `prefill_base_ms + uncached prompt tokens x prefill_ms_per_token`, one request at a
  time (prefill is compute-bound: a server's prefills queue behind each other); its end is the first
  token. A prompt is its messages rendered as text, ~`chars_per_token` characters a token;
- decode, in steps: a plain server's step costs `step_base_ms + step_per_seq_ms x running` and
  emits one token; a speculative one verifies K = `num_spec_tokens` drafts per sequence, so its step
  costs `step_base_ms + step_per_seq_ms x running x (1 + K x verify_share)` and emits 1 + the
  accepted drafts: each draft in turn accepted with probability p = accept_base + accept_copy x
  copyability until the first rejection (a truncated geometric), copyability being the share of
  the prompt's word 3-grams that occurred earlier in it, saturated at `copy_saturation` (the
  gateway's own feature's definition: code and documents quoted for a summary repeat themselves,
  a question or a creative brief does not). Speculation thus pays at a small batch on a copyable
  prompt and loses at a large one or on prose. With the defaults (K = 4): alone, 2.9x plain's
  speed at full copyability (p 0.85), 2.0x at p 0.66, 0.87x on prose (p 0.1); the batch from
  which it is slower than plain: 28, 9 and 1 running. A 64-token answer takes ~1.4 s (plain,
  alone).
- prefix cache: an LRU of `cache_blocks` blocks of `block_tokens` tokens (chained hashes of the
  rendered prompt's characters); a prompt's leading cached blocks skip prefill and are reported as
  `usage.prompt_tokens_details.cached_tokens`. After a request, its prompt and answer are cached
  (rendered as the next turn would render them). 0 blocks: no cache.

Per request, vLLM-style `metrics` (its PerRequestMetrics) in a non-streamed body and in the last
stream chunk: `{"queue_time_ms", "time_to_first_token_ms" (from admission, so the queue is not in
it, as vLLM counts it), "generation_time_ms", "mean_itl_ms", "speculative_decoding":
{"num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "acceptance_histogram"}}`
(histogram[i]: steps that accepted i drafts; `speculative_decoding` only on a speculative server).
The answer copies the prompt's words, `max_tokens` of them (default `default_max_tokens`),
finish_reason "length".

Endpoints: POST /v1/chat/completions and /v1/completions (JSON, or SSE with one event per decode
step and a usage chunk when `stream_options.include_usage`), GET /v1/models, /health, /stats (JSON
counters) and /metrics: vLLM's names (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, prefix-cache queries and hits, and on a speculative server
`vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`,
`..._num_accepted_tokens_per_pos_total`), or llama.cpp server's (`--metrics-flavor llamacpp`:
`llamacpp:requests_processing`, `llamacpp:requests_deferred`, its token and draft counters). Hostile
/metrics for tests (`--metrics-mode`): nan (every value NaN), negative, absurd (1e30 and the like),
garbage (not Prometheus text), slow (answers after `metrics_delay_s`, not scaled), 404.

Python: `PoolConfig`, `Pool` (the cost model and counters, no I/O), `make_app` (a raw ASGI app),
`ThreadServer` (uvicorn in a thread, for tests), `launch_pool` (its own process, as stub_backend's
`launch` runs one; what benchmarks use, so the stub does not share the harness's interpreter).
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
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from specgate.policies.features import copyability  # the gateway's own feature, read the same way

METRICS_FLAVORS = ("vllm", "llamacpp")
METRICS_MODES = ("ok", "nan", "negative", "absurd", "garbage", "slow", "404")
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_TEXT = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
FILLER = ["the", "of", "and", "to", "a", "in", "that", "is", "for", "it", "as", "with", "on", "this"]


@dataclass
class PoolConfig:
    """Every knob of one stub server; each is a command-line flag of the same name (dashes)."""

    model: str = "stub-pool"
    name: str = "stub"  # this server's name in /stats and response ids
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
    max_waiting: int = 4096  # beyond: 503 with Retry-After
    cache_blocks: int = 4096  # prefix cache capacity in blocks (0: none)
    block_tokens: int = 16
    chars_per_token: float = 4.0
    kv_tokens: int = 262_144  # KV capacity for kv_cache_usage_perc
    default_max_tokens: int = 256
    time_scale: float = 1.0  # multiplies every modelled duration (tests run faster)
    seed: int = 0
    metrics_flavor: Literal["vllm", "llamacpp"] = "vllm"
    metrics_mode: Literal["ok", "nan", "negative", "absurd", "garbage", "slow", "404"] = "ok"
    metrics_delay_s: float = 5.0  # the `slow` mode's delay, wall seconds

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.num_spec_tokens < 1 or self.block_tokens < 1:
            raise ValueError("max_running, num_spec_tokens and block_tokens must be >= 1")
        if self.metrics_flavor not in METRICS_FLAVORS or self.metrics_mode not in METRICS_MODES:
            raise ValueError(f"metrics_flavor in {METRICS_FLAVORS}, metrics_mode in {METRICS_MODES}")
        if min(self.time_scale, self.chars_per_token) <= 0 or self.cache_blocks < 0:
            raise ValueError("time_scale and chars_per_token must be > 0, cache_blocks >= 0")

    def args(self) -> list[str]:
        """This config as command-line flags (what differs from the defaults)."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + f.name.replace("_", "-"))
            else:
                out += [flag, str(value)]
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


class PrefixCache:
    """LRU over chained block hashes of a text: what a paged-KV prefix cache would hold."""

    def __init__(self, capacity: int, block_chars: int) -> None:
        self.capacity = capacity
        self.block_chars = block_chars
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def hashes(self, text: str) -> list[bytes]:
        out, h = [], b""
        for i in range(len(text) // self.block_chars):
            chunk = text[i * self.block_chars : (i + 1) * self.block_chars]
            h = hashlib.blake2b(h + chunk.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            out.append(h)
        return out

    def match(self, text: str) -> int:
        """Leading blocks of `text` held (touched as used)."""
        n = 0
        for h in self.hashes(text):
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, text: str) -> None:
        if self.capacity == 0:
            return
        for h in self.hashes(text):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)


@dataclass
class Outcome:
    """One request's result: its tokens in emission order (one list per event) and its metrics."""

    prompt_tokens: int
    cached_tokens: int
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
        out: dict[str, Any] = {
            "queue_time_ms": round(self.queue_ms, 3),
            "time_to_first_token_ms": round(self.ttft_ms, 3),
            "generation_time_ms": round(self.generation_ms, 3),
            "mean_itl_ms": round(self.generation_ms / (n - 1), 3) if n > 1 else None,
        }
        if speculative:
            accepted = sum(i * c for i, c in enumerate(self.histogram))
            out["speculative_decoding"] = {
                "num_spec_steps": self.spec_steps,
                "num_draft_tokens": self.spec_steps * k,
                "num_accepted_draft_tokens": accepted,
                "acceptance_histogram": list(self.histogram),
            }
        return out

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Overloaded(Exception):
    pass


class Pool:
    """The scripted server: admission, prefill, decode steps, prefix cache and counters."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.cache = PrefixCache(config.cache_blocks, self.block_chars)
        self.running = 0
        self.waiting = 0
        self.kv_tokens_used = 0
        self._slots: asyncio.Semaphore | None = None
        self._prefill: asyncio.Lock | None = None
        # Counters, as a server's /metrics would count them.
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated = 0
        self.decode_steps = 0
        self.cache_queries = 0
        self.cache_hits = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_pos = [0] * config.num_spec_tokens

    @property
    def block_chars(self) -> int:
        return max(1, round(self.config.block_tokens * self.config.chars_per_token))

    def tokens(self, text: str) -> int:
        return max(1, math.ceil(len(text) / self.config.chars_per_token))

    def acceptance(self, copy: float) -> float:
        c = self.config
        level = min(1.0, copy / c.copy_saturation) if c.copy_saturation > 0 else 1.0
        return min(0.98, max(0.0, c.accept_base + c.accept_copy * level))

    def step_ms(self, running: int) -> float:
        """One decode step's duration with `running` sequences in the batch (time scale applied)."""
        c = self.config
        per_seq = c.step_per_seq_ms * running
        if c.speculative:
            per_seq *= 1 + c.num_spec_tokens * c.verify_share
        return (c.step_base_ms + per_seq) * c.time_scale

    def tokens_per_step(self, p: float) -> float:
        """Expected tokens a step emits at acceptance `p`: 1 on a plain server."""
        if not self.config.speculative:
            return 1.0
        k = self.config.num_spec_tokens
        return sum(p**i for i in range(k + 1))  # 1 + sum of P(the first i drafts accepted)

    def ms_per_token(self, running: int, copy: float) -> float:
        """Expected decode milliseconds per output token at a batch of `running` (the cost model)."""
        return self.step_ms(running) / self.tokens_per_step(self.acceptance(copy))

    def prefill_ms(self, uncached_tokens: int) -> float:
        c = self.config
        return (c.prefill_base_ms + uncached_tokens * c.prefill_ms_per_token) * c.time_scale

    def kv_usage(self) -> float:
        return min(1.0, self.kv_tokens_used / self.config.kv_tokens)

    async def serve(
        self,
        prompt: str,
        max_tokens: int,
        source: str | None = None,
        cache_suffix: str = "",
        stop: asyncio.Event | None = None,
    ) -> AsyncGenerator[tuple[str, Outcome, list[str]], None]:
        """Run one request; yields ("first" | "step", outcome, the event's tokens) as they are due.

        `prompt`: the rendered prompt (its length and blocks); `source`: the text the answer copies
        and copyability reads (default: the prompt); `cache_suffix`: how the answer is rendered
        when a later turn resends it ("{answer}" in it), cached after the request."""
        c = self.config
        if self.waiting >= c.max_waiting:
            raise Overloaded
        if self._slots is None:
            self._slots, self._prefill = asyncio.Semaphore(c.max_running), asyncio.Lock()
        assert self._prefill is not None
        t0 = time.perf_counter()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        prompt_tokens = self.tokens(prompt)
        reserved = prompt_tokens
        self.kv_tokens_used += reserved
        try:
            self.requests += 1
            out = Outcome(prompt_tokens, 0, queue_ms=(time.perf_counter() - t0) * 1e3)
            out.histogram = [0] * (c.num_spec_tokens + 1)
            rng = random.Random(_seed(c.seed, prompt))
            text = prompt if source is None else source
            words = _answer_words(text, rng)
            p = self.acceptance(copyability(text))
            async with self._prefill:
                # Matched when its turn comes: a prefill just ahead of it may have cached its prefix.
                blocks = self.cache.match(prompt) if c.cache_blocks else 0
                self.cache_queries += prompt_tokens
                # The last prompt token is always computed (it yields the first output token).
                cached = min(blocks * c.block_tokens, (prompt_tokens - 1) // c.block_tokens * c.block_tokens)
                out.cached_tokens = cached
                self.cache_hits += cached
                self.prompt_tokens += prompt_tokens
                self.cached_tokens += cached
                await asyncio.sleep(self.prefill_ms(prompt_tokens - cached) / 1e3)
                self.cache.insert(prompt)
            first = time.perf_counter()
            out.ttft_ms = (first - t0) * 1e3 - out.queue_ms
            if max_tokens <= 0:
                out.finish_reason = "length"
                return
            emitted = [words[0]]
            out.pieces.append(emitted)
            self._account(1)
            reserved += 1
            yield "first", out, emitted
            due = time.perf_counter()
            while out.completion_tokens < max_tokens:
                if stop is not None and stop.is_set():
                    out.finish_reason = "abort"
                    return
                due += self.step_ms(self.running) / 1e3
                n = 1
                if c.speculative:
                    accepted = 0
                    while accepted < c.num_spec_tokens and rng.random() < p:
                        accepted += 1
                    out.spec_steps += 1
                    out.histogram[accepted] += 1
                    self.drafts += 1
                    self.draft_tokens += c.num_spec_tokens
                    self.accepted += accepted
                    for i in range(accepted):
                        self.accepted_per_pos[i] += 1
                    n = accepted + 1
                n = min(n, max_tokens - out.completion_tokens)
                start = out.completion_tokens
                emitted = [words[(start + i) % len(words)] for i in range(n)]
                # Absolute deadlines: event-loop lateness of one step does not add up over steps.
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                self.decode_steps += 1
                out.pieces.append(emitted)
                self._account(n)
                reserved += n
                out.generation_ms = (time.perf_counter() - first) * 1e3
                yield "step", out, emitted
            out.finish_reason = "length"
            self.cache.insert(prompt + cache_suffix.format(answer=out.text))
        finally:
            self.kv_tokens_used -= reserved
            self.running -= 1
            self._slots.release()

    def _account(self, n: int) -> None:
        self.generated += n
        self.kv_tokens_used += n

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.config.name,
            "speculative": self.config.speculative,
            "running": self.running,
            "waiting": self.waiting,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated,
            "decode_steps": self.decode_steps,
            "cache_blocks_held": len(self.cache),
            "kv_cache_usage": self.kv_usage(),
            "num_drafts": self.drafts,
            "num_draft_tokens": self.draft_tokens,
            "num_accepted_tokens": self.accepted,
        }

    def metrics_text(self) -> str:
        """Prometheus text exposition in the configured flavor, values as the mode distorts them."""
        c = self.config
        if c.metrics_flavor == "llamacpp":
            counters = {
                "prompt_tokens_total": self.prompt_tokens - self.cached_tokens,
                "prompt_tokens_cached_total": self.cached_tokens,
                "tokens_predicted_total": self.generated,
                "n_decode_total": self.decode_steps,
                "spec_decode_num_draft_tokens_total": self.draft_tokens,
                "spec_decode_num_accepted_tokens_total": self.accepted,
                "spec_decode_num_drafts_total": self.drafts,
            }
            gauges = {
                "requests_processing": self.running,
                "requests_deferred": self.waiting,
                "n_busy_slots_per_decode": self.running,
            }
            lines = []
            for kind, items in (("counter", counters), ("gauge", gauges)):
                for name, value in items.items():
                    lines += [
                        f"# HELP llamacpp:{name} {name}",
                        f"# TYPE llamacpp:{name} {kind}",
                        f"llamacpp:{name} {self._value(float(value))}",
                    ]
            return "\n".join(lines) + "\n"
        labels = f'engine="0",model_name="{c.model}"'
        series: list[tuple[str, str, str, float | int]] = [
            ("num_requests_running", "gauge", labels, self.running),
            ("num_requests_waiting", "gauge", labels, self.waiting),
            ("kv_cache_usage_perc", "gauge", labels, self.kv_usage()),
            ("prefix_cache_queries_total", "counter", labels, self.cache_queries),
            ("prefix_cache_hits_total", "counter", labels, self.cache_hits),
            ("prompt_tokens_total", "counter", labels, self.prompt_tokens),
            ("generation_tokens_total", "counter", labels, self.generated),
        ]
        if c.speculative:
            series += [
                ("spec_decode_num_drafts_total", "counter", labels, self.drafts),
                ("spec_decode_num_draft_tokens_total", "counter", labels, self.draft_tokens),
                ("spec_decode_num_accepted_tokens_total", "counter", labels, self.accepted),
            ]
        lines = []
        for name, kind, lab, number in series:
            lines += [f"# HELP vllm:{name} {name}", f"# TYPE vllm:{name} {kind}"]
            lines.append(f"vllm:{name}{{{lab}}} {self._value(float(number))}")
        if c.speculative:
            name = "spec_decode_num_accepted_tokens_per_pos_total"
            lines += [f"# HELP vllm:{name} {name}", f"# TYPE vllm:{name} counter"]
            for i, v in enumerate(self.accepted_per_pos):
                lines.append(f'vllm:{name}{{{labels},position="{i}"}} {self._value(float(v))}')
        return "\n".join(lines) + "\n"

    def _value(self, value: float) -> str:
        mode = self.config.metrics_mode
        if mode == "nan":
            return "NaN"
        if mode == "negative":
            return repr(-(value + 5.0))
        if mode == "absurd":
            return "1e+30"
        return repr(value)


def _seed(seed: int, prompt: str) -> int:
    digest = hashlib.blake2b(f"{seed}\x00{prompt}".encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "big")


def _answer_words(source: str, rng: random.Random) -> list[str]:
    """The answer's tokens: the source's words from a random point, as a model that copies would
    write them (filler words where there are none)."""
    words = source.split() or FILLER
    start = rng.randrange(len(words))
    ordered = words[start:] + words[:start]
    return [" " + w for w in ordered]


async def _read_body(receive: Any) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = _JSON) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length]})
    await send({"type": "http.response.body", "body": body})


def _error(message: str, kind: str = "invalid_request_error") -> bytes:
    return _dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})


class StubPoolApp:
    """The raw ASGI app around one `Pool`."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.pool = Pool(config)
        self._ids = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                await send({"type": kind + ".complete"})
                if kind == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET":
            await self._get(path, send)
            return
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            await _send(send, 404, _error("not found", "not_found_error"))
            return
        try:
            req = json.loads(await _read_body(receive))
        except ConnectionResetError:
            return
        except ValueError:
            await _send(send, 400, _error("the body is not JSON"))
            return
        if not isinstance(req, dict):
            await _send(send, 400, _error("the body must be a JSON object"))
            return
        await self._complete(path == "/v1/chat/completions", req, receive, send)

    async def _get(self, path: str, send: Any) -> None:
        c = self.config
        if path == "/v1/models":
            data = [{"id": c.model, "object": "model", "owned_by": "stub-pool", "created": 0}]
            await _send(send, 200, _dumps({"object": "list", "data": data}))
        elif path == "/health":
            await _send(send, 200, b"{}")
        elif path == "/stats":
            await _send(send, 200, _dumps(self.pool.stats()))
        elif path == "/metrics":
            mode = c.metrics_mode
            if mode == "404":
                await _send(send, 404, b"404 page not found\n", _TEXT)
                return
            if mode == "slow":
                await asyncio.sleep(c.metrics_delay_s)
            if mode == "garbage":
                body = b"<html>\x00\xff\xfe not prometheus {{{ vllm:num_requests_running= \n\x1b[0m"
                await _send(send, 200, body + bytes(range(256)), _TEXT)
                return
            await _send(send, 200, self.pool.metrics_text().encode(), _TEXT)
        else:
            await _send(send, 404, _error("not found", "not_found_error"))

    async def _complete(self, chat: bool, req: dict[str, Any], receive: Any, send: Any) -> None:
        c = self.config
        if chat:
            messages = req.get("messages")
            if not isinstance(messages, list) or not messages:
                await _send(send, 400, _error("messages must be a non-empty list"))
                return
            msgs = [m for m in messages if isinstance(m, dict)]
            prompt = render_chat(msgs) + "<|assistant|>\n"
            suffix = "{answer}\n"  # the answer as the next turn renders it: content, then "\n"
            source = "\n".join(_content(m.get("content")) for m in msgs)
        else:
            raw = req.get("prompt")
            prompt = raw if isinstance(raw, str) else json.dumps(raw)
            suffix, source = "{answer}", prompt
        limit = req.get("max_completion_tokens") or req.get("max_tokens") or c.default_max_tokens
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            await _send(send, 400, _error("max_tokens must be a non-negative integer"))
            return
        self._ids += 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{c.name}-{self._ids}"
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(_watch_disconnect(receive, stop))
        try:
            if req.get("stream"):
                include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
                await self._stream(chat, rid, (prompt, source, suffix), limit, include_usage, send, stop)
            else:
                await self._whole(chat, rid, (prompt, source, suffix), limit, send, stop)
        except Overloaded:
            body = _error("too many requests waiting", "server_overloaded")
            headers = [*_JSON, (b"retry-after", b"1")]
            await _send(send, 503, body, headers)
        finally:
            watcher.cancel()

    def _base(self, chat: bool, rid: str) -> dict[str, Any]:
        kind = "chat.completion" if chat else "text_completion"
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.config.model}

    def _run(
        self, what: tuple[str, str, str], limit: int, stop: asyncio.Event
    ) -> contextlib.aclosing[AsyncGenerator[tuple[str, Outcome, list[str]], None]]:
        prompt, source, suffix = what
        # aclosing: a send that fails mid-stream still ends the request's accounting at once.
        return contextlib.aclosing(self.pool.serve(prompt, limit, source, suffix, stop))

    async def _whole(
        self, chat: bool, rid: str, what: tuple[str, str, str], limit: int, send: Any, stop: asyncio.Event
    ) -> None:
        prompt = what[0]
        out: Outcome | None = None
        async with self._run(what, limit, stop) as events:
            async for event in events:
                out = event[1]
        if out is None:  # max_tokens 0: the prompt was still prefilled; an empty answer
            out = Outcome(self.pool.tokens(prompt), 0)
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        body = {
            **self._base(chat, rid),
            "choices": [choice],
            "usage": out.usage(),
            "metrics": out.metrics(self.config.speculative, self.config.num_spec_tokens),
        }
        await _send(send, 200, _dumps(body))

    async def _stream(
        self,
        chat: bool,
        rid: str,
        what: tuple[str, str, str],
        limit: int,
        include_usage: bool,
        send: Any,
        stop: asyncio.Event,
    ) -> None:
        base = {**self._base(chat, rid), "object": "chat.completion.chunk" if chat else "text_completion"}

        def event(payload: dict[str, Any]) -> dict[str, Any]:
            return {
                "type": "http.response.body",
                "body": b"data: " + _dumps(payload) + b"\n\n",
                "more_body": True,
            }

        def choice(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if role:
                delta["role"] = "assistant"
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

        # The first event (errors can no longer change the status) only once admitted and prefilled:
        # a 503 for a full queue must still be possible.
        started = False
        out: Outcome | None = None
        async with self._run(what, limit, stop) as events:
            async for _, outcome, tokens in events:
                out = outcome
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
                    if chat:
                        await send(event({**base, "choices": [choice("", None, role=True)]}))
                    started = True
                await send(event({**base, "choices": [choice("".join(tokens), None)]}))
        if out is None:
            out = Outcome(self.pool.tokens(what[0]), 0)
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        metrics = out.metrics(self.config.speculative, self.config.num_spec_tokens)
        last: dict[str, Any] = {**base, "choices": [choice(None, out.finish_reason)]}
        if include_usage:
            await send(event(last))
            last = {**base, "choices": [], "usage": out.usage()}
        last["metrics"] = metrics  # vLLM puts its per-request metrics on the last chunk
        await send(event(last))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _watch_disconnect(receive: Any, stop: asyncio.Event) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stop.set()
            return


def make_app(config: PoolConfig) -> StubPoolApp:
    return StubPoolApp(config)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThreadServer:
    """A stub pool on uvicorn in a daemon thread of this process (tests): `with ThreadServer(cfg) as s`."""

    def __init__(self, config: PoolConfig, port: int | None = None) -> None:
        import uvicorn

        self.app = make_app(config)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, name=f"stub-pool-{config.name}", daemon=True)

    @property
    def pool(self) -> Pool:
        return self.app.pool

    def start(self) -> ThreadServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the stub pool did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def __enter__(self) -> ThreadServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_pool(
    config: PoolConfig, port: int | None = None, log: Path | None = None, timeout: float = 60.0
) -> tuple[subprocess.Popen[bytes], str]:
    """Run a stub pool as its own process; (the process, its base URL without /v1) once it answers."""
    import httpx

    port = port or free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--port", str(port), *config.args()]
    out = log.open("ab") if log is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log is not None and not isinstance(out, int):
            out.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"stub pool {config.name} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"stub pool {config.name} did not answer at {url}")


def parse_args(argv: list[str] | None = None) -> tuple[PoolConfig, str, int]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    defaults = PoolConfig()
    for f in dataclasses.fields(PoolConfig):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        if isinstance(value, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        elif f.name == "metrics_flavor":
            ap.add_argument(flag, choices=METRICS_FLAVORS, default=value)
        elif f.name == "metrics_mode":
            ap.add_argument(flag, choices=METRICS_MODES, default=value)
        else:
            ap.add_argument(flag, type=type(value), default=value)
    ns = vars(ap.parse_args(argv))
    host, port = ns.pop("host"), ns.pop("port")
    return PoolConfig(**ns), host, port


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    config, host, port = parse_args(argv)
    try:
        import uvloop  # noqa: F401

        loop, http = "uvloop", "httptools"
    except ImportError:
        loop, http = "asyncio", "h11"
    uvicorn.run(make_app(config), host=host, port=port, loop=loop, http=http, log_level="warning")


if __name__ == "__main__":
    main()
