"""Request bodies of the OpenAI API as pydantic models: validated at the edge, unknown fields kept.

Unknown fields survive (`extra="allow"`) so that vendor extensions reach external backends untouched.
Beyond OpenAI's fields, the vLLM sampling extensions (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, include_stop_str_in_output), vLLM's `cache_salt` and specgate's own
`spec` are understood.

Every field is bounded: numbers are finite and in range (a temperature of 1e-300 or a seed of 2**64
is refused or made harmless here, never inside the engine's batch), strings and lists have a length
limit, so no single request can make a later stage fail for everyone.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from specgate.engine.vocab import CONTROLLERS, K_MAX, check_controller

# Limits shared with the engine-facing checks (embedded_prompt) and the tests.
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # OpenAI's seed is an int64; the engine folds it into 64 bits
MAX_NAME = 256  # model names, user ids, tool call ids, message names
MAX_STOPS = 4
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_TOOL_NAME = 64
MAX_PROMPTS = 128
# Token ids in one prompt: more than any context served today; refused before the ids are validated
# one by one (that alone costs ~0.1 s per million, holding the GIL).
MAX_PROMPT_TOKEN_IDS = 262_144
MAX_LOGPROBS = 20
MAX_CACHE_SALT = 256
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
_TOKEN_KEY = re.compile(r"^(0|[1-9][0-9]{0,9})$")

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def _controller(value: str) -> str:
    check_controller(value)
    return value


# The engine's controller names, the one list (engine/vocab.py).
Controller = Annotated[
    str, AfterValidator(_controller), WithJsonSchema({"type": "string", "enum": list(CONTROLLERS)})
]
Name = Annotated[str, Field(max_length=MAX_NAME)]
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _no_control(value: str) -> str:
    if _CONTROL.search(value) is not None:
        raise ValueError("cache_salt must not contain control characters")
    return value


# vLLM's `cache_salt`: text without C0 / C1 control characters, bounded. Strict: a number is not
# silently taken for a salt.
CacheSalt = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_CACHE_SALT,
        strict=True,
        description="prefix-cache partition within the caller's own (vLLM's cache_salt)",
        json_schema_extra={"pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]+$"},
    ),
    AfterValidator(_no_control),
]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# A tool name as OpenAI defines it: letters, digits, underscores and dashes (dots too), at most 64.
_TOOL_NAME = re.compile(rf"^[A-Za-z0-9_.-]{{1,{MAX_TOOL_NAME}}}$")


class _Edge(BaseModel):
    # Python's JSON parser reads NaN / Infinity; a request never may.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Edge):
    include_usage: bool = False


class SpecRequest(BaseModel):
    """specgate extension: ask for (or forbid) speculation on this request; the router has the last word."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # "off" disables speculation; other names must be methods the operator allows (policy.methods).
    method: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    controller: Controller | None = None
    k_min: int | None = Field(None, ge=0, le=K_MAX)
    k_max: int | None = Field(None, ge=0, le=K_MAX)
    num_speculative_tokens: int | None = Field(None, ge=0, le=K_MAX)
    # Draft trees: at most this many drafted nodes per step (0: chains only).
    max_tree_nodes: int | None = Field(None, ge=0, le=K_MAX)

    @model_validator(mode="after")
    def _bounds(self) -> SpecRequest:
        if self.k_min is not None and self.k_max is not None and self.k_min > self.k_max:
            raise ValueError("k_min must be <= k_max")
        return self


# A schema or grammar's text (engine/structured_output/grammar.py has the same bound).
MAX_GRAMMAR_CHARS = 128 * 1024
MAX_CHOICES = 1024
Grammar = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
Schema = dict[str, Any] | bool | Grammar  # a JSON schema, as an object or as its JSON text
Choices = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]],
    Field(min_length=1, max_length=MAX_CHOICES),
]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object,
    structural_tag; the rest tune the JSON grammar. Other keys are kept for external backends (a
    newer vLLM's); the embedded engine refuses them."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)
    json_: Schema | None = Field(None, alias="json")
    regex: Grammar | None = None
    choice: Choices | None = None
    grammar: Grammar | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | Grammar | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # specgate never falls back to unconstrained decoding, so either value means what it does.
    disable_fallback: bool | None = None


class _Sampling(_Edge):
    model: str = Field(min_length=1, max_length=MAX_NAME)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=128)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # vLLM sampling extensions.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool | None = None
    # vLLM's prefix-cache extension: requests reuse each other's cached prompt blocks only under
    # the same salt, and only within the caller's scope (the gateway combines the two).
    cache_salt: CacheSalt | None = None
    # Token id (as a decimal string, JSON keys being strings) -> bias in [-100, 100].
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS_ENTRIES
    )
    spec: SpecRequest | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    # fields (aliases of structured_outputs' keys), llama.cpp's json_schema and grammar. External
    # backends get them as sent; the embedded engine enforces or refuses each (embedded/structured.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Schema | None = None
    guided_regex: Grammar | None = None
    guided_choice: Choices | None = None
    guided_grammar: Grammar | None = None
    guided_decoding_backend: Annotated[str, Field(max_length=64)] | None = None
    guided_whitespace_pattern: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # llama.cpp's server fields: a JSON schema (object, or its JSON text) and a GBNF grammar.
    json_schema: Schema | None = None
    grammar: Grammar | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not _TOKEN_KEY.match(key) or int(key) > INT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {key[:32]!r}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences may be at most {MAX_STOP_CHARS} characters long")
        return value

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Content = str | list[dict[str, Any]]


class ChatMessage(_Edge):
    """Any chat message; the request validates each one as the message type of its role (below),
    so the published schema says exactly which fields each role needs."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Content | None = None
    name: Name | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: Name | None = None

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        """The message's text; content parts other than text are refused by the embedded engine."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(
                    f"content parts of type {str(part.get('type'))[:64]!r} are not supported by this model"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class InstructionMessage(ChatMessage):
    role: Literal["system", "developer", "user", "function"]
    content: Content


class AssistantMessage(ChatMessage):
    # Content, tool calls, or both.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"minItems": 1}}},
            ]
        }
    )
    role: Literal["assistant"]


class ToolMessage(ChatMessage):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(min_length=1, max_length=MAX_NAME)


Message = Annotated[InstructionMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        # Checked here, kept as sent (vendor fields inside a tool reach external backends).
        for tool in value or []:
            fn = tool.get("function")
            if tool.get("type") != "function" or not isinstance(fn, dict):
                raise ValueError("each tool must be {'type': 'function', 'function': {...}}")
            name = fn.get("name")
            if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
                raise ValueError(
                    f"each tool function needs a name of 1-{MAX_TOOL_NAME} letters, digits, '_', '.' or '-'"
                )
            if not isinstance(fn.get("description"), str | None):
                raise ValueError("a tool function's description must be a string")
            if not isinstance(fn.get("parameters"), dict | None):
                raise ValueError("a tool function's parameters must be a JSON schema object")
        return value

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)
        ]
    )
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_size(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_PROMPT_TOKEN_IDS:
            raise ValueError(f"a prompt may hold at most {MAX_PROMPT_TOKEN_IDS} token ids")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens
