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
from specgate.gateway.backends.upstream.stats import capture
from specgate.gateway.protocol import json_codec
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.settings import BackendSettings
from specgate.policies.load import BackendLoad

logger = logging.getLogger("specgate.backend")

_PATHS = {"chat": "/chat/completions", "completion": "/completions"}
_DROP = ("spec",)  # specgate's own request extensions are not forwarded


LATENCY_EWMA = 0.2  # weight of the newest response in the latency average


class OpenAIBackend:
    def __init__(self, settings: BackendSettings, client: UpstreamClient) -> None:
        self.settings = settings
        self.name = settings.name
        self.external = True
        self.client = client
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_cooldown)
        self.discovered: list[str] = []
        self.probe_ok: bool | None = None
        self.in_flight = 0
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

    def load(self) -> BackendLoad:
        return BackendLoad(self.in_flight, self.latency_ewma_ms, self.healthy)

    def status(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "breaker": self.breaker.state,
            "probe_ok": self.probe_ok,
            "in_flight": self.in_flight,
            "latency_ewma_ms": None if self.latency_ewma_ms is None else round(self.latency_ewma_ms, 2),
            "models": self.model_ids(),
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

    async def _send(self, call: BackendCall) -> UpstreamResponse:
        """One response with a 2xx status, after retries; raises GatewayError otherwise."""
        s = self.settings
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

    async def _timed_send(self, call: BackendCall) -> UpstreamResponse:
        t0 = time.perf_counter()
        response = await self._send(call)
        ms = (time.perf_counter() - t0) * 1e3
        prev = self.latency_ewma_ms
        self.latency_ewma_ms = ms if prev is None else prev + LATENCY_EWMA * (ms - prev)
        return response

    async def complete(self, call: BackendCall) -> dict[str, Any]:
        try:
            return await self._complete(call)
        finally:
            self.breaker.release(call)

    async def _complete(self, call: BackendCall) -> dict[str, Any]:
        self.in_flight += 1
        try:
            async with asyncio.timeout(self.settings.total_timeout):
                response = await self._timed_send(call)
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
            self.in_flight -= 1
        self.breaker.record_success()
        self.probe_ok = True  # it served a request: as good as a health probe
        call.observed.first_token_time = time.time()
        capture(body, call.observed)
        body["model"] = call.model
        return body

    async def stream(self, call: BackendCall) -> AsyncIterator[dict[str, Any]]:
        self.in_flight += 1
        response: UpstreamResponse | None = None
        s = self.settings
        deadline = time.monotonic() + s.total_timeout
        total_bound = False  # whether the wait that timed out was cut by the total deadline
        try:
            response = await self._timed_send(call)
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
                if call.observed.first_token_time is None and chunk.get("choices"):
                    call.observed.first_token_time = time.time()
                if not (chunk.get("choices") or call.request.include_usage):
                    continue
                if chunk.get("model") == call.model and relayable(data, chunk):
                    yield RelayedChunk(chunk, b"data: " + data.encode() + b"\n\n")
                else:
                    chunk["model"] = call.model
                    yield chunk
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
            self.in_flight -= 1
            self.breaker.release(call)
            if response is not None:
                await response.aclose()
