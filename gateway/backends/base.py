"""What every backend offers the gateway, and what a call to one carries and leaves behind."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from specgate.engine.vocab import SpecParams, SpecStep
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.policies.load import BackendLoad

Kind = Literal["chat", "completion"]
# The inference routes, as telemetry names them: a Responses API request runs as a chat call.
Endpoint = Literal["chat", "completion", "responses"]


@dataclass(slots=True)
class Observation:
    """What a backend saw while serving one call; the gateway turns it into metrics and a record."""

    backend: str = ""
    # time.time() of the first content byte; None when unknown (a non-streamed external call whose
    # backend did not report its own time to first token): never the whole request's time.
    first_token_time: float | None = None
    # What an external backend measured itself (vLLM `metrics`, llama.cpp `timings`, SGLang
    # `meta_info`, specgate's `metrics`), in seconds: its time to first token and time per output
    # token. A non-streamed call's TTFT and TPOT come from these; None: the backend did not say.
    backend_ttft: float | None = None
    backend_tpot: float | None = None
    sent_time: float | None = None  # time.time() the last attempt went to an external backend
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # Prompt tokens served from a prefix cache (usage.prompt_tokens_details.cached_tokens); None
    # when the backend did not say.
    cached_tokens: int | None = None
    queue_time: float | None = None  # seconds waiting for a batch slot (embedded, or as a backend said)
    # Speculation counters in vLLM's vocabulary (embedded engine, or parsed from the backend).
    spec_decoding: dict[str, Any] | None = None
    grammar: str | None = None  # the kind of output constraint the backend enforced; None: none
    # Raw timing / speculation fields a backend reported: vLLM `metrics`, SGLang `meta_info`,
    # llama.cpp `timings`.
    upstream: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0  # upstream attempts made, retries included
    # Per verification step, as the engine measured it; embedded engine only.
    spec_steps: list[SpecStep] = field(default_factory=list)
    # Choices the backend generated for the call (the embedded engine's n > 1: the counts above
    # cover all of them; the record's time per output token is each choice's).
    n: int = 1


@dataclass(slots=True)
class BackendCall:
    request_id: str
    kind: Kind
    model: str  # the public model name the client asked for
    body: dict[str, Any]  # the client's body as validated, unknown fields kept
    request: ChatCompletionRequest | CompletionRequest
    created: int  # unix seconds, the response's `created`
    spec: SpecParams | None = None  # how the embedded engine should speculate (router's choice)
    route: RouteDecision | None = None  # the routing decision, echoed in `metrics.route`
    observed: Observation = field(default_factory=Observation)
    engine_id: str = ""  # the embedded engine's id for this call
    # Whose drafting state this call may share (the suffix cache): a tenant, or None for nobody's.
    cache_scope: str | None = None
    # Whose cached prompt blocks (the prefix cache) this call may reuse: the tenant's scope, salted
    # further by the client's `cache_salt`; None for nobody's.
    prefix_salt: str | None = None
    # Whom the call is for (an API key's id, or a client address in open mode): the embedded
    # engine shares its batch slots and queue fairly between tenants.
    tenant: str = ""
    body_bytes: int = 0  # the size of the request body as sent: what tokenizing it may cost
    # A Responses API request: the body an upstream serving that API itself (`responses_api`) gets
    # instead of the chat body; `responses_proxied` once such an upstream answered in its shape.
    responses_body: dict[str, Any] | None = None
    responses_proxied: bool = False

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)


class Backend(Protocol):
    name: str
    external: bool  # False only for the embedded engine (which speculates as the route says)

    def model_ids(self) -> list[str]:
        """Public model names this backend serves now."""
        ...

    @property
    def healthy(self) -> bool:
        """Whether requests should be sent here now (breaker closed or half-open, probe not failing)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def complete(self, call: BackendCall) -> dict[str, Any]:
        """The whole OpenAI response body (non-streaming)."""
        ...

    def stream(self, call: BackendCall) -> AsyncIterator[dict[str, Any]]:
        """OpenAI chunk bodies, in order. Failures before the first chunk raise `GatewayError`."""
        ...

    def status(self) -> dict[str, Any]:
        """Health and load for /readyz and metrics."""
        ...

    def load(self) -> BackendLoad:
        """This backend's load as the router reads it: requests this gateway process has in flight
        there, its recent latency, its health."""
        ...


class RelayedChunk(dict[str, Any]):
    """A stream chunk as parsed, carrying the SSE event it arrived as (`event`): the gateway sends
    those bytes on unchanged unless it changes the chunk (the last one gets `metrics`), instead of
    encoding every event again."""

    __slots__ = ("event",)

    def __init__(self, chunk: dict[str, Any], event: bytes) -> None:
        super().__init__(chunk)
        self.event = event
