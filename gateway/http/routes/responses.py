"""The OpenAI Responses API: POST /v1/responses, GET / DELETE /v1/responses/{id}, and
GET /v1/responses/{id}/input_items.

POST is raw ASGI beside the chat route, through the same middleware (request id, tracker, one
telemetry row) and the same key and body checks; the request is translated into a chat request
(`protocol/responses.py`) and served by chat's own pipeline (`serving.handle`: routing,
speculation, failover, limits, cancellation when the client leaves), its answer made a `response`
again on the way out (`ResponsesShape`). An external backend declaring `responses_api` gets the
Responses request itself instead (`backends/upstream/responses_proxy.py`).

Stored responses (`store`, the default) live in the telemetry database; every read and write runs
in a thread, never on the event loop. A response belongs to the key that created it: to any other
it does not exist (404, not 403).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from specgate.gateway.backends.base import BackendCall
from specgate.gateway.http import body as request_body
from specgate.gateway.http.deps import ApiKeyDep, ServicesDep, api_key, hold_stream
from specgate.gateway.http.errors import post_only
from specgate.gateway.http.serving import handle
from specgate.gateway.http.sse import sse
from specgate.gateway.protocol.errors import GatewayError, invalid
from specgate.gateway.protocol.responses import (
    RESPONSE_ID,
    ResponsesRequest,
    Translated,
    client_param,
    not_found,
    translate,
)
from specgate.gateway.protocol.responses_format import (
    LIFECYCLE_EVENTS,
    TERMINAL_EVENTS,
    Head,
    StreamTranslator,
    error_object,
    from_chat,
)
from specgate.gateway.protocol.schemas import ChatCompletionRequest
from specgate.gateway.request.context import Caller
from specgate.gateway.request.tracker import RequestTracker
from specgate.gateway.services import Services
from specgate.gateway.telemetry.responses_store import ResponseStore, StoredResponse

logger = logging.getLogger("specgate.gateway")
# A response another worker answered reaches the database within its writer's next batch.
LATE_WRITE_SECONDS = 0.05
PATH = "/v1/responses"
SUMMARY = "Responses"
OPERATION_ID = "responses_v1_responses_post"
router = APIRouter()

# pydantic's names for the member of a tagged union it tried (`input.0.message.content`,
# `text.format.json_schema.strict`): the client named none of them.
_TAGS = frozenset(
    {
        "message",
        "function_call",
        "function_call_output",
        "input_text",
        "output_text",
        "refusal",
        "input_image",
        "function",
        "text",
        "json_object",
        "json_schema",
        "str",
        "list",
    }
)
_INDEX = re.compile(r"^\d+$")


def owner_of(caller: Caller) -> str:
    """Whose a stored response is: the API key's id, or in open mode (no key) the address's."""
    return caller.key_id or caller.tenant


def store_of(svc: Services) -> ResponseStore | None:
    return svc.responses


def _clean(param: str | None) -> str | None:
    if not param:
        return param
    parts = param.split(".")
    keep = [
        p
        for i, p in enumerate(parts)
        if not (p in _TAGS and i and (_INDEX.match(parts[i - 1]) or parts[i - 1] == "format"))
    ]
    return ".".join(keep)


def _client_error(err: GatewayError) -> GatewayError:
    """A validation error in the Responses API's words: an extra field is an unsupported parameter."""
    param = _clean(err.param)
    if "Extra inputs are not permitted" in err.message:
        return GatewayError(400, f"unsupported parameter: {param}", param=param, code="unsupported_parameter")
    if param and param.endswith(".role") and "found using 'type'" in err.message:
        param = param.removesuffix(".role") + ".type"  # the tag the union reads is `type`, not a role
    err.param = param
    if param and err.message.startswith("invalid value for "):
        err.message = f"invalid value for {param}: {err.message.partition(': ')[2]}"
    return err


async def _db(what: str, fn: Any, *args: Any) -> Any:
    """A blocking store call in a thread; a database that fails is a 503, never a 500."""
    try:
        return await asyncio.to_thread(fn, *args)
    except Exception:
        logger.exception("stored responses: %s failed", what)
        raise GatewayError(
            503, f"the response store is unavailable ({what})", code="store_unavailable", retryable=False
        ) from None


# ---- POST /v1/responses --------------------------------------------------------------------------


def endpoint() -> ASGIApp:
    """The ASGI app of POST /v1/responses (inside GatewayMiddleware, which catches what it raises)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        refusal = post_only(scope["method"])
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        request = Request(scope, receive)
        svc: Services = scope["app"].state.services
        tracker: RequestTracker = request.state.tracker  # made by GatewayMiddleware
        caller = await api_key(request, svc, tracker)
        try:
            parsed = await request_body.parse(request, ResponsesRequest, tracker)
        except GatewayError as err:
            raise _client_error(err) from None
        parsed.check_input()
        owner, store = owner_of(caller), store_of(svc)
        if store is None and parsed.store:
            raise invalid("store needs the telemetry database, which this gateway runs without", "store")
        if store is not None and parsed.store and store.backlogged:
            raise GatewayError(
                503, "the response store is unavailable (writes are backlogged)", code="store_unavailable"
            )
        prior: list[dict[str, Any]] = []
        if parsed.previous_response_id is not None:
            if store is None:
                raise invalid(
                    "previous_response_id needs stored responses: telemetry is off", "previous_response_id"
                )
            found = await _db("read", store.get, parsed.previous_response_id, owner)
            if found is None:  # another worker may have it queued still: its writer's next batch
                await asyncio.sleep(LATE_WRITE_SECONDS)
                found = await _db("read", store.get, parsed.previous_response_id, owner)
            if found is None:  # unknown, deleted, or another key's: the same answer
                raise GatewayError(
                    400,
                    f"Previous response with id '{parsed.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            prior = found.conversation
        rid = f"resp_{tracker.context.request_id}"
        translated = translate(parsed, prior, f"msg_{rid[5:]}_in")
        try:
            chat = request_body.validate(ChatCompletionRequest, translated.chat)
        except GatewayError as err:
            err.param = client_param(err.param)
            raise
        if parsed.stream:
            hold_stream(request, svc, caller)
        head = Head.of(rid, int(tracker.context.arrival_time), parsed)
        if store is None:
            head.echo["store"] = False
        shape = ResponsesShape(head, translated, parsed, owner, store if parsed.stores else None)
        try:
            response = await handle(svc, request, tracker, chat, "chat", shape)
        except GatewayError as err:
            err.param = client_param(err.param)
            raise
        await response(scope, receive, send)

    return app


def _event(event: dict[str, Any]) -> bytes:
    return b"event: " + str(event["type"]).encode() + b"\n" + sse(event)


@dataclass(slots=True)
class ResponsesShape:
    """A chat answer as a `response` (or an upstream's own `response`, relayed), stored before
    the client has its end: a client that continues at once finds what it continues."""

    head: Head
    translated: Translated
    request: ResponsesRequest
    owner: str
    store: ResponseStore | None  # None: not stored
    call: BackendCall | None = None
    translator: StreamTranslator = field(init=False)
    started: bool = False
    final: dict[str, Any] | None = None  # a proxied stream's terminal event, held until stored

    def __post_init__(self) -> None:
        self.translator = StreamTranslator(self.head)

    def prepare(self, call: BackendCall) -> None:
        self.call = call
        call.responses_body = self.translated.upstream

    @property
    def proxied(self) -> bool:
        return self.call is not None and self.call.responses_proxied

    def _adopt(self, upstream: dict[str, Any], metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """An upstream's own response under this gateway's id, model and state."""
        out = dict(upstream)
        out.update(
            id=self.head.id,
            model=self.head.model,
            previous_response_id=self.request.previous_response_id,
            store=self.head.echo["store"],
        )
        if metrics is not None and "metrics" not in out:
            out["metrics"] = metrics
        return out

    async def body(self, body: dict[str, Any]) -> dict[str, Any]:
        response = self._adopt(body) if self.proxied else from_chat(self.head, body)
        await self._save(response)
        return response

    def events(self, chunk: dict[str, Any]) -> list[bytes]:
        if self.proxied:
            return self._relay(chunk)
        out = [] if self.started else self.translator.start()
        self.started = True
        out.extend(self.translator.chunk(chunk))
        return [_event(e) for e in out]

    def _relay(self, event: dict[str, Any]) -> list[bytes]:
        seq = event.get("sequence_number")
        if isinstance(seq, int) and not isinstance(seq, bool):
            self.translator.seq = seq + 1  # a failure event of ours follows the upstream's numbering
        kind = event.get("type")
        if kind in TERMINAL_EVENTS:
            self.final = dict(event)  # sent once the response is stored (`end`)
            return []
        if kind in LIFECYCLE_EVENTS and isinstance(event.get("response"), dict):
            return [_event({**event, "response": self._adopt(event["response"])})]
        raw = getattr(event, "event", None)
        return [raw] if isinstance(raw, bytes) else [_event(event)]

    async def end(self, metrics: dict[str, Any] | None) -> list[bytes]:
        if self.proxied:
            final = self.final
            if final is None or not isinstance(final.get("response"), dict):
                raise GatewayError(
                    502,
                    "the backend ended the stream before the response did",
                    code="incomplete_upstream_stream",
                )
            response = self._adopt(final["response"], metrics)
            await self._save(response)
            return [_event({**final, "response": response})]
        if not self.started:  # an empty stream: nothing was sent yet
            self.started = True
            head = self.translator.start()
        else:
            head = []
        closing, response = self.translator.finish(metrics)
        await self._save(response)
        return [_event(e) for e in (*head, *closing, self.translator.terminal(response))]

    def failed(self, error: GatewayError) -> bytes:
        event = self.translator.failed(error)
        if self.proxied:
            event["response"] = self._adopt(event["response"])
            event["response"]["error"] = error_object(error)
        return _event(event)

    async def _save(self, response: dict[str, Any]) -> None:
        if self.store is None:
            return
        raw_use, raw_output = response.get("usage"), response.get("output")
        use: dict[str, Any] = raw_use if isinstance(raw_use, dict) else {}
        output: list[Any] = raw_output if isinstance(raw_output, list) else []
        row = StoredResponse(
            response_id=self.head.id,
            owner=self.owner,
            created_at=time.time(),
            model=self.head.model,
            status=str(response.get("status") or "completed")[:16],
            previous_response_id=self.request.previous_response_id,
            input_tokens=_int(use.get("input_tokens")),
            output_tokens=_int(use.get("output_tokens")),
            input_items=self.translated.input_items,
            output_items=[i for i in output if isinstance(i, dict)],
            response=response,
        )
        try:
            self.store.put(row)  # written behind the answer; readable in this process at once
        except RuntimeError as exc:
            logger.error("stored responses: %s", exc)
            raise GatewayError(
                503, f"the response store is unavailable ({exc})", code="store_unavailable"
            ) from None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else None


# ---- GET / DELETE /v1/responses/{id} -------------------------------------------------------------


async def _stored(svc: Services, caller: Caller, response_id: str) -> tuple[ResponseStore, StoredResponse]:
    store = store_of(svc)
    if store is None or not RESPONSE_ID.match(response_id):
        raise not_found(response_id)
    found = await _db("read", store.get, response_id, owner_of(caller))
    if found is None:
        raise not_found(response_id)
    return store, found


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, svc: ServicesDep, caller: ApiKeyDep) -> dict[str, Any]:
    _, found = await _stored(svc, caller, response_id)
    return found.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, svc: ServicesDep, caller: ApiKeyDep) -> dict[str, Any]:
    store, found = await _stored(svc, caller, response_id)
    if not await _db("delete", store.delete, found.response_id, found.owner):
        raise not_found(response_id)  # deleted meanwhile
    return {"id": found.response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    svc: ServicesDep,
    caller: ApiKeyDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: Annotated[str | None, Query(max_length=256)] = None,
) -> dict[str, Any]:
    _, found = await _stored(svc, caller, response_id)
    items = list(found.input_items if order == "asc" else reversed(found.input_items))
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise invalid(f"no input item with id '{after[:140]}' in this response", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(items) > limit,
    }
