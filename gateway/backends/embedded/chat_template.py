"""Turning chat messages into prompt token ids with the model's own chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specgate.gateway.backends.embedded.tools import (
    render_tool_calls_as_text,
    template_supports_tools,
    tools_system_prompt,
)


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> list[int]:
    """The conversation's prompt token ids, as the model's chat template writes it."""
    return encode(tokenizer, chat_text(tokenizer, messages, tools))


def chat_text(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> str:
    """The conversation as the model's chat template writes it, ready for `encode`."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use the completions API")
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        add_generation_prompt=True,
        tokenize=False,
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
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages as plain-text dicts the template can render, and the tools to hand to the template.

    A template without tool support gets the tools as a system message and earlier tool calls as
    the text the model would have written; "developer" becomes "system" for templates that predate it.
    """
    native = template_supports_tools(getattr(tokenizer, "chat_template", None))
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
