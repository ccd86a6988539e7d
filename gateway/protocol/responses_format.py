"""Chat answers as Responses API objects: the whole `response` of a chat completion, and the
Responses event stream of a chat chunk stream. Pure functions and one stateful translator; no I/O.

The shapes are OpenAI's (`openai.types.responses`): a `message` output item holds one
`output_text` part, a tool call is a `function_call` item of its own; usage says input / output
tokens. specgate's `metrics` extension rides on the response object, as on a chat body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.responses import ResponsesRequest

# Chat finish reasons that cut an answer short -> the Responses API's incomplete_details.reason.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


@dataclass(slots=True)
class Head:
    """What every form of one response repeats: its id, time, model and the request's settings."""

    id: str
    created_at: int
    model: str
    echo: dict[str, Any]

    @classmethod
    def of(cls, response_id: str, created_at: int, req: ResponsesRequest) -> Head:
        fmt = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if req.text and req.text.format
            else None
        )
        tool_choice = (
            req.tool_choice
            if isinstance(req.tool_choice, str) or req.tool_choice is None
            else req.tool_choice.model_dump()
        )
        echo = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "store": req.stores,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "truncation": "disabled",
            "user": req.user,
            "background": False,
        }
        return cls(response_id, created_at, req.model, echo)

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: str | None = None,
        error: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "error": error,
            **self.echo,
        }
        if metrics is not None:
            out["metrics"] = metrics
        return out


def usage(chat_usage: Any) -> dict[str, Any] | None:
    """Chat usage as the Responses API words it; None where the backend reported none."""
    if not isinstance(chat_usage, dict):
        return None
    prompt = _count(chat_usage.get("prompt_tokens"))
    completion = _count(chat_usage.get("completion_tokens"))
    details = chat_usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    done = chat_usage.get("completion_tokens_details")
    reasoning = _count(done.get("reasoning_tokens")) if isinstance(done, dict) else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def status_of(finish_reason: Any) -> tuple[str, str | None]:
    """The response's status and, when cut short, why."""
    reason = _INCOMPLETE.get(finish_reason) if isinstance(finish_reason, str) else None
    return ("incomplete", reason) if reason else ("completed", None)


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def from_chat(head: Head, body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion body as a `response` object."""
    choices = body.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    status, incomplete = status_of(choice.get("finish_reason"))
    output: list[dict[str, Any]] = []
    text = message.get("content")
    calls = message.get("tool_calls") or []
    if isinstance(text, str) and (text or not calls):
        output.append(message_item(f"msg_{head.id[5:]}", text, "completed"))
    for i, tc in enumerate(calls):
        fn = tc.get("function") or {}
        call_id = str(tc.get("id") or f"call_{head.id[5:]}_{i}")
        output.append(
            call_item(
                f"fc_{head.id[5:]}_{i}",
                call_id,
                str(fn.get("name", "")),
                str(fn.get("arguments", "")),
                "completed",
            )
        )
    if incomplete and output:
        output[-1]["status"] = "incomplete"
    metrics = body.get("metrics")
    return head.response(status, output, usage(body.get("usage")), incomplete, None, metrics)


def error_object(error: GatewayError) -> dict[str, Any]:
    return {"code": error.code or "server_error", "message": error.message}


@dataclass(slots=True)
class _Call:
    output_index: int
    item: dict[str, Any]
    open: bool = True


@dataclass(slots=True)
class StreamTranslator:
    """Chat chunks in, Responses events out (dicts, each with its `sequence_number`).

    One output item is open for text at a time; a tool call's item opens with its first delta (the
    one naming it) and takes its argument deltas by the chat delta's `index`, as vLLM streams them
    (the embedded engine sends each call whole, in one delta)."""

    head: Head
    seq: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)
    text_item: dict[str, Any] | None = None
    text_index: int = -1
    calls: dict[int, _Call] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.head.response("in_progress", [])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("metrics"), dict):
            self.metrics = chunk["metrics"]
        choices = chunk.get("choices") or ()
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if isinstance(text, str) and text:
            events.extend(self._text(text))
        for tc in delta.get("tool_calls") or ():
            if isinstance(tc, dict):
                events.extend(self._tool_delta(tc))
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
        return events

    def _open(self, item: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
        index = len(self.output)
        self.output.append(item)
        added = {**item, "content": []} if item["type"] == "message" else dict(item)
        return index, [self._event("response.output_item.added", output_index=index, item=added)]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.text_item is None:
            events.extend(self._close_calls())
            item = message_item(f"msg_{self.head.id[5:]}_{len(self.output)}", "", "in_progress")
            self.text_index, opened = self._open(item)
            self.text_item = item
            events.extend(opened)
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self.text_index,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            )
        part = self.text_item["content"][0]
        part["text"] += text
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=self.text_item["id"],
                output_index=self.text_index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _close_text(self, status: str) -> list[dict[str, Any]]:
        item = self.text_item
        if item is None:
            return []
        self.text_item = None
        item["status"] = status
        part = item["content"][0]
        at = {"item_id": item["id"], "output_index": self.text_index, "content_index": 0}
        return [
            self._event("response.output_text.done", **at, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **at, part=dict(part)),
            self._event("response.output_item.done", output_index=self.text_index, item=_copy(item)),
        ]

    def _tool_delta(self, tc: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        index = tc.get("index", len(self.calls))
        index = index if isinstance(index, int) else len(self.calls)
        raw_fn = tc.get("function")
        fn: dict[str, Any] = raw_fn if isinstance(raw_fn, dict) else {}
        call = self.calls.get(index)
        if call is None:
            events.extend(self._close_text("completed"))
            n = len(self.calls)
            call_id = str(tc.get("id") or f"call_{self.head.id[5:]}_{n}")
            item = call_item(
                f"fc_{self.head.id[5:]}_{n}", call_id, str(fn.get("name") or ""), "", "in_progress"
            )
            out_index, opened = self._open(item)
            call = self.calls[index] = _Call(out_index, item)
            events.extend(opened)
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            call.item["arguments"] += args
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.item["id"],
                    output_index=call.output_index,
                    delta=args,
                )
            )
        return events

    def _close_calls(self, status: str = "completed") -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for call in self.calls.values():
            if not call.open:
                continue
            call.open = False
            item = call.item
            item["status"] = status
            at = {"item_id": item["id"], "output_index": call.output_index}
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **at,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(
                self._event("response.output_item.done", output_index=call.output_index, item=_copy(item))
            )
        return events

    def finish(self, metrics: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The events that close the open items, and the whole response (for storing); the last
        event, `terminal(response)`, goes out once it is stored."""
        status, incomplete = status_of(self.finish_reason)
        last = "incomplete" if incomplete else "completed"
        events: list[dict[str, Any]] = []
        if not self.output:  # nothing said: an empty message, as a body would hold
            events.extend(self._text_open_empty())
        # The item still open is the one a cut answer cut: it is the incomplete one.
        events.extend(self._close_calls(last))
        events.extend(self._close_text(last))
        if metrics is not None and self.metrics is None:
            self.metrics = metrics
        response = self.head.response(
            status, [_copy(i) for i in self.output], usage(self.usage), incomplete, None, self.metrics
        )
        return events, response

    def _text_open_empty(self) -> list[dict[str, Any]]:
        events = self._text("x")  # opens the item and its part; the delta itself is dropped
        events.pop()
        self.seq -= 1
        assert self.text_item is not None
        self.text_item["content"][0]["text"] = ""
        return events

    def terminal(self, response: dict[str, Any]) -> dict[str, Any]:
        kind = "response.incomplete" if response.get("status") == "incomplete" else "response.completed"
        return self._event(kind, response=response)

    def failed(self, error: GatewayError) -> dict[str, Any]:
        response = self.head.response(
            "failed",
            [_copy(i) for i in self.output],
            usage(self.usage),
            None,
            error_object(error),
            self.metrics,
        )
        return self._event("response.failed", response=response)


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out


# ---- an upstream that speaks the Responses API itself --------------------------------------------

TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
LIFECYCLE_EVENTS = frozenset(
    {"response.created", "response.in_progress", "response.queued", *TERMINAL_EVENTS}
)


def upstream_usage(body: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """Input, output and cached tokens from a Responses usage object; None where not said."""
    use = body.get("usage")
    if not isinstance(use, dict):
        return None, None, None

    def count(value: Any) -> int | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**31 - 1
        return value if ok else None

    details = use.get("input_tokens_details")
    cached = count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return count(use.get("input_tokens")), count(use.get("output_tokens")), cached


def finish_of(body: dict[str, Any]) -> str | None:
    """A Responses object's outcome as a chat finish reason (what the telemetry row keeps)."""
    status = body.get("status")
    if status == "completed":
        calls = any(
            isinstance(i, dict) and i.get("type") == "function_call" for i in body.get("output") or ()
        )
        return "tool_calls" if calls else "stop"
    if status == "incomplete":
        details = body.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return "content_filter" if reason == "content_filter" else "length"
    return None
