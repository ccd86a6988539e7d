"""Request bodies of the pass-through endpoints: embeddings, rerank, tokenize and detokenize.

Validated at the edge like the inference bodies (`schemas.py`): every field bounded, NaN refused.
Unknown fields are kept, because vendors extend these endpoints (vLLM's `truncate_prompt_tokens`,
`normalize`, llama.cpp's `with_pieces`, ...) and external backends get the body as sent; but an
unknown field is bounded too (how many, and how large each one is), so a body cannot smuggle an
arbitrarily large document to every backend it fails over to.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specgate.gateway.protocol.schemas import INT32_MAX, MAX_MESSAGES, MAX_NAME, MAX_PROMPT_TOKEN_IDS, Message

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request
# One input's text: generous for long-context embedding models (32k tokens at ~4 characters each
# and more), far below what would make one request an outlier in the gateway's memory.
MAX_INPUT_CHARS = 262_144
MAX_DIMENSIONS = 65_536
MAX_RERANK_DOCUMENTS = 1024
MAX_TOKENIZE_CHARS = 1_048_576  # the most text /tokenize reads (the model's context bounds it further)
MAX_EXTRA_FIELDS = 32  # unknown (vendor) fields in one body
MAX_EXTRA_BYTES = 16 * 1024  # one unknown field's value, as JSON

Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
# Strict: "12", true and 12.0 are not token ids (a backend would read them its own way, or fail).
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX, strict=True)]
Text = Annotated[str, Field(min_length=1, max_length=MAX_INPUT_CHARS)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]


def _few_ids(value: Any) -> Any:
    # Before pydantic checks them one by one (~0.1 s per million ids, holding the GIL).
    if isinstance(value, list) and len(value) > MAX_PROMPT_TOKEN_IDS:
        raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS} token ids")
    return value


class _Passthrough(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _bounded_extras(self) -> _Passthrough:
        extra = self.model_extra or {}
        if len(extra) > MAX_EXTRA_FIELDS:
            raise ValueError(f"at most {MAX_EXTRA_FIELDS} fields this endpoint does not define")
        for name, value in extra.items():
            if len(name) > 64:
                raise ValueError("field names are at most 64 characters long")
            if len(json.dumps(value)) > MAX_EXTRA_BYTES:
                raise ValueError(f"the field {name!r} is over {MAX_EXTRA_BYTES} bytes")
        return self


class EmbeddingRequest(_Passthrough):
    """OpenAI's `POST /v1/embeddings`: text, texts, token ids or lists of token ids."""

    model: Name
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1, le=MAX_DIMENSIONS)
    user: Name | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_size(cls, value: Any) -> Any:
        return _few_ids(value)


class RerankRequest(_Passthrough):
    """vLLM's, Jina's and Cohere's `POST /rerank` (`/v1/rerank`): a query and the documents to order."""

    model: Name
    query: Text | dict[str, Any]
    documents: Annotated[list[Text | dict[str, Any]], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]
    top_n: int | None = Field(None, ge=0, le=MAX_RERANK_DOCUMENTS)
    return_documents: bool | None = None
    user: Name | None = None


class TokenizeRequest(_Passthrough):
    """`POST /tokenize` in vLLM's shapes (`prompt`, or chat `messages`) and llama.cpp's (`content`):
    exactly one of the three. `model` may be left out, as both servers allow, where the gateway
    serves one model (or has the embedded engine)."""

    model: Name | None = None
    prompt: Annotated[str, Field(max_length=MAX_TOKENIZE_CHARS)] | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    content: Annotated[str, Field(max_length=MAX_TOKENIZE_CHARS)] | None = None
    # vLLM: special tokens (BOS) around a prompt (default true; false for messages, whose chat
    # template writes its own); the assistant's turn opened after the messages (default true).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None  # vLLM: each token's string beside its id
    # llama.cpp: special tokens (default false); `{"id", "piece"}` objects instead of bare ids.
    add_special: bool | None = None
    with_pieces: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [f for f in ("prompt", "messages", "content") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("send exactly one of prompt, messages (vLLM) or content (llama.cpp)")
        return self

    @property
    def llama_cpp(self) -> bool:
        """Asked in llama.cpp's shape (`content`): answered in it."""
        return self.content is not None


class DetokenizeRequest(_Passthrough):
    """`POST /detokenize`: vLLM's `{"model", "tokens"}` and llama.cpp's `{"tokens"}`."""

    model: Name | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)]

    @field_validator("tokens", mode="before")
    @classmethod
    def _tokens_size(cls, value: Any) -> Any:
        return _few_ids(value)


# The bodies the OpenAPI document describes (http/openapi.py).
PASSTHROUGH_BODIES: list[type[BaseModel]] = [
    EmbeddingRequest,
    RerankRequest,
    TokenizeRequest,
    DetokenizeRequest,
]
