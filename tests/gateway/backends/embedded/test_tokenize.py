"""/tokenize and /detokenize on the embedded model's tokenizer (the tiny ASCII one: one token per
character), without an engine: the answer shapes, the chat rendering chat requests get, the bounds."""

from __future__ import annotations

from typing import Any

import pytest

from specgate.gateway.backends.embedded.chat_template import render_chat
from specgate.gateway.backends.embedded.tokenize import detokenize, tokenize
from specgate.gateway.engine_core.model_info import ModelInfo
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.passthrough_schemas import DetokenizeRequest, TokenizeRequest
from tests.conftest import VOCAB_SIZE, build_tokenizer

MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]


@pytest.fixture(scope="module")
def model() -> ModelInfo:
    return ModelInfo(build_tokenizer(), VOCAB_SIZE, 64, "float32", "cpu", [], [], max_token_chars=4)


def tok(model: ModelInfo, **body: Any) -> dict[str, Any]:
    return tokenize(model, TokenizeRequest.model_validate(body))


def test_vllm_and_llama_cpp_shapes(model: ModelInfo) -> None:
    vllm = tok(model, prompt="abc")
    assert vllm == {"count": 3, "max_model_len": 64, "tokens": vllm["tokens"], "token_strs": None}
    assert tok(model, content="abc") == {"tokens": vllm["tokens"]}
    pieces = tok(model, content="ab", with_pieces=True)["tokens"]
    assert [p["piece"] for p in pieces] == ["a", "b"]
    assert tok(model, prompt="ab", return_token_strs=True)["token_strs"] == ["a", "b"]


def test_messages_are_rendered_as_chat_renders_them(model: ModelInfo) -> None:
    got = tok(model, messages=MESSAGES)
    assert got["tokens"] == render_chat(model.tokenizer, MESSAGES)  # what a chat request's prompt is
    bare = tok(model, messages=MESSAGES, add_generation_prompt=False)
    assert bare["tokens"] == got["tokens"][:-2]  # without the template's "a:"


def test_detokenize_round_trips_and_names_the_shape(model: ModelInfo) -> None:
    ids = tok(model, prompt="Hello!")["tokens"]
    assert detokenize(model, DetokenizeRequest(model="m", tokens=ids)) == {"prompt": "Hello!"}
    assert detokenize(model, DetokenizeRequest(tokens=ids)) == {"prompt": "Hello!", "content": "Hello!"}


def test_ids_beyond_the_vocabulary_are_a_400_naming_tokens(model: ModelInfo) -> None:
    with pytest.raises(GatewayError) as err:
        detokenize(model, DetokenizeRequest(tokens=[0, VOCAB_SIZE - 1, VOCAB_SIZE]))
    assert (err.value.status, err.value.param, err.value.code) == (400, "tokens", "invalid_value")
    assert "tokens.2" in err.value.message


def test_text_that_cannot_fit_the_context_is_refused_before_tokenizing(model: ModelInfo) -> None:
    tok(model, prompt="x" * 64 * 4)
    for field in ("prompt", "content"):
        with pytest.raises(GatewayError) as err:
            tok(model, **{field: "x" * (64 * 4 + 1)})
        assert (err.value.code, err.value.param) == ("context_length_exceeded", field)
    with pytest.raises(GatewayError) as err:
        tok(model, messages=[{"role": "user", "content": "x" * 64 * 4}])
    assert err.value.param == "messages"


def test_fields_the_embedded_engine_does_not_honour_are_refused(model: ModelInfo) -> None:
    with pytest.raises(GatewayError) as err:
        tok(model, messages=MESSAGES, continue_final_message=True)
    assert (err.value.status, err.value.param) == (400, "continue_final_message")
    tok(model, prompt="a", continue_final_message=None)  # unset: nothing to refuse


def test_content_parts_other_than_text_are_a_400(model: ModelInfo) -> None:
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(GatewayError) as err:
        tok(model, messages=[{"role": "user", "content": image}])
    assert (err.value.status, err.value.param) == (400, "messages")
