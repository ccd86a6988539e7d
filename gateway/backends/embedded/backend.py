"""The embedded engine as a backend: OpenAI requests in, engine requests out, and back again."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from specgate.engine.model_source import resolve_model
from specgate.engine.outputs import RequestOutput, RequestStats, TokenLogprob
from specgate.engine.vocab import SpecParams
from specgate.gateway.backends.base import BackendCall
from specgate.gateway.backends.embedded.chat_template import check_template
from specgate.gateway.backends.embedded.chunks import (
    Answer,
    ChunkWriter,
    final_body,
    final_stats,
    metrics_of,
    usage_of,
)
from specgate.gateway.backends.embedded.prompt import Prepared, prepare, prompt_chars
from specgate.gateway.engine_core.client import EngineCoreClient, InprocClient, connect, start_in_process
from specgate.gateway.engine_core.messages import EngineUnavailable
from specgate.gateway.engine_core.model_info import ModelInfo
from specgate.gateway.protocol import openai_format as fmt
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.settings import EmbeddedSettings
from specgate.policies.load import BackendLoad

if TYPE_CHECKING:  # torch: imported where an engine is built (this process's own, or the core's)
    from specgate.engine.config import EngineConfig
    from specgate.engine.engine import Engine

logger = logging.getLogger("specgate.embedded")
TOKENIZE_OFF_LOOP_CHARS = 8192  # bigger requests are rendered and tokenized in a worker thread


class EmbeddedBackend:
    def __init__(
        self, settings: EmbeddedSettings, cache_dir: str | None = None, engine_socket: str | None = None
    ) -> None:
        self.settings = settings
        # Set in a worker of `specgate serve`: the shared engine core's socket (SocketClient); that
        # core is the supervisor's to start and restart, so this backend only reconnects. None: the
        # engine core runs on a thread of this process (InprocClient).
        self.engine_socket = engine_socket
        self.name = settings.name
        self.external = False
        self._cache_dir = settings.convert_cache_dir or cache_dir
        source = resolve_model(settings.model, settings.gguf_file)  # cheap: no weights read
        check_template(settings.chat_template)  # a bad one stops the start, not every chat request
        self.served_name = settings.served_model_name or source.name
        # The client of the engine core: on a thread here, or shared by the workers of `serve`.
        self.client: EngineCoreClient | None = None
        self.model: ModelInfo | None = None  # what requests are validated and tokenized against
        self.load_error: str | None = None
        self.restarts = 0  # engine threads replaced, or core connections remade, after they ended
        self._loading: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closing = False
        self._ids = itertools.count()
        self._token_text: Callable[[int], str] = str  # the engine's per-token text, once it is loaded
        # Speculation methods this engine can run (a draft model or an EAGLE head may be missing).
        self.methods: list[str] = []

    @property
    def engine(self) -> Engine | None:
        """The engine object, in process only (the shared core's lives in another process)."""
        return self.client.engine if isinstance(self.client, InprocClient) else None

    def model_ids(self) -> list[str]:
        return [self.served_name, *self.settings.aliases]

    @property
    def healthy(self) -> bool:
        return self.client is not None and self.client.ready

    def load(self) -> BackendLoad:
        """In flight: this process's requests in the engine (its batch and queue: `Load` has them),
        a request with n > 1 counting its n sequences."""
        client = self.client
        n = sum(client.in_engine.values()) if client is not None else 0
        return BackendLoad(n, None, self.healthy, external=False)

    def status(self) -> dict[str, Any]:
        w = self.client
        if w is not None:
            state = w.state if w.alive else "restarting"
        else:
            state = "failed" if self.load_error else "loading"
        out: dict[str, Any] = {"state": state, "healthy": self.healthy}
        if self.load_error:
            out["error"] = self.load_error
        if w is not None:
            out["num_waiting"] = w.num_waiting
            out["num_running"] = w.load.num_running
            out["rebuilds"] = w.rebuilds + self.restarts
            if w.last_error:
                out["last_error"] = w.last_error
        return out

    async def start(self) -> None:
        """Loads the model in a thread; requests get 503 until it is ready."""
        self._loading = asyncio.create_task(self._load())

    def _config(self) -> EngineConfig:
        return self.settings.engine_config(self._cache_dir)

    def _build(self) -> Engine:
        """A fresh engine (first load, and every rebuild after the old one broke)."""
        from specgate.engine.engine import Engine  # torch: only where the engine runs in process

        return Engine(self._config())

    async def _load(self) -> None:
        try:
            self.client = await self._connect()
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            logger.exception("embedded engine failed to load")
            return
        self._watchdog = asyncio.create_task(self._watch())
        assert self.model is not None
        info, where = self.model, "shared core" if self.engine_socket is not None else "own thread"
        logger.info(
            "embedded engine ready: %s (%s on %s, %s)", self.served_name, info.dtype, info.device, where
        )

    async def _connect(self) -> EngineCoreClient:
        """A client of a loaded engine core (first start, and every restart after one ended)."""
        loop = asyncio.get_running_loop()
        client: EngineCoreClient
        if self.engine_socket is not None:
            client, info = await connect(self.engine_socket, loop)
        else:
            client, info = await start_in_process(self._build, loop)
        # Chat is rendered here, in each process that serves requests, with the configured template.
        self.model = dataclasses.replace(info, chat_template=self.settings.chat_template)
        self.methods = info.methods
        # One cache per model load: logprobs name the same tokens request after request.
        tokenizer = info.tokenizer
        self._token_text = functools.lru_cache(maxsize=4096)(lambda t: tokenizer.decode([t]))
        return client

    async def _watch(self, interval: float = 0.5) -> None:
        """If the engine core's thread, or the connection to the shared core, ever ends on its own,
        fail its waiters (retryable) and start another; a start that fails is retried with backoff.
        With a shared core, "start another" is connecting again (the supervisor restarts the core)."""
        backoff = 1.0
        while not self._closing:
            await asyncio.sleep(interval)
            w = self.client
            if w is None or w.alive or self._closing:
                continue
            logger.error("the embedded engine core ended; starting a new one")
            w.fail_waiters(EngineUnavailable("the embedded engine restarted"))
            try:
                client = await self._connect()
            except Exception as exc:
                self.load_error = f"{type(exc).__name__}: {exc}"
                logger.exception("restarting the embedded engine failed; retrying in %.0f s", backoff)
                await asyncio.sleep(backoff)
                backoff = min(60.0, backoff * 2)
                continue
            backoff = 1.0
            self.load_error = None
            self.restarts += 1
            self.client = client

    async def close(self) -> None:
        self._closing = True
        # A start in progress is abandoned (a connection being made to the shared core is closed).
        for task in (self._watchdog, self._loading):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait([task])
        if self.client is not None:
            await self.client.close()

    # ---- serving ------------------------------------------------------------------------------

    def _ready_client(self, tenant: str = "") -> EngineCoreClient:
        w = self.client
        if w is None or not w.ready:
            if w is not None:
                msg = "the embedded engine is restarting after a failure"
            elif self.load_error is None:
                msg = "the embedded model is still loading"
            else:
                msg = "the embedded model failed to load"
            raise GatewayError(503, msg, code="model_not_ready", retryable=True, retry_after=2)
        if w.num_waiting >= self.settings.max_waiting and not self._under_fair_share(w, tenant):
            raise GatewayError(
                503, "the embedded engine is overloaded", code="overloaded", retryable=True, retry_after=1
            )
        return w

    def _under_fair_share(self, w: EngineCoreClient, tenant: str) -> bool:
        """Whether a full queue still takes this tenant's request: it holds less than an equal share
        of the engine (batch slots and queue) among the tenants with requests in it. One tenant
        cannot fill the queue for everyone else; the queue then grows at most to twice its size."""
        if w.num_waiting >= 2 * self.settings.max_waiting:
            return False
        held = w.in_engine
        tenants = len(held) + (tenant not in held)
        capacity = self.settings.max_waiting + self.settings.max_num_seqs
        return held[tenant] < capacity / tenants

    async def _submit(self, call: BackendCall) -> tuple[Prepared, asyncio.Queue[Any]]:
        client = self._ready_client(call.tenant)
        model = self.model
        assert model is not None  # set before any client is
        # What rendering and tokenizing may cost grows with the body as sent (everything the chat
        # template renders is in it); requests made without one are measured field by field.
        size = call.body_bytes or prompt_chars(call.request)
        if size > TOKENIZE_OFF_LOOP_CHARS:
            prep = await asyncio.to_thread(prepare, call, model)  # a big request: off the loop
            client = self._ready_client(call.tenant)
        else:
            prep = prepare(call, model)
        spec = self._spec_params(call)
        call.observed.prompt_tokens = len(prep.prompt_ids)
        call.observed.grammar = prep.params.grammar.kind if prep.params.grammar is not None else None
        call.engine_id = f"{call.request_id}#{next(self._ids)}"
        q = client.submit(
            call.engine_id,
            prep.prompt_ids,
            prep.params,
            spec,
            call.cache_scope,
            call.prefix_salt,
            call.tenant,
        )
        return prep, q

    def _spec_params(self, call: BackendCall) -> SpecParams | None:
        s = call.spec
        if s is None or s.method == "off":
            return None
        known = self.model.known_methods if self.model is not None else []
        if s.method not in known:
            msg = f"unknown speculation method {s.method!r}; known: off, {', '.join(known)}"
            raise GatewayError(400, msg, code="invalid_spec_method", param="spec.method")
        return s

    async def _outputs(
        self, call: BackendCall, q: asyncio.Queue[Any], n: int = 1
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs, its n sequences' interleaved, until all n have finished."""
        finished = False
        unfinished = n
        try:
            while True:
                item = await q.get()
                if isinstance(item, EngineUnavailable):
                    finished = True
                    raise GatewayError(
                        503, str(item), code="engine_restarting", retryable=True, retry_after=2
                    )
                if isinstance(item, BaseException):
                    finished = True
                    status = 400 if isinstance(item, ValueError) else 500
                    code = getattr(item, "code", "engine_error")
                    raise GatewayError(status, str(item), code=code)
                if item.error is not None:
                    finished = True
                    raise GatewayError(
                        500, f"the engine failed this request: {item.error}", code="engine_error"
                    )
                if call.observed.first_token_time is None and item.new_token_ids:
                    call.observed.first_token_time = time.time()
                # Known once the prompt is scheduled: a request cancelled later still reports it. The
                # first sequence prefilled the prompt (the others started on its blocks).
                if item.index == 0:
                    call.observed.cached_tokens = item.num_cached_tokens
                unfinished -= item.finished
                finished = not unfinished
                yield item
                if finished:
                    return
        finally:
            if not finished and self.client is not None:
                self.client.abort(call.engine_id)  # client gone or cancelled: free the KV blocks now

    def _observe_final(self, call: BackendCall, finals: list[RequestOutput]) -> None:
        """The request's counts, all of its sequences together (one request, one record): completion
        tokens and speculation counters summed, the first choice's finish reason."""
        obs = call.observed
        each = final_stats(finals)
        stats = each[0] if len(each) == 1 else RequestStats.merged(each)
        obs.n = len(finals)
        obs.finish_reason = finals[0].finish_reason
        obs.completion_tokens = stats.num_output_tokens
        obs.queue_time = stats.queue_time
        obs.spec_decoding = fmt.spec_decoding(stats)
        if stats.spec is not None:
            obs.spec_steps = list(stats.spec.steps)

    async def complete(self, call: BackendCall) -> dict[str, Any]:
        prep, q = await self._submit(call)
        texts: list[list[str]] = [[] for _ in range(prep.n)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(prep.n)]
        finals: dict[int, RequestOutput] = {}
        async for out in self._outputs(call, q, prep.n):
            texts[out.index].append(out.new_text)
            lps[out.index].extend(out.logprobs or [])
            if out.finished:
                finals[out.index] = out
        last = [finals[i] for i in range(prep.n)]
        self._observe_final(call, last)
        stats = final_stats(last)
        answers: list[Answer] = [("".join(texts[i]), lps[i], o.finish_reason) for i, o in enumerate(last)]
        body = final_body(call, prep, answers, usage_of(prep, stats), self._token_text)
        body["metrics"] = metrics_of(call, stats)
        return body

    async def stream(self, call: BackendCall) -> AsyncIterator[dict[str, Any]]:
        prep, q = await self._submit(call)
        chunks = ChunkWriter(call, prep, self._token_text)
        outputs = self._outputs(call, q, prep.n)
        try:
            async for out in outputs:
                for chunk in chunks.write(out):
                    yield chunk
                if out.finished:
                    last = chunks.finish(out)
                    if chunks.done:  # the last choice finished: the request is over
                        self._observe_final(call, [chunks.finals[i] for i in range(prep.n)])
                    for chunk in last:
                        yield chunk
        finally:
            await outputs.aclose()
