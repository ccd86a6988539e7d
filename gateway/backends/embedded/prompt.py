"""Validating an OpenAI request against the embedded engine and turning it into engine inputs.

Everything that can refuse a request happens here, before the engine sees it, so a bad request
gets a 400 and never a half-started stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from specgate.engine.sampling_params import MAX_N, SamplingParams
from specgate.engine.structured_output.grammar import Grammar
from specgate.gateway.backends.base import BackendCall
from specgate.gateway.backends.embedded.chat_template import (
    chat_template_for,
    chat_text,
    encode,
    normalize_messages,
)
from specgate.gateway.backends.embedded.structured import checked, requested_grammar
from specgate.gateway.backends.embedded.tools import (
    forced_tool,
    tag_markers,
    template_supports_tools,
    tool_call_lark,
    tool_tags_lark,
)
from specgate.gateway.engine_core.model_info import ModelInfo
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest


@dataclass(slots=True)
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    response_id: str
    logprobs: int | None  # top logprobs to report, None for none
    tools: bool  # parse tool calls out of the output
    echo: str = ""  # completions with echo: the prompt text, sent before the output
    n: int = 1  # choices: sequences sampled from the one prompt (params.n)


def prompt_chars(req: ChatCompletionRequest | CompletionRequest) -> int:
    """About how much the chat template renders or the tokenizer reads, without either: every
    message's text, name and tool calls, the tools; a completion's prompt (token ids count one
    each: they are checked and maybe decoded). For requests that did not come as an HTTP body."""
    if isinstance(req, ChatCompletionRequest):
        total = 0
        for m in req.messages:
            if isinstance(m.content, str):
                total += len(m.content)
            elif m.content:
                total += sum(len(str(p.get("text", ""))) for p in m.content)
            total += len(m.name or "") + len(m.tool_call_id or "")
            total += sum(len(str(c)) for c in m.tool_calls or ())
        return total + sum(len(str(t)) for t in req.tools or ())
    prompt = req.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)


def too_long(model: ModelInfo, tokens: int, param: str, limit: int | None = None) -> GatewayError:
    asked = f" + {limit} completion" if limit is not None else ""
    return GatewayError(
        400,
        f"This model's maximum context length is {model.max_model_len} tokens. However, you requested "
        f"{tokens} prompt{asked} tokens. Please reduce the length of the {param} or completion.",
        code="context_length_exceeded",
        param=param,
    )


def text_fits(model: ModelInfo, text: str, param: str) -> None:
    """Refuse a text that cannot fit the context before it is tokenized: no token is longer than
    `max_token_chars` characters, so a text longer than that many times the context is too long."""
    if len(text) > model.max_model_len * model.max_token_chars:
        raise GatewayError(
            400,
            f"This model's maximum context length is {model.max_model_len} tokens. However, your "
            f"{param} is {len(text)} characters long, more than that many tokens can hold. Please "
            f"reduce the length of the {param}.",
            code="context_length_exceeded",
            param=param,
        )


def _refuse(message: str, param: str, code: str = "unsupported_parameter") -> GatewayError:
    return GatewayError(400, message, code=code, param=param)


def _in_vocab(token_ids: Iterable[int], vocab: int, param: str, what: str) -> None:
    if any(t >= vocab for t in token_ids):
        raise GatewayError(400, f"{what} in [0, {vocab}) for this model", code="invalid_value", param=param)


def prepare(call: BackendCall, model: ModelInfo) -> Prepared:
    req = call.request
    n = req.n or 1
    if n > MAX_N:
        raise _refuse(
            f"n must be at most {MAX_N} on the embedded engine; got {n} (send several requests)",
            "n",
            code="invalid_value",
        )
    # Unknown fields pass validation so that vendor extensions reach external backends; the embedded
    # engine honours none of them, so a set one is refused, never silently dropped.
    for name, value in (req.model_extra or {}).items():
        if value is not None:
            raise _refuse(f"{name} is not supported by the embedded engine", name)
    grammar, grammar_param = requested_grammar(req)
    if grammar is not None:
        grammar = checked(grammar, grammar_param)
    if isinstance(req, ChatCompletionRequest):
        prompt_ids, tools = _chat_prompt(req, model)
        forced = _tool_grammar(req, model)
        if forced is not None:
            if grammar is not None:
                raise GatewayError(
                    400,
                    f"tool_choice forces a tool call, which {grammar_param} contradicts; send one of them",
                    code="invalid_value",
                    param="tool_choice",
                )
            grammar, grammar_param = forced, "tool_choice"
        elif grammar is None and tools:
            # tool_choice "auto": prose stays free, a tool call the model opens must be a valid one.
            native = template_supports_tools(chat_template_for(model.tokenizer, model.chat_template))
            functions = _checked_parameters([t["function"] for t in req.tools or ()])
            grammar = _lark(tool_tags_lark(functions, native, tag_markers(model.tokenizer)), "tools")
            grammar_param = "tools"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        rid, echo, param = f"chatcmpl-{call.request_id}", "", "messages"
    else:
        assert isinstance(req, CompletionRequest)
        prompt_ids, echo = _completion_prompt(req, model)
        tools, logprobs = False, req.logprobs
        rid, param = f"cmpl-{call.request_id}", "prompt"
    for name in ("ignore_eos", "min_tokens"):
        if grammar is not None and getattr(req, name):
            raise GatewayError(
                400,
                f"{name} cannot be combined with {grammar_param}: the grammar decides where the output ends",
                code="invalid_value",
                param=name,
            )
    vocab = model.vocab_size
    _in_vocab(req.stop_token_ids or (), vocab, "stop_token_ids", "stop_token_ids must be")
    bias = {int(t): v for t, v in (req.logit_bias or {}).items()}
    _in_vocab(bias, vocab, "logit_bias", "logit_bias keys must be token ids")
    room = model.max_model_len - len(prompt_ids)
    limit = req.token_limit
    if room < 1 or (limit is not None and limit > room):
        raise too_long(model, len(prompt_ids), param, limit)
    max_tokens = limit if limit is not None else room
    if n > 1:
        max_tokens = _n_fits(model, len(prompt_ids), n, limit, room)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            seed=req.seed,
            stop=req.stops,
            stop_token_ids=req.stop_token_ids or (),
            ignore_eos=bool(req.ignore_eos),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            min_tokens=req.min_tokens or 0,
            logprobs=logprobs,
            logit_bias=bias,
            grammar=grammar,
            n=n,
        )
    except ValueError as exc:
        raise GatewayError(400, str(exc), code="invalid_value") from exc
    return Prepared(prompt_ids, params, rid, logprobs, tools, echo, n)


def _n_fits(model: ModelInfo, prompt_tokens: int, n: int, limit: int | None, room: int) -> int:
    """max_tokens for each of n > 1 sequences, which must fit the KV pool together: they share the
    prompt's full blocks and each holds the rest of its own (the engine's SequenceGroup). Without a
    limit, each may grow as far as that allows (at most to the context); a limit that can never fit
    is a 400 naming n."""
    bs = model.block_size
    shared = (prompt_tokens - 1) // bs  # blocks the sequences share: the last prompt token is each one's
    longest = (shared + (model.kv_blocks - shared) // n) * bs  # tokens one sequence may hold
    fits = min(room, longest - prompt_tokens)
    asked = limit if limit is not None else 1
    if asked > fits:
        raise _refuse(
            f"n={n} choices of {prompt_tokens} prompt + {asked} completion tokens cannot fit the embedded "
            f"engine's KV cache together ({model.kv_blocks} blocks of {bs} tokens); lower n or max_tokens",
            "n",
            code="invalid_value",
        )
    return limit if limit is not None else fits


def _tool_grammar(req: ChatCompletionRequest, model: ModelInfo) -> Grammar | None:
    """The grammar a forced tool_choice ("required", a named function) sets: the answer is tool calls
    in the model's format whose arguments follow each function's parameters. A named function is
    called exactly once (OpenAI: "call exactly one specific function"; vLLM answers one call);
    "required" allows several unless parallel_tool_calls is false."""
    try:
        functions = forced_tool(req.tools, req.tool_choice)
    except ValueError as exc:
        raise GatewayError(400, str(exc), code="invalid_value", param="tool_choice") from None
    if functions is None:
        return None
    _checked_parameters(functions)  # each schema's depth and size too (Grammar's own limits)
    native = template_supports_tools(chat_template_for(model.tokenizer, model.chat_template))
    named = isinstance(req.tool_choice, Mapping)
    parallel = req.parallel_tool_calls is not False and not named
    lark = tool_call_lark(functions, parallel, native, tag_markers(model.tokenizer))
    return _lark(lark, "tools")


def _checked_parameters(functions: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The functions, once each one's parameter schema is one the grammar library enforces whole (a
    400 naming `tools` otherwise). The tool-call grammar around them is written here, so it is
    checked where it is compiled, against the model's tokenizer (it may name the tags' tokens)."""
    for fn in functions:
        params = fn.get("parameters")
        if params is not None:
            try:
                grammar = Grammar.json_schema(params)
            except ValueError as exc:
                raise GatewayError(400, f"tools: {exc}", code="invalid_value", param="tools") from None
            checked(grammar, "tools")
    return functions


def _lark(text: str, param: str) -> Grammar:
    try:
        return Grammar("lark", text)
    except ValueError as exc:  # over the grammar size limit: the tools' schemas are too big
        raise GatewayError(400, f"{param}: {exc}", code="invalid_value", param=param) from None


@contextmanager
def template_errors() -> Iterator[None]:
    """Rendering and reading messages: what the messages or the template refuse is a 400 naming
    `messages`, never a 500."""
    try:
        yield
    except GatewayError:
        raise
    except ValueError as exc:
        raise GatewayError(400, str(exc), code="invalid_value", param="messages") from exc
    except Exception as exc:  # jinja errors: the template rejected this conversation
        raise GatewayError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc


def _chat_prompt(req: ChatCompletionRequest, model: ModelInfo) -> tuple[list[int], bool]:
    tok = model.tokenizer
    with template_errors():
        messages, tools = normalize_messages(
            tok, req.messages, req.tools, req.tool_choice, model.chat_template
        )
        text = chat_text(tok, messages, tools, model.chat_template)
        text_fits(model, text, "messages")
        ids = encode(tok, text)
    return ids, bool(req.tools) and req.tool_choice != "none"


def _completion_prompt(req: CompletionRequest, model: ModelInfo) -> tuple[list[int], str]:
    if req.suffix:
        raise _refuse("suffix is not supported by the embedded engine", "suffix")
    if (req.best_of or 1) > 1:
        raise _refuse("best_of > 1 is not supported by the embedded engine (n is)", "best_of")
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) > 1:
            raise _refuse(
                "batched prompts are not supported by the embedded engine; send one per request", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise GatewayError(400, "prompt must not be empty", code="invalid_value", param="prompt")
        text_fits(model, prompt, "prompt")
        ids = list(model.tokenizer.encode(prompt))
        text = prompt
    else:
        if len(prompt) > model.max_model_len:  # before anything proportional to it (echo decodes)
            raise too_long(model, len(prompt), "prompt", req.token_limit)
        ids = [int(t) for t in prompt]
        vocab = model.vocab_size
        if not ids or min(ids) < 0 or max(ids) >= vocab:
            raise GatewayError(
                400, f"prompt token ids must be in [0, {vocab})", code="invalid_value", param="prompt"
            )
        text = model.tokenizer.decode(ids) if req.echo else ""
    return ids, text if req.echo else ""
