"""A scripted OpenAI-compatible upstream for the gateway's external-backend tests.

`FakeUpstream` serves GET /v1/models, POST /v1/chat/completions and POST /v1/completions (and the
pass-through endpoints: /v1/embeddings, /v1/rerank, /tokenize, /detokenize) on a free loopback port,
from its own event loop in a background thread. It answers normally (a JSON body,
or an SSE stream when the request says `stream: true`) unless a test scripted the next answers:

    fake.script(Reply.error(503), Reply.error(429, retry_after="1"))  # the next two POSTs
    fake.script(Reply.hang(), Reply.drop(), Reply.stream_error(after=2))

It records every POST it receives (`fake.received`: path, headers, JSON body) and counts the
health probes (`fake.probes`). It can be stopped and started again on the same port.

GET /metrics answers 404 (as any unknown path) unless a test sets what it serves:

    fake.metrics_text = "vllm:num_requests_running 3\n..."  # 200, text/plain
    fake.metrics_reply = Reply.hang()  # or Reply.error(500), Reply.raw(...), Reply.drop(): wins over the text

and counts the scrapes (`fake.scrapes`).

It is a small HTTP/1.1 server over asyncio streams and h11 rather than an ASGI app, so that it can
misbehave at the socket level the way real servers do: close the connection before sending a
single byte, or in the middle of a chunked stream.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from specgate.gateway.settings import BackendSettings, Settings
from tests.gateway.live import TEST_ADMIN_KEY, LiveGateway, start_gateway

PROMPT_TOKENS = 7
# The pass-through endpoints it serves (with `passthrough` on): vLLM's paths, /tokenize below the root.
PASSTHROUGH = ("/v1/embeddings", "/v1/rerank", "/tokenize", "/detokenize")
EMBEDDING_DIM = 4

# One client for the tests' plain HTTP calls (a new httpx.Client costs tens of milliseconds).
HTTP = httpx.Client(timeout=20)


@dataclass
class Reply:
    """One scripted answer to a POST. Build it with the class methods."""

    kind: str = "ok"  # ok | error | hang | drop | stream_drop | stream_error | raw
    status: int = 200
    message: str = "scripted failure"
    code: str | None = None
    param: str | None = None
    type: str | None = None
    retry_after: str | None = None
    text: str | None = None  # the answer's text; the upstream's default text if None
    after: int = 1  # content chunks sent before a mid-stream failure
    extra: dict[str, Any] = field(default_factory=dict)  # merged into the body, or the stream's last chunk
    usage: dict[str, Any] = field(default_factory=dict)  # merged into the usage object (body or tail chunk)
    tool_calls: list[dict[str, Any]] | None = None
    # raw: the answer exactly as given (status, headers, body chunks), for misbehaving upstreams.
    headers: list[tuple[str, str]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    every: float = 0.0  # seconds between chunks
    forever: bool = False  # repeat the chunks until the upstream stops

    @classmethod
    def ok(cls, text: str | None = None, **kw: Any) -> Reply:
        return cls("ok", text=text, **kw)

    @classmethod
    def error(cls, status: int, message: str = "scripted failure", **kw: Any) -> Reply:
        return cls("error", status=status, message=message, **kw)

    @classmethod
    def raw(
        cls,
        status: int = 200,
        chunks: list[bytes] | bytes = b"",
        headers: list[tuple[str, str]] | None = None,
        every: float = 0.0,
        forever: bool = False,
    ) -> Reply:
        """Send exactly this: a status, headers and body chunks (chunked encoding), as a broken or
        hostile server would."""
        body = [chunks] if isinstance(chunks, bytes) else chunks
        return cls("raw", status=status, headers=headers or [], chunks=body, every=every, forever=forever)

    @classmethod
    def hang(cls) -> Reply:
        """Read the request, then never answer (until the upstream stops)."""
        return cls("hang")

    @classmethod
    def drop(cls) -> Reply:
        """Read the request, then close the connection without sending a byte."""
        return cls("drop")

    @classmethod
    def stream_drop(cls, after: int = 1) -> Reply:
        """Stream `after` content chunks, then close the connection mid-body (no terminating chunk)."""
        return cls("stream_drop", after=after)

    @classmethod
    def stream_error(cls, after: int = 1, message: str = "upstream exploded", **kw: Any) -> Reply:
        """Stream `after` content chunks, then a `data: {"error": ...}` event, then end the stream."""
        return cls("stream_error", after=after, message=message, **kw)


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


class FakeUpstream:
    def __init__(
        self,
        models: tuple[str, ...] = ("fake-model",),
        text: str = "Hello from the fake upstream.",
        port: int = 0,
    ) -> None:
        self.models = list(models)
        self.text = text
        self.port = port
        self.models_status = 200  # what GET /v1/models answers
        self.received: list[Received] = []
        self.probes = 0
        # GET /metrics: None answers 404, as before metrics existed; `metrics_reply` wins over the text.
        self.metrics_text: str | None = None
        self.metrics_reply: Reply | None = None
        self.scrapes = 0
        # Serve the pass-through endpoints (PASSTHROUGH); False: 404 for them, as a chat-only server.
        self.passthrough = True
        self._script: deque[Reply] = deque()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._release: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    # ---- control, from the test's thread ------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def running(self) -> bool:
        return self._thread is not None

    def script(self, *replies: Reply) -> None:
        """Queue answers for the next POSTs, in order; once they are used up, answer normally."""
        with self._lock:
            self._script.extend(replies)

    def reset(self) -> None:
        """Forget the script and what was received (for an upstream shared by several tests)."""
        with self._lock:
            self._script.clear()
            self.received.clear()
        self.models_status = 200
        self.metrics_text = self.metrics_reply = None

    def posts(self, path: str | None = None) -> list[Received]:
        with self._lock:
            return [r for r in self.received if path is None or r.path.endswith(path)]

    def start(self) -> FakeUpstream:
        assert self._thread is None, "already running"
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=loop.run_forever, name=f"fake-upstream-{self.port}", daemon=True
        )
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), loop).result(10)
        return self

    def stop(self) -> None:
        """Close the listening socket and every open connection (hung answers included)."""
        if self._thread is None or self._loop is None:
            return
        loop = self._loop
        asyncio.run_coroutine_threadsafe(self._close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        loop.close()
        self._thread = self._loop = None

    def __enter__(self) -> FakeUpstream:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the server, on its own loop ----------------------------------------------------------

    async def _open(self) -> None:
        self._release = asyncio.Event()
        self._server = await asyncio.start_server(
            self._connection, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _close(self) -> None:
        assert self._server is not None and self._release is not None
        self._server.close()
        self._release.set()
        for writer in list(self._writers):
            writer.transport.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, raw = await _read_request(conn, reader)
                if request is None:
                    return
                if not await self._answer(conn, writer, request, raw):
                    return
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError):
            pass
        except asyncio.CancelledError:  # stop(): end quietly (streams log a cancelled handler task)
            pass
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.transport.abort()

    async def _answer(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, req: h11.Request, raw: bytes
    ) -> bool:
        """Answer one request; False when the connection must not be used again."""
        method, path = req.method.decode(), req.target.decode().split("?")[0]
        if method == "GET" and path == "/v1/models":
            self.probes += 1
            data = [{"id": m, "object": "model", "owned_by": "fake"} for m in self.models]
            await _send_json(conn, writer, self.models_status, {"object": "list", "data": data})
            return True
        if method == "GET" and path == "/metrics" and (self.metrics_reply or self.metrics_text) is not None:
            self.scrapes += 1
            return await self._metrics(conn, writer)
        served = ("/v1/chat/completions", "/v1/completions", *(PASSTHROUGH if self.passthrough else ()))
        if method != "POST" or path not in served:
            await _send_json(conn, writer, 404, _error_body("not found", "not_found_error"))
            return True
        try:
            body = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            body = None
        headers = {k.decode().lower(): v.decode() for k, v in req.headers}
        with self._lock:
            self.received.append(Received(method, path, headers, body))
            reply = self._script.popleft() if self._script else Reply()
        misbehaved = await self._misbehave(conn, writer, reply)
        if misbehaved is not None:
            return misbehaved
        if reply.kind == "error":
            headers_out = [("retry-after", reply.retry_after)] if reply.retry_after is not None else []
            err = _error_body(reply.message, reply.type, reply.code, reply.param)
            await _send_json(conn, writer, reply.status, err, headers_out)
            return True
        body = body if isinstance(body, dict) else {}
        if path in PASSTHROUGH:
            await _send_json(conn, writer, 200, _passthrough_answer(path, body, reply))
            return True
        chat = path.endswith("/chat/completions")
        if body.get("stream"):
            return await self._stream(conn, writer, body, chat, reply)
        await _send_json(conn, writer, 200, self._completion(body, chat, reply))
        return True

    async def _misbehave(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, reply: Reply
    ) -> bool | None:
        """A hang, a dropped connection or raw bytes, as scripted (whether the connection may be
        reused); None for any other kind of reply."""
        if reply.kind == "hang":
            assert self._release is not None
            await self._release.wait()
            return False
        if reply.kind == "drop":
            writer.transport.abort()
            return False
        if reply.kind != "raw":
            return None
        writer.write(conn.send(h11.Response(status_code=reply.status, headers=reply.headers)))
        while True:
            for part in reply.chunks:
                if part:
                    writer.write(conn.send(h11.Data(data=part)))
                await writer.drain()
                if reply.every:
                    await asyncio.sleep(reply.every)
            if not reply.forever:
                break
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
        return True

    async def _metrics(self, conn: h11.Connection, writer: asyncio.StreamWriter) -> bool:
        """GET /metrics as set: the scripted reply (hang, drop, error or raw), else the text."""
        reply = self.metrics_reply
        if reply is None:
            raw = (self.metrics_text or "").encode()
            headers = [("content-type", "text/plain; version=0.0.4"), ("content-length", str(len(raw)))]
            writer.write(conn.send(h11.Response(status_code=200, headers=headers)))
            writer.write(conn.send(h11.Data(data=raw)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
            return True
        misbehaved = await self._misbehave(conn, writer, reply)
        if misbehaved is not None:
            return misbehaved
        err = _error_body(reply.message, reply.type, reply.code, reply.param)
        await _send_json(conn, writer, reply.status if reply.kind == "error" else 500, err)
        return True

    def _pieces(self, reply: Reply) -> list[str]:
        text = self.text if reply.text is None else reply.text
        words = text.split(" ")
        return [w if i == 0 else " " + w for i, w in enumerate(words)]

    def _completion(self, body: dict[str, Any], chat: bool, reply: Reply) -> dict[str, Any]:
        pieces = self._pieces(reply)
        text = "".join(pieces)
        finish = "tool_calls" if reply.tool_calls else "stop"
        choice: dict[str, Any]
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": None if reply.tool_calls else text}
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        out = {
            "id": "fake-1",
            "object": "chat.completion" if chat else "text_completion",
            "created": 1700000000,
            "model": body.get("model"),
            "choices": [choice],
            "usage": {**_usage(len(pieces)), **reply.usage},
        }
        out.update(reply.extra)
        return out

    async def _stream(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        body: dict[str, Any],
        chat: bool,
        reply: Reply,
    ) -> bool:
        model = body.get("model")
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: dict[str, Any] | None, text: str = "", finish: str | None = None) -> dict[str, Any]:
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta or {},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return {"id": "fake-1", "object": obj, "created": 1700000000, "model": model, "choices": [choice]}

        headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        writer.write(conn.send(h11.Response(status_code=200, headers=headers)))  # chunked: no length
        events: list[dict[str, Any]] = []
        if chat:
            events.append(chunk({"role": "assistant", "content": ""}))
        pieces = self._pieces(reply)
        events.extend(chunk({"content": p}, p) for p in pieces)
        if reply.kind in ("stream_drop", "stream_error"):
            events = events[: reply.after + (1 if chat else 0)]
        elif reply.tool_calls:
            calls = [{**tc, "index": i} for i, tc in enumerate(reply.tool_calls)]
            events.append(chunk({"tool_calls": calls}))
        for event in events:
            await _send_event(conn, writer, event)
        if reply.kind == "stream_drop":
            writer.transport.abort()
            return False
        if reply.kind == "stream_error":
            await _send_event(conn, writer, _error_body(reply.message, reply.type, reply.code, reply.param))
        else:
            last = chunk({}, "", "tool_calls" if reply.tool_calls else "stop")
            last.update(reply.extra)
            await _send_event(conn, writer, last)
            if (body.get("stream_options") or {}).get("include_usage"):
                tail: dict[str, Any] = {
                    "id": "fake-1",
                    "object": obj,
                    "created": 1700000000,
                    "model": model,
                    "choices": [],
                }
                tail["usage"] = {**_usage(len(pieces)), **reply.usage}
                await _send_event(conn, writer, tail)
            await _send_data(conn, writer, b"[DONE]")
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
        return True


def fake_embedding(item: Any) -> list[float]:
    """The fake's embedding of one input: its length, then fixed values (what a test can predict)."""
    return [float(len(item)), 0.5, -0.25, 1.0][:EMBEDDING_DIM]


def _passthrough_answer(path: str, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
    """vLLM's answers: embeddings (float or base64, as asked), rerank, tokenize (one token per
    character; llama.cpp's shape for `content`), detokenize."""
    out: dict[str, Any]
    if path == "/v1/embeddings":
        raw = body.get("input")
        items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw or [])
        data = []
        for i, item in enumerate(items):
            vec: Any = fake_embedding(item)
            if body.get("encoding_format") == "base64":
                vec = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vec})
        tokens = sum(len(item) for item in items)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, **reply.usage}
        out = {"object": "list", "model": body.get("model"), "data": data, "usage": usage}
    elif path == "/v1/rerank":
        docs = body.get("documents") or []
        results = [{"index": i, "relevance_score": 1.0 / (i + 1)} for i in range(len(docs))]
        out = {"id": "rerank-1", "model": body.get("model"), "results": results, "usage": {"total_tokens": 3}}
    elif path == "/tokenize":
        text = body.get("content", body.get("prompt")) or ""
        ids = [ord(c) for c in text]
        vllm = {"count": len(ids), "max_model_len": 4096, "tokens": ids}
        out = {"tokens": ids} if "content" in body else vllm
    else:
        out = {"prompt": "".join(chr(t) for t in body.get("tokens") or [])}
    out.update(reply.extra)
    return out


def _usage(completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": completion_tokens,
        "total_tokens": PROMPT_TOKENS + completion_tokens,
    }


def _error_body(
    message: str, type_: str | None = None, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_ or "server_error", "param": param, "code": code}}


async def _read_request(
    conn: h11.Connection, reader: asyncio.StreamReader
) -> tuple[h11.Request | None, bytes]:
    request: h11.Request | None = None
    body: list[bytes] = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return request, b"".join(body)
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None, b""


async def _send_json(
    conn: h11.Connection,
    writer: asyncio.StreamWriter,
    status: int,
    obj: Any,
    headers: list[tuple[str, str]] | None = None,
) -> None:
    raw = json.dumps(obj).encode()
    hs = [("content-type", "application/json"), ("content-length", str(len(raw))), *(headers or [])]
    writer.write(conn.send(h11.Response(status_code=status, headers=hs)))
    writer.write(conn.send(h11.Data(data=raw)))
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()


async def _send_data(conn: h11.Connection, writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(conn.send(h11.Data(data=b"data: " + data + b"\n\n")))
    await writer.drain()


async def _send_event(conn: h11.Connection, writer: asyncio.StreamWriter, obj: Any) -> None:
    await _send_data(conn, writer, json.dumps(obj).encode())


# ---- helpers for tests that put a gateway in front of fakes -------------------------------------


def backend(name: str, target: FakeUpstream | str, **overrides: Any) -> BackendSettings:
    """Backend settings for a fake upstream (or any base URL), with knobs small enough for fast tests."""
    knobs: dict[str, Any] = dict(
        connect_timeout=1.0,
        read_timeout=5.0,
        total_timeout=20.0,
        max_retries=2,
        retry_backoff=0.01,
        max_retry_wait=2.0,
        breaker_failures=3,
        breaker_cooldown=30.0,
        health_interval=0.0,
    )
    if isinstance(target, FakeUpstream):
        knobs["models"] = list(target.models)
    knobs.update(overrides)
    base_url = target.base_url if isinstance(target, FakeUpstream) else target
    return BackendSettings(name=name, base_url=base_url, **knobs)


def external_settings(*backends: BackendSettings, **overrides: Any) -> Settings:
    """Gateway settings with no embedded engine, only the given external backends (and the test
    admin key, which /readyz's details need)."""
    overrides.setdefault("admin_key", TEST_ADMIN_KEY)
    return Settings(
        embedded={"enabled": False}, backends=list(backends), port=0, log_requests=False, **overrides
    )


@contextmanager
def running_gateway(
    *backends: BackendSettings, wait_ready: bool = True, **overrides: Any
) -> Iterator[LiveGateway]:
    """A live gateway in front of the given backends, stopped on exit."""
    live = start_gateway(external_settings(*backends, **overrides), wait_ready=wait_ready, timeout=30)
    try:
        yield live
    finally:
        live.stop()


def openai_client(live: LiveGateway, timeout: float = 20.0) -> openai.OpenAI:
    # max_retries=0: the client must see exactly what the gateway answered, not retry on its own.
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="client-key", max_retries=0, timeout=timeout)


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one Prometheus sample in a /metrics page, or None if there is no such sample."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None
