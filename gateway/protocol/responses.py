"""The OpenAI Responses API's request (`POST /v1/responses`) as pydantic models, and its translation
into the chat-completions request every backend serves.

Unlike the chat schemas (which keep unknown fields for external backends), nothing unknown is
kept: the Responses API is translated, and a field the translation would drop would be silently
ignored. Every model forbids extra fields; the route turns pydantic's complaint into a 400 naming
the parameter. Fields whose only accepted value is OpenAI's default (`truncation: "disabled"`,
`background: false`, an empty `include`) are accepted as such, since they ask for nothing.

Every list and string is bounded; the conversation a `previous_response_id` prepends is bounded
again once prepended (`check_size`), so a chain of stored responses cannot grow past what one
request may send.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from specgate.gateway.protocol import json_codec
from specgate.gateway.protocol.errors import GatewayError, invalid
from specgate.gateway.protocol.schemas import (
    INT32_MAX,
    MAX_MESSAGES,
    MAX_NAME,
    MAX_TOOL_NAME,
    MAX_TOOLS,
    CacheSalt,
    Name,
    SpecRequest,
)

MAX_INPUT_ITEMS = MAX_MESSAGES  # items in one request's input, the stored conversation included
MAX_INPUT_BYTES = 8 * 2**20  # the input's JSON, the stored conversation included
MAX_PARTS = 256  # content parts of one message
MAX_METADATA = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,128}$")
_TOOL_NAME = rf"^[A-Za-z0-9_.-]{{1,{MAX_TOOL_NAME}}}$"
_FORMAT_NAME = r"^[A-Za-z0-9_-]{1,64}$"

ToolName = Annotated[str, Field(pattern=_TOOL_NAME)]
CallId = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
ItemId = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ---- input items ---------------------------------------------------------------------------------


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    """An assistant's text, as an earlier response's output gives it back."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = Field(None, max_length=0)  # none are made here; none are read
    logprobs: list[Any] | None = None  # what a response said about its own tokens: not input


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


class InputImage(_Strict):
    """An image by URL (or data URL): chat's `image_url` part, for backends that take images."""

    type: Literal["input_image"]
    image_url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


ContentPart = Annotated[InputText | OutputText | Refusal | InputImage, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_PARTS)]
    id: ItemId | None = None
    status: ItemStatus | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: CallId
    name: ToolName
    arguments: str
    id: ItemId | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: CallId
    output: str | Annotated[list[InputText], Field(max_length=MAX_PARTS)]
    id: ItemId | None = None
    status: ItemStatus | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]
# Text, or a list of items: told apart by the value's type, so that a bad item's error names the
# item's field (`input.3.content`), not the text form's "should be a string".
Input = Annotated[
    Annotated[str, Field(min_length=1), Tag("str")]
    | Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS), Tag("list")],
    Discriminator(lambda v: "str" if isinstance(v, str) else "list"),
]


# ---- tools and formats ---------------------------------------------------------------------------


class FunctionTool(_Strict):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: ToolName


class FormatText(_Strict):
    type: Literal["text"]


class FormatJsonObject(_Strict):
    type: Literal["json_object"]


class FormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: str = Field(pattern=_FORMAT_NAME)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Strict):
    format: TextFormat | None = None


class Reasoning(_Strict):
    # Chat's `reasoning_effort`: meaningful to reasoning models behind external backends; the
    # embedded engine refuses it (its models do not reason), as OpenAI does for such models.
    effort: Annotated[str, Field(pattern=r"^[a-z]{1,16}$")] | None = None


# ---- the request ---------------------------------------------------------------------------------


class ResponsesRequest(_Strict):
    model: str = Field(min_length=1, max_length=MAX_NAME)
    input: Input | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    metadata: (
        dict[
            Annotated[str, Field(max_length=MAX_METADATA_KEY)],
            Annotated[str, Field(max_length=MAX_METADATA_VALUE)],
        ]
        | None
    ) = Field(None, max_length=MAX_METADATA)
    user: Name | None = None
    stream: bool | None = False
    store: bool | None = None  # None: true, as OpenAI's default
    previous_response_id: str | None = Field(None, pattern=RESPONSE_ID.pattern)
    # OpenAI's defaults, accepted as such: any other value asks for what is not offered.
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    include: list[str] | None = Field(None, max_length=0)
    # specgate's and vLLM's extensions, as on chat.
    spec: SpecRequest | None = None
    cache_salt: CacheSalt | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _typed_items(cls, value: Any) -> Any:
        # An item with a role and no type is a message (OpenAI's "easy input message").
        if isinstance(value, list) and len(value) <= MAX_INPUT_ITEMS:
            return [
                {**v, "type": "message"} if isinstance(v, dict) and "type" not in v and "role" in v else v
                for v in value
            ]
        return value

    def check_input(self) -> None:
        """Something to answer: input, or a stored conversation to continue (a 400 naming input)."""
        if self.previous_response_id is None and not self.input:
            raise invalid("input is required, and may be empty only with previous_response_id", "input")

    @property
    def stores(self) -> bool:
        return self.store is not False


# ---- translation ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Translated:
    """A Responses request made a chat request: the chat body, the conversation as input items (the
    stored one first), and the body an upstream that speaks the Responses API itself gets."""

    chat: dict[str, Any]
    input_items: list[dict[str, Any]]
    upstream: dict[str, Any]


# Chat parameter -> the Responses parameter a client sent (errors name what the client sent).
PARAM_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "stream_options": "stream",
}


def client_param(param: str | None) -> str | None:
    """The Responses parameter behind a chat parameter an error names (`tools.0.function.name` ->
    `tools.0.name`, `messages.3.content` -> `input`)."""
    if not param:
        return param
    head = param.partition(".")[0]
    if head == "tools":
        return param.replace(".function.", ".", 1)
    if head == "tool_choice":
        return "tool_choice"
    return PARAM_NAMES.get(head, param)


def normalized_input(req: ResponsesRequest, item_prefix: str) -> list[dict[str, Any]]:
    """The request's own input as items, each with an id (input_items lists them by it)."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        items: list[dict[str, Any]] = [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}]}
        ]
    else:
        items = [item.model_dump(exclude_none=True, by_alias=True) for item in req.input]
    out = []
    for i, item in enumerate(items):
        if item.get("type") == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", f"{item_prefix}{i}")
        out.append(item)
    return out


def check_size(items: list[dict[str, Any]]) -> None:
    if len(items) > MAX_INPUT_ITEMS:
        raise invalid(
            f"the input, with the stored conversation it continues, holds {len(items)} items; "
            f"the limit is {MAX_INPUT_ITEMS}",
            param="input",
            code="input_too_large",
        )
    size = len(json_codec.encode(items))
    if size > MAX_INPUT_BYTES:
        raise invalid(
            f"the input, with the stored conversation it continues, is {size} bytes of JSON; "
            f"the limit is {MAX_INPUT_BYTES}",
            param="input",
            code="input_too_large",
        )


def _text_of(content: Any) -> tuple[str, list[dict[str, Any]] | None]:
    """A message's text, and its chat content parts when it holds more than text (images)."""
    if isinstance(content, str):
        return content, None
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    rich = False
    for part in content or ():
        kind = part.get("type")
        if kind in ("input_text", "output_text"):
            text = str(part.get("text", ""))
        elif kind == "refusal":
            text = str(part.get("refusal", ""))
        elif kind == "input_image":
            rich = True
            url: dict[str, Any] = {"url": part.get("image_url")}
            if part.get("detail"):
                url["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": url})
            continue
        else:  # a stored upstream's part of a kind chat has no word for
            raise invalid(f"content parts of type {str(kind)[:64]!r} cannot be translated to chat", "input")
        texts.append(text)
        parts.append({"type": "text", "text": text})
    return "".join(texts), parts if rich else None


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages: function calls join the assistant message before them
    (chat's shape: one assistant turn, its text and its tool calls), outputs become tool messages.
    Items of other types (an upstream's reasoning items, stored with its answer) have no chat form
    and are left out: they are the model's own notes, not the conversation."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            text, parts = _text_of(item.get("content"))
            messages.append(
                {"role": item.get("role", "user"), "content": parts if parts is not None else text}
            )
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if last.get("content") == "":
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else _text_of(output)[0]
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
    return messages


def translate(req: ResponsesRequest, prior: list[dict[str, Any]], item_prefix: str) -> Translated:
    """`prior`: the stored conversation a previous_response_id continues (its input and output
    items), prepended to this request's input."""
    own = normalized_input(req, item_prefix)
    items = [*prior, *own]
    check_size(items)
    messages = chat_messages(req.instructions, items)
    if not messages:
        raise invalid("input must hold at least one message", param="input")
    chat: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # a Response always reports its usage
    for name, value in (
        ("max_completion_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("parallel_tool_calls", req.parallel_tool_calls),
        ("user", req.user),
        ("cache_salt", req.cache_salt),
    ):
        if value is not None:
            chat[name] = value
    if req.spec is not None:
        chat["spec"] = req.spec.model_dump(exclude_none=True)
    if req.tools is not None:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if isinstance(req.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        chat["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, FormatJsonSchema):
        spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.description is not None:
            spec["description"] = fmt.description
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif isinstance(fmt, FormatJsonObject):
        chat["response_format"] = {"type": "json_object"}
    # {"type": "text"} is chat's default: nothing to send.
    if req.reasoning is not None and req.reasoning.effort is not None:
        chat["reasoning_effort"] = req.reasoning.effort
    # specgate's own extension stays here, as the chat path's does (backends/upstream _DROP).
    upstream = req.model_dump(
        exclude_unset=True, by_alias=True, exclude={"previous_response_id", "store", "spec"}
    )
    if prior:
        upstream["input"] = items  # the gateway holds the conversation; the upstream stores nothing
    upstream["store"] = False
    return Translated(chat, items, upstream)


def not_found(response_id: str, param: str | None = None) -> GatewayError:
    shown = response_id[:140]
    return GatewayError(404, f"No response found with id '{shown}'.", code="response_not_found", param=param)
