"""Turning chat messages into prompt token ids with the model's chat template: the configured one
(`embedded.chat_template`: a built-in name or Jinja) where there is one, else the tokenizer's own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specgate.gateway.backends.embedded.builtin_templates import BUILTIN_TEMPLATES
from specgate.gateway.backends.embedded.tools import (
    render_tool_calls_as_text,
    template_supports_tools,
    tools_system_prompt,
)

SETTING = "embedded.chat_template (--chat-template)"
NO_TEMPLATE = (
    "this model has no chat template: start the gateway with --chat-template NAME|JINJA or "
    "--chat-template-file PATH (setting embedded.chat_template), or use the completions API"
)


def is_jinja(value: str) -> bool:
    """Whether a configured template is Jinja text rather than a built-in's name."""
    return "{%" in value or "{{" in value


def configured_template(value: str | None) -> str | None:
    """The template text a configured `embedded.chat_template` stands for: the built-in of that
    name, or the Jinja it is; None when none is configured. ValueError for an unknown name."""
    if value is None:
        return None
    if is_jinja(value):
        return value
    template = BUILTIN_TEMPLATES.get(value.strip())
    if template is None:
        raise ValueError(
            f"{SETTING}: {value[:64]!r} is not a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
            "nor Jinja (which has {% or {{)"
        )
    return template


def chat_template_for(tokenizer: Any, configured: str | None) -> str | None:
    """The template chat is rendered with for this tokenizer: the configured one overrides the
    model's own (as llama-server's --chat-template does); None when there is neither."""
    template = configured_template(configured)
    return template if template is not None else getattr(tokenizer, "chat_template", None)


def check_template(value: str | None) -> None:
    """At start-up: a configured template names a built-in or is Jinja that compiles, so that a
    mistake stops the gateway with a message instead of failing every chat request."""
    template = configured_template(value)
    if template is None:
        return
    # The renderer's own compiler: its sandbox and extensions are what the template runs under.
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except Exception as exc:
        where = "embedded.chat_template (--chat-template or --chat-template-file)"
        raise ValueError(f"{where}: the Jinja template does not compile: {exc}") from None


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template: str | None = None,
) -> list[int]:
    """The conversation's prompt token ids, as the chat template writes it (`template`: the
    configured one, which overrides the tokenizer's own)."""
    return encode(tokenizer, chat_text(tokenizer, messages, tools, template))


def chat_text(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template: str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The conversation as the chat template writes it, ready for `encode` (`add_generation_prompt`:
    the assistant's turn opened after it, as chat requests always have it; /tokenize may not)."""
    chosen = chat_template_for(tokenizer, template)
    if chosen is None:
        raise ValueError(NO_TEMPLATE)
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        # Unconfigured, the tokenizer picks its own (of several named ones, by the tools).
        chat_template=chosen if template is not None else None,
    )
    return str(text)


def encode(tokenizer: Any, rendered: str) -> list[int]:
    """A rendered conversation's token ids (its special tokens are in the text already, as
    apply_chat_template's own tokenizing does it)."""
    encoded = tokenizer(rendered, add_special_tokens=False)
    return [int(t) for t in encoded["input_ids"]]


def normalize_messages(
    tokenizer: Any,
    messages: Sequence[Any],  # gateway.schemas.ChatMessage
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    template: str | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages as plain-text dicts the template can render, and the tools to hand to the template.

    A template without tool support gets the tools as a system message and earlier tool calls as
    the text the model would have written; "developer" becomes "system" for templates that predate it.
    """
    native = template_supports_tools(chat_template_for(tokenizer, template))
    use_tools = [dict(t) for t in tools or []] if tool_choice != "none" else []
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:
            if native:
                msg["tool_calls"] = m.tool_calls
            else:
                msg["content"] = "\n".join(
                    p for p in (msg["content"], render_tool_calls_as_text(m.tool_calls)) if p
                )
        if m.tool_call_id and native:
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    if use_tools and not native:
        prompt = tools_system_prompt(use_tools, tool_choice)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
        return out, None
    return out, use_tools or None
