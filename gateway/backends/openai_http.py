"""Any OpenAI-compatible server as a backend: vLLM, SGLang, TGI, llama.cpp, Ollama, another specgate.

Retries (connection errors, 429, 5xx) happen only before the first byte reaches our client, with
exponential backoff that honours Retry-After; repeated failures open this backend's breaker.
Streams are relayed event by event as they arrive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx2

from gateway.backends.base import BackendCall, BackendError
from gateway.backends.breaker import CLOSED, CircuitBreaker
from gateway.backends.upstream_stats import capture
from gateway.settings import BackendSettings

logger = logging.getLogger("specgate.backend")

_PATHS = {"chat": "/chat/completions", "completion": "/completions"}
_DROP = ("spec",)  # specgate's own request extensions are not forwarded


LATENCY_EWMA = 0.2  # weight of the newest response in the latency average


class OpenAIBackend:
    def __init__(self, settings: BackendSettings, client: httpx2.AsyncClient) -> None:
        self.settings = settings
        self.name = settings.name
        self.client = client
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_cooldown)
        self.discovered: list[str] = []
        self.probe_ok: bool | None = None
        self.in_flight = 0
        # Time to response headers, smoothed: the routing policy's view of this backend's latency.
        self.latency_ewma_ms: float | None = None
        self._probe_task: asyncio.Task[None] | None = None
        s = settings
        self._timeout = httpx2.Timeout(
            connect=s.connect_timeout, read=s.read_timeout, write=s.read_timeout, pool=s.connect_timeout
        )
        self._headers = {"authorization": f"Bearer {s.api_key.get_secret_value()}"} if s.api_key else {}

    def model_ids(self) -> list[str]:
        return list(self.settings.models) or list(self.discovered)

    def upstream_model(self, model: str) -> str:
        return self.settings.models.get(model, model)

    @property
    def healthy(self) -> bool:
        return self.breaker.state != "open" and self.probe_ok is not False

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
            r = await self.client.get(
                f"{self.settings.base_url}/models", headers=self._headers, timeout=self._timeout
            )
            r.raise_for_status()
            ids = [str(m["id"]) for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]
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
        if call.stream:
            # Always ask for usage so the gateway can count; the chunk is dropped if the client did not ask.
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return body

    async def _send(self, call: BackendCall) -> httpx2.Response:
        """One response with a 2xx status, after retries; raises BackendError otherwise."""
        s = self.settings
        url = f"{s.base_url}{_PATHS[call.kind]}"
        payload = self._payload(call)
        last: BackendError | None = None
        for attempt in range(s.max_retries + 1):
            if not self.breaker.allow(owner=call):
                raise BackendError(
                    503,
                    f"backend {self.name} is unavailable (circuit open)",
                    retryable=True,
                    retry_after=self.breaker.retry_after(),
                )
            call.observed.attempts += 1
            try:
                request = self.client.build_request(
                    "POST", url, json=payload, headers=self._headers, timeout=self._timeout
                )
                response = await self.client.send(request, stream=True)
            except (httpx2.TransportError, OSError) as exc:
                self.breaker.record_failure()
                last = BackendError(
                    503, f"backend {self.name} is unreachable ({type(exc).__name__})", retryable=True
                )
            else:
                if response.status_code < 400:
                    return response
                last = await _error_from(response, self.name)
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

    async def _timed_send(self, call: BackendCall) -> httpx2.Response:
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
                    raw = await response.aread()
                finally:
                    await response.aclose()
        except (httpx2.TransportError, TimeoutError) as exc:
            self.breaker.record_failure()
            raise BackendError(
                503, f"backend {self.name} failed ({type(exc).__name__})", retryable=True
            ) from exc
        finally:
            self.in_flight -= 1
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            self.breaker.record_failure()
            raise BackendError(
                502, f"backend {self.name} sent a body that is not JSON", retryable=True
            ) from exc
        self.breaker.record_success()
        self.probe_ok = True  # it served a request: as good as a health probe
        call.observed.first_token_time = time.time()
        capture(body, call.observed)
        body["model"] = call.model
        return body

    async def stream(self, call: BackendCall) -> AsyncIterator[dict[str, Any]]:
        self.in_flight += 1
        response: httpx2.Response | None = None
        deadline = time.monotonic() + self.settings.total_timeout
        try:
            response = await self._timed_send(call)
            async for data in _sse_data(response):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = (
                        chunk["error"]
                        if isinstance(chunk["error"], dict)
                        else {"message": str(chunk["error"])}
                    )
                    raise BackendError(
                        502, f"backend {self.name}: {err.get('message', 'error')}", code=err.get("code")
                    )
                capture(chunk, call.observed)
                if call.observed.first_token_time is None and chunk.get("choices"):
                    call.observed.first_token_time = time.time()
                chunk["model"] = call.model
                if chunk.get("choices") or call.request.include_usage:
                    yield chunk
                if time.monotonic() > deadline:
                    raise BackendError(504, f"backend {self.name} exceeded its total timeout", code="timeout")
            self.breaker.record_success()
            self.probe_ok = True
        except (httpx2.TransportError, json.JSONDecodeError) as exc:
            self.breaker.record_failure()
            raise BackendError(
                503, f"backend {self.name} failed mid-stream ({type(exc).__name__})", retryable=True
            ) from exc
        finally:
            self.in_flight -= 1
            self.breaker.release(call)
            if response is not None:
                await response.aclose()


async def _sse_data(response: httpx2.Response) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream (multi-line data joined with newlines)."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            lines.append(line[5:].lstrip(" "))
    if lines:
        yield "\n".join(lines)


async def _error_from(response: httpx2.Response, name: str) -> BackendError:
    status = response.status_code
    try:
        raw = await response.aread()
    finally:
        await response.aclose()
    message, code, param, etype = f"backend {name} answered {status}", None, None, None
    try:
        err = json.loads(raw).get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            code, param, etype = err.get("code"), err.get("param"), err.get("type")
        elif isinstance(err, str):
            message = err
    except (json.JSONDecodeError, AttributeError):
        pass
    retry_after = _retry_after(response.headers.get("retry-after"))
    retryable = status == 429 or status >= 500
    return BackendError(
        status,
        message,
        code=code if isinstance(code, str) else None,
        param=param,
        retryable=retryable,
        retry_after=retry_after,
        error_type=etype,
    )


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
