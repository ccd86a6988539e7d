"""The pass-through bodies: every input shape OpenAI, vLLM and llama.cpp send, each bounded, and
unknown (vendor) fields kept but bounded."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from specgate.gateway.protocol.passthrough_schemas import (
    MAX_EMBEDDING_INPUTS,
    MAX_EXTRA_BYTES,
    MAX_EXTRA_FIELDS,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    TokenizeRequest,
)
from specgate.gateway.protocol.schemas import MAX_PROMPT_TOKEN_IDS


@pytest.mark.parametrize("given", ["one text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_every_embedding_input_shape(given: Any) -> None:
    req = EmbeddingRequest.model_validate({"model": "m", "input": given, "truncate_prompt_tokens": 8})
    assert req.input == given
    # Vendor fields reach the backend as sent; defaults are not added.
    assert req.model_dump(exclude_unset=True) == {"model": "m", "input": given, "truncate_prompt_tokens": 8}


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},
        {"input": "x"},
        {"model": "", "input": "x"},
        {"model": "m", "input": ""},
        {"model": "m", "input": []},
        {"model": "m", "input": [[]]},
        {"model": "m", "input": [""]},
        {"model": "m", "input": [-1]},
        {"model": "m", "input": [2**31]},
        {"model": "m", "input": [1.5]},
        {"model": "m", "input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)},
        {"model": "m", "input": list(range(MAX_PROMPT_TOKEN_IDS + 1))},
        {"model": "m", "input": "x", "encoding_format": "int8"},
        {"model": "m", "input": "x", "dimensions": 0},
        {"model": "m", "input": "x", "dimensions": float("nan")},
        {"model": "m", "input": "x", "user": "u" * 257},
        {"model": "m", "input": "x", "vendor": "v" * MAX_EXTRA_BYTES},
        {"model": "m", "input": "x", **{f"f{i}": i for i in range(MAX_EXTRA_FIELDS + 1)}},
        {"model": "m", "input": "x", "k" * 65: 1},
    ],
)
def test_embedding_bodies_out_of_bounds(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        EmbeddingRequest.model_validate(body)


def test_rerank_bounds() -> None:
    ok = RerankRequest.model_validate(
        {"model": "m", "query": "q", "documents": ["a", {"text": "b"}], "top_n": 1}
    )
    assert ok.top_n == 1
    for bad in ({"model": "m", "query": "q", "documents": []}, {"model": "m", "documents": ["a"]}):
        with pytest.raises(ValidationError):
            RerankRequest.model_validate(bad)


def test_tokenize_takes_exactly_one_input() -> None:
    assert TokenizeRequest.model_validate({"content": "x"}).llama_cpp
    assert not TokenizeRequest.model_validate({"prompt": ""}).llama_cpp  # an empty prompt tokenizes to []
    assert TokenizeRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}).messages
    for bad in (
        {},
        {"prompt": "a", "content": "b"},
        {"prompt": "a", "messages": [{"role": "user", "content": "x"}]},
    ):
        with pytest.raises(ValidationError, match="exactly one"):
            TokenizeRequest.model_validate(bad)


def test_detokenize_ids_are_token_ids() -> None:
    assert DetokenizeRequest.model_validate({"tokens": []}).tokens == []
    for bad in ([-1], [2**31], ["1"], [True], [1.0], list(range(MAX_PROMPT_TOKEN_IDS + 1))):
        with pytest.raises(ValidationError):
            DetokenizeRequest.model_validate({"tokens": bad})
