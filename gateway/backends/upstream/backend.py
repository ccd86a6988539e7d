"""Any OpenAI-compatible server as a backend: vLLM, SGLang, TGI, llama.cpp, Ollama, another specgate.

Retries (connection errors, 429, 5xx) happen only before the first byte reaches our client, with
exponential backoff that honours Retry-After; repeated failures open this backend's breaker.
Streams are relayed event by event as they arrive.

An upstream is not trusted to be well-behaved: bodies and SSE lines are bounded in size, a stream
must produce data events (comments and keep-alives do not reset its idle deadline, and nothing
extends its total one), bodies that are not JSON objects, chunks of the wrong shape, usage numbers
out of range and Retry-After values that are not finite all become a clean 502 / 503 (failing over
while nothing has reached the client). An upstream's own 401 / 403 is the gateway's credentials
failing, reported as a 502 that does not echo the upstream's message. A full local connection
pool is our limit, not the backend's fault: the breaker does not count it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from specgate.gateway.backends.base import BackendCall, RelayedChunk
from specgate.gateway.backends.breaker import CLOSED, CircuitBreaker
from specgate.gateway.backends.relay import RelayCall
from specgate.gateway.backends.upstream import responses_proxy
from specgate.gateway.backends.upstream.answers import (
    Malformed,
    error_from,
    json_object,
    listed_model_ids,
    read_capped,
    relayable,
    short_message,
    sse_data,
)
from specgate.gateway.backends.upstream.client import (
    PoolTimeout,
    Timeouts,
    TransportError,
    UpstreamClient,
    UpstreamResponse,
)
from specgate.gateway.backends.upstream.scrape import ScrapedLoad, ScrapeError, parse_metrics
from specgate.gateway.backends.upstream.stats import capture
from specgate.gateway.limits.limiters import Concurrency
from specgate.gateway.protocol import json_codec
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.settings import BackendSettings
from specgate.policies.load import BackendLoad

logger = logging.getLogger("specgate.backend")

_PATHS = {"chat": "/chat/completions", "completion": "/completions"}
_DROP = ("spec",)  # specgate's own request extensions are not forwarded


LATENCY_EWMA = 0.2  # weight of the newest response in the latency average
MAX_METRICS_BYTES = 4 * 2**20
# A scrape older than this many health intervals no longer stands for the backend's load.
STALE_INTERVALS = 3.0


def _parse(raw: bytes) -> ScrapedLoad:
    return parse_metrics(raw.decode("utf-8", "replace"))


class InFlight:
    """Requests this gateway has in flight at one backend: this process's count, or with `serve
    --workers N` the sum over every worker (shared memory: each worker's share alone would make a
    busy replica look idle to N-1 of them)."""

    __slots__ = ("_key", "_local", "_shared")

    def __init__(self, name: str, shared: Concurrency | None) -> None:
        self._local = 0
        self._shared = shared
        self._key = f"\x00backend\x00{name}"

    def enter(self) -> None:
        self._local += 1
        if self._shared is not None:
            self._shared.acquire(self._key, 0)

    def leave(self) -> None:
        self._local -= 1
        if self._shared is not None:
            self._shared.release(self._key)

    @property
    def count(self) -> int:
        return self._shared.count(self._key) if self._shared is not None else self._local


class OpenAIBackend:
    def __init__(
        self, settings: BackendSettings, client: UpstreamClient, shared: Concurrency | None = None
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self.external = True
        self.client = client
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_cooldown)
        self.discovered: list[str] = []
        self.probe_ok: bool | None = None
        self._in_flight = InFlight(settings.name, shared)
        # Its /metrics: the last good snapshot and when it was read, and why the last scrape failed.
        self.scraped: ScrapedLoad | None = None
        self.scraped_at = 0.0  # time.monotonic()
        self.scrape_error: str | None = None
        # Speculation counters at the previous good scrape: deltas give the recent acceptance.
        self._spec_prev: tuple[float, float] | None = None
        self.acceptance_length: float | None = None
        self.drafts_seen = False  # its counters have counted drafts: it speculates
        # Time to response headers, smoothed: the routing policy's view of this backend's latency.
        self.latency_ewma_ms: float | None = None
        self._probe_task: asyncio.Task[None] | None = None
        s = settings
        self._timeout = Timeouts(connect=s.connect_timeout, read=s.read_timeout)
        self._headers = {"authorization": f"Bearer {s.api_key.get_secret_value()}"} if s.api_key else {}

    def model_ids(self) -> list[str]:
        return list(self.settings.models) or list(self.discovered)

    def upstream_model(self, model: str) -> str:
        return self.settings.models.get(model, model)

    @property
    def healthy(self) -> bool:
        return self.breaker.state != "open" and self.probe_ok is not False

    @property
    def in_flight(self) -> int:
        return self._in_flight.count

    @property
    def speculation(self) -> str | None:
        """How it speculates: the declared method, "on" where its metrics show drafts but no
        method is declared, None where it does not (or is not known to)."""
        declared = self.settings.speculative
        if declared == "auto":
            return "on" if self.drafts_seen else None
        return None if declared == "off" else declared

    def fresh_scrape(self) -> ScrapedLoad | None:
        """The last scrape, if recent enough to stand for the backend's load now."""
        if self.scraped is None or self.scrape_error is not None:
            return None
        horizon = STALE_INTERVALS * max(self.settings.health_interval, 1.0)
        return self.scraped if time.monotonic() - self.scraped_at <= horizon else None

    def load(self) -> BackendLoad:
        snap = self.fresh_scrape()
        return BackendLoad(
            in_flight=self.in_flight,
            latency_ewma_ms=self.latency_ewma_ms,
            healthy=self.healthy,
            num_running=None if snap is None else snap.num_running,
            num_waiting=None if snap is None else snap.num_waiting,
            kv_cache_usage=None if snap is None else snap.kv_cache_usage,
            speculative=self.speculation is not None,
            acceptance_length=None if snap is None else self.acceptance_length,
        )

    def status(self) -> dict[str, Any]:
        snap, load = self.fresh_scrape(), self.load()
        return {
            "healthy": self.healthy,
            "breaker": self.breaker.state,
            "probe_ok": self.probe_ok,
            "in_flight": load.in_flight,
            "latency_ewma_ms": None if self.latency_ewma_ms is None else round(self.latency_ewma_ms, 2),
            "models": self.model_ids(),
            "replica_group": self.settings.replica_group,
            "speculation": self.speculation,
            "metrics": {
                "enabled": self.settings.scrape_metrics,
                "url": self.settings.metrics_endpoint,
                # What the router uses: the backend's own counts, or this gateway's in-flight count
                # where its scrape failed, lied, or is stale.
                "load_source": snap.source if snap is not None else "gateway",
                "error": self.scrape_error,
                "age_s": round(time.monotonic() - self.scraped_at, 1) if self.scraped is not None else None,
                "running": load.num_running,
                "waiting": load.num_waiting,
                "kv_usage": load.kv_cache_usage,
                "acceptance_length": load.acceptance_length,
            },
        }

    async def start(self) -> None:
        # A backend whose /models hangs must not hold up the gateway's start for a whole read timeout.
        try:
            await asyncio.wait_for(self.probe(), timeout=self.settings.connect_timeout + 1.0)
        except TimeoutError:
            self.probe_ok = False
        if self.settings.health_interval > 0:
            self._probe_task = asyncio.create_task(self._probe_loop())

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval)
            await self.probe()
            if self.settings.scrape_metrics:
                await self.scrape()

    async def scrape(self) -> bool:
        """GET its /metrics: its load for routing. A failure, or values that cannot be true, leave
        the router on this gateway's own counts and say why in `status()`."""
        s = self.settings
        try:
            async with asyncio.timeout(s.connect_timeout + max(s.health_interval, 1.0)):
                r = await self.client.send(
                    "GET", s.metrics_endpoint, headers=self._headers, timeout=self._timeout
                )
                try:
                    if r.status_code >= 400:
                        raise ScrapeError(f"answered {r.status_code}")
                    raw = await read_capped(r, MAX_METRICS_BYTES)
                finally:
                    await r.aclose()
            # Parsing a large exposition is CPU work: off the event loop.
            snap = await asyncio.to_thread(_parse, raw)
        except (ScrapeError, Malformed) as exc:
            return self._scrape_failed(str(exc))
        except Exception as exc:  # unreachable, timed out, cut off
            detail = str(exc)[:120]
            return self._scrape_failed(f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__)
        self._note_spec(snap)
        self.scraped, self.scraped_at, self.scrape_error = snap, time.monotonic(), None
        return True

    def _scrape_failed(self, reason: str) -> bool:
        if self.scrape_error != reason:
            logger.warning("backend %s: its /metrics were not used: %s", self.name, reason[:200])
        self.scrape_error = reason[:200]
        return False

    def _note_spec(self, snap: ScrapedLoad) -> None:
        drafts, accepted = snap.spec_drafts, snap.spec_accepted_tokens
        if snap.speculative:
            self.drafts_seen = True
        if snap.accept_length is not None:  # SGLang: a gauge of the mean, no counters
            self.acceptance_length = round(snap.accept_length, 4)
        if drafts is None or accepted is None:
            self._spec_prev = None
            return
        prev, self._spec_prev = self._spec_prev, (drafts, accepted)
        if prev is not None and drafts > prev[0] and accepted >= prev[1]:
            # Tokens per verification step: the accepted drafts plus the target's own token.
            self.acceptance_length = round(1.0 + (accepted - prev[1]) / (drafts - prev[0]), 4)

    async def probe(self) -> bool:
        """GET /models: marks the backend up or down and learns its models when none are configured."""
        try:
            url = f"{self.settings.base_url}/models"
            r = await self.client.send("GET", url, headers=self._headers, timeout=self._timeout)
            try:
                if r.status_code >= 400:
                    raise Malformed(f"answered {r.status_code}")
                raw = await read_capped(r, self.settings.max_response_bytes)
            finally:
                await r.aclose()
            ids = listed_model_ids(json.loads(raw))
        except Exception as exc:  # any failure means down; the reason goes to the log only
            if self.probe_ok is not False:
                logger.warning("backend %s failed its health probe: %s", self.name, type(exc).__name__)
            self.probe_ok = False
            return False
        self.discovered = ids
        if self.probe_ok is False and self.breaker.state != CLOSED:
            self.breaker.record_success()  # it answers again: let traffic through
        self.probe_ok = True
        return True

    # ---- calls --------------------------------------------------------------------------------

    def _payload(self, call: BackendCall) -> dict[str, Any]:
        body = {k: v for k, v in call.body.items() if k not in _DROP}
        body["model"] = self.upstream_model(call.model)
        if body.get("cache_salt") is not None:
            # The client's salt would partition the upstream's prefix cache across all our tenants:
            # it gets the call's own salt instead (the tenant's scope combined with the client's
            # salt), or, where the gateway shares cached prompts with nobody, a salt of its own.
            body["cache_salt"] = call.prefix_salt or f"once:{secrets.token_hex(16)}"
        if call.stream:
            # Always ask for usage so the gateway can count; the chunk is dropped if the client did not ask.
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return body

    async def _send(
        self, call: BackendCall | RelayCall, url: str | None = None, payload: bytes | None = None
    ) -> UpstreamResponse:
        """One response with a 2xx status, after retries; raises GatewayError otherwise. `url` and
        `payload`: a pass-through call's (`relay`); a completion's come from the call."""
        s = self.settings
        if url is None or payload is None:
            assert isinstance(call, BackendCall)
            url = f"{s.base_url}{_PATHS[call.kind]}"
            # Encoded once for every retry.
            payload = json_codec.encode(self._payload(call))
        last: GatewayError | None = None
        for attempt in range(s.max_retries + 1):
            if not self.breaker.allow(owner=call):
                raise GatewayError(
                    503,
                    f"backend {self.name} is unavailable (circuit open)",
                    retryable=True,
                    retry_after=self.breaker.retry_after(),
                )
            call.observed.attempts += 1
            call.observed.sent_time = time.time()  # the attempt that answers is the last one
            try:
                response = await self.client.send(
                    "POST", url, body=payload, headers=self._headers, timeout=self._timeout
                )
            except PoolTimeout:
                # Our own pool is full: no verdict on the backend, so the breaker is left alone.
                raise GatewayError(
                    503, "the gateway's connection pool is exhausted", code="gateway_busy", retryable=True
                ) from None
            except (TransportError, OSError) as exc:
                self.breaker.record_failure()
                last = GatewayError(
                    503, f"backend {self.name} is unreachable ({type(exc).__name__})", retryable=True
                )
            else:
                if response.status_code < 400:
                    return response
                if response.status_code in (401, 403):
                    await response.aclose()
                    # Our credentials for it are wrong: another backend may serve; never echo its text.
                    raise GatewayError(
                        502,
                        f"backend {self.name} refused the gateway's credentials ({response.status_code})",
                        code="upstream_auth_failed",
                        retryable=True,
                    )
                last = await error_from(response, self.name, s.max_response_bytes)
                if response.status_code >= 500:
                    self.breaker.record_failure()
                else:
                    self.breaker.record_success()  # it answered: the backend itself is fine
                if not last.retryable:
                    raise last
            wait = s.retry_backoff * 2**attempt
            if last.retry_after is not None:
                if last.retry_after > s.max_retry_wait:
                    break
                wait = max(wait, last.retry_after)
            if attempt < s.max_retries:
                await asyncio.sleep(wait)
        assert last is not None
        raise last

    def _broke_protocol(self, exc: Malformed) -> GatewayError:
        """A reply that breaks the protocol counts against the backend; another may serve."""
        self.breaker.record_failure()
        return GatewayError(502, f"backend {self.name} {exc}", code="bad_upstream_response", retryable=True)

    async def _timed_send(
        self, call: BackendCall | RelayCall, url: str | None = None, payload: bytes | None = None
    ) -> UpstreamResponse:
        t0 = time.perf_counter()
        response = await self._send(call, url, payload)
        ms = (time.perf_counter() - t0) * 1e3
        prev = self.latency_ewma_ms
        self.latency_ewma_ms = ms if prev is None else prev + LATENCY_EWMA * (ms - prev)
        return response

    async def complete(self, call: BackendCall) -> dict[str, Any]:
        try:
            body = await self._complete(call)
            if responses_proxy.proxies(self.settings, call):  # a Responses object, not a chat body
                responses_proxy.observe(body, call)
            return body
        finally:
            self.breaker.release(call)

    async def _fetch_json(
        self, call: BackendCall | RelayCall, url: str | None, payload: bytes | None
    ) -> dict[str, Any]:
        """The backend's whole JSON answer to one POST, within the total timeout and the response
        size bound; a transport failure or a timeout is a retryable 503 (and a breaker failure), a
        body that is not a JSON object a protocol break. A success closes the breaker's count."""
        self._in_flight.enter()
        try:
            async with asyncio.timeout(self.settings.total_timeout):
                response = await self._timed_send(call, url, payload)
                try:
                    raw = await read_capped(response, self.settings.max_response_bytes)
                finally:
                    await response.aclose()
            body = json_object(raw, response.headers.get("content-type", ""))
        except (TransportError, TimeoutError) as exc:
            self.breaker.record_failure()
            raise GatewayError(
                503, f"backend {self.name} failed ({type(exc).__name__})", retryable=True
            ) from exc
        except Malformed as exc:
            raise self._broke_protocol(exc) from None
        finally:
            self._in_flight.leave()
        self.breaker.record_success()
        self.probe_ok = True  # it served a request: as good as a health probe
        return body

    async def _complete(self, call: BackendCall) -> dict[str, Any]:
        body = await self._fetch_json(call, *responses_proxy.target(self.settings, call))
        capture(body, call.observed)
        # The whole answer arrives at once: its first token's time is known only if the backend
        # measured it (else None, and the record's TTFT and TPOT stay unknown rather than wrong).
        if call.observed.backend_ttft is not None:
            # Never later than the answer's arrival, whatever the backend claims.
            sent = call.observed.sent_time or time.time()
            call.observed.first_token_time = min(sent + call.observed.backend_ttft, time.time())
        body["model"] = call.model
        return body

    async def relay(self, call: RelayCall) -> dict[str, Any]:
        """A pass-through endpoint's JSON answer (embeddings, rerank, tokenize, ...), as the backend
        sent it but for its model's name: the same retries, breaker, size bound and error mapping
        as a completion, and none of its reading of choices and timings. A backend that does not
        serve the endpoint (404, 405) is passed over for the next candidate that may."""
        s = self.settings
        base = s.base_url.removesuffix("/v1") if call.root else s.base_url
        payload = json_codec.encode({**call.body, "model": self.upstream_model(call.model)})
        try:
            body = await self._fetch_json(call, f"{base}{call.path}", payload)
        except GatewayError as err:
            if err.status in (404, 405) and not err.retryable:
                err.retryable = True
            raise
        finally:
            self.breaker.release(call)
        if "model" in body:
            body["model"] = call.model
        return body

    async def stream(self, call: BackendCall) -> AsyncIterator[dict[str, Any]]:
        self._in_flight.enter()
        response: UpstreamResponse | None = None
        s = self.settings
        deadline = time.monotonic() + s.total_timeout
        total_bound = False  # whether the wait that timed out was cut by the total deadline
        proxied = responses_proxy.proxies(self.settings, call)  # Responses events, relayed as sent
        try:
            response = await self._timed_send(call, *responses_proxy.target(self.settings, call))
            ctype = response.headers.get("content-type", "")
            if "text/event-stream" not in ctype and ctype:
                raise Malformed(f"answered a stream request with {ctype[:64]!r}, not an event stream")
            events = aiter(sse_data(response, s.max_event_bytes))
            while True:
                # Idle: the next data event within read_timeout; total: the whole stream by its deadline.
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                # Which limit this wait runs to: uvloop's millisecond timers may fire just before the
                # deadline by time.monotonic(), so the clock alone cannot tell afterwards.
                total_bound = left <= s.read_timeout
                try:
                    async with asyncio.timeout(min(s.read_timeout, left)):
                        data = await anext(events)
                except StopAsyncIteration:
                    break
                if data == "[DONE]":
                    break
                chunk = json_object(data, "application/json", whole=False)
                if "error" in chunk:
                    err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
                    code = err.get("code")
                    raise GatewayError(
                        502,
                        f"backend {self.name}: {short_message(err.get('message', 'error'))}",
                        code=code if isinstance(code, str) else None,
                    )
                capture(chunk, call.observed)
                if proxied:
                    responses_proxy.observe_event(chunk, call, self.name)
                    yield RelayedChunk(chunk, b"data: " + data.encode() + b"\n\n")
                    continue
                if call.observed.first_token_time is None and chunk.get("choices"):
                    call.observed.first_token_time = time.time()
                if not (chunk.get("choices") or call.request.include_usage):
                    continue
                if chunk.get("model") == call.model and relayable(data, chunk):
                    yield RelayedChunk(chunk, b"data: " + data.encode() + b"\n\n")
                else:
                    chunk["model"] = call.model
                    yield chunk
            if call.observed.finish_reason is None:
                # An end with no finish reason is a stream cut short, not an answer: llama.cpp's
                # Python server, for one, ends a running stream with [DONE] when another request
                # arrives. Passing it on as complete would record a truncated answer as a success.
                raise GatewayError(
                    502,
                    f"backend {self.name} ended the stream before the answer finished",
                    code="incomplete_upstream_stream",
                    retryable=True,
                )
            self.breaker.record_success()
            self.probe_ok = True
        except TimeoutError:
            self.breaker.record_failure()
            total = total_bound or time.monotonic() >= deadline
            what = "exceeded its total timeout" if total else "sent no data in time"
            raise GatewayError(504, f"backend {self.name} {what}", code="timeout", retryable=True) from None
        except Malformed as exc:
            raise self._broke_protocol(exc) from None
        except TransportError as exc:
            self.breaker.record_failure()
            raise GatewayError(
                503, f"backend {self.name} failed mid-stream ({type(exc).__name__})", retryable=True
            ) from exc
        finally:
            self._in_flight.leave()
            self.breaker.release(call)
            if response is not None:
                await response.aclose()
