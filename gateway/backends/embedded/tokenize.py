"""/tokenize and /detokenize on the embedded model, as vLLM serves them (and in llama.cpp's shape).

The gateway side holds the engine's own tokenizer (`ModelInfo`), so these never reach the engine
core: a prompt is tokenized as the completions endpoint tokenizes it, and chat messages are
rendered and tokenized as the chat endpoint does (the same normalisation, template and encoding),
so a messages form's `count` is the `prompt_tokens` the same conversation costs on
/v1/chat/completions. What the client asked in decides the answer's shape: `content` (llama.cpp)
gets `{"tokens"}`, `prompt` or `messages` (vLLM) get `{"count", "max_model_len", "tokens"}`.
"""

from __future__ import annotations

from typing import Any

from specgate.gateway.backends.embedded.chat_template import chat_text, encode, normalize_messages
from specgate.gateway.backends.embedded.prompt import template_errors, text_fits
from specgate.gateway.engine_core.model_info import ModelInfo
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.passthrough_schemas import DetokenizeRequest, TokenizeRequest


def tokenize(model: ModelInfo, req: TokenizeRequest) -> dict[str, Any]:
    _no_extensions(req.model_extra)
    tok = model.tokenizer
    if req.messages is not None:
        ids = _chat_ids(model, req)
    else:
        text, param = (req.content, "content") if req.content is not None else (req.prompt or "", "prompt")
        text_fits(model, text, param)
        # Each dialect's default: vLLM adds the model's special tokens (BOS) as the completions
        # endpoint does, llama.cpp does not.
        own, other = (
            (req.add_special, req.add_special_tokens)
            if req.llama_cpp
            else (req.add_special_tokens, req.add_special)
        )
        special = next((flag for flag in (own, other) if flag is not None), not req.llama_cpp)
        ids = [int(t) for t in tok(text, add_special_tokens=special)["input_ids"]]
    if req.llama_cpp:
        if req.with_pieces:
            return {"tokens": [{"id": t, "piece": tok.decode([t])} for t in ids]}
        return {"tokens": ids}
    strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(model: ModelInfo, req: DetokenizeRequest) -> dict[str, Any]:
    """`{"prompt"}` (vLLM's answer) to a request that names its model; without one the request may
    be either server's, so the text comes under llama.cpp's `content` too."""
    _no_extensions(req.model_extra)
    vocab = model.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
    if bad is not None:
        raise GatewayError(
            400,
            f"tokens.{bad} is {req.tokens[bad]}: token ids must be in [0, {vocab}) for this model",
            code="invalid_value",
            param="tokens",
        )
    try:
        text = str(model.tokenizer.decode(req.tokens))
    except (ValueError, OverflowError, IndexError) as exc:  # an id the vocabulary pads but never names
        raise GatewayError(
            400, f"the tokens do not decode: {exc}", code="invalid_value", param="tokens"
        ) from None
    return {"prompt": text} if req.model is not None else {"prompt": text, "content": text}


def _chat_ids(model: ModelInfo, req: TokenizeRequest) -> list[int]:
    tok = model.tokenizer
    assert req.messages is not None
    with template_errors():
        messages, _ = normalize_messages(tok, req.messages, None, None, model.chat_template)
        generation = req.add_generation_prompt is not False
        text = chat_text(tok, messages, None, model.chat_template, add_generation_prompt=generation)
        text_fits(model, text, "messages")
        if req.add_special_tokens:  # vLLM's default for messages is off: the template wrote them
            return [int(t) for t in tok(text, add_special_tokens=True)["input_ids"]]
        return encode(tok, text)


def _no_extensions(extra: dict[str, Any] | None) -> None:
    # External backends get unknown fields as sent; the embedded engine honours none of them, so a
    # set one is refused rather than silently dropped (as prompt.prepare does for completions).
    for name, value in (extra or {}).items():
        if value is not None:
            raise GatewayError(
                400,
                f"{name} is not supported by the embedded engine",
                code="unsupported_parameter",
                param=name,
            )
