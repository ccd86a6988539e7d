"""Tool calling on the embedded engine, in the Hermes convention that Qwen, SmolLM and others use.

The model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; we parse those blocks
back into OpenAI `tool_calls`. Chat templates that know about tools render them themselves; for the
others, the tool list goes into a system message written in the same convention.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from specgate.engine.structured_output.grammar import closed_objects

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def forced_tool(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any
) -> list[Mapping[str, Any]] | None:
    """The functions a forced tool_choice allows ("required": any of the tools; a named function:
    that one), or None when the choice does not force a call. ValueError for a name not in tools."""
    if tool_choice == "required":
        if not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return [t["function"] for t in tools]
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}")
        match = [t["function"] for t in tools or () if t["function"].get("name") == name]
        if not match:
            raise ValueError(f"tool_choice names the function {name[:64]!r}, which is not in tools")
        return match[:1]
    return None


def _arguments_schema(fn: Mapping[str, Any]) -> dict[str, Any]:
    # Unlisted arguments only where the parameters say so, as for response_format (structured.py).
    params = dict(closed_objects(fn.get("parameters") or {"type": "object", "properties": {}}))
    # The arguments in the form the format's example shows: one space after ',' and ':'.
    params["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return params


def tag_markers(tokenizer: Any) -> tuple[str, str]:
    """How a grammar writes `<tool_call>` and `</tool_call>` for this tokenizer: by token id where
    the tokenizer holds the tag as one token (Qwen's added tokens, which the grammar library reads
    as special tokens, not as their text), as a string literal otherwise."""
    out = []
    for tag in (OPEN, CLOSE):
        ids = tokenizer.encode(tag, add_special_tokens=False) if tokenizer is not None else []
        out.append(f"<[{int(ids[0])}]>" if len(ids) == 1 else json.dumps(tag))
    return out[0], out[1]


def _call_rule(name: str, fn: Mapping[str, Any], markers: tuple[str, str], native: bool) -> str:
    """One function's call in the model's format, its arguments following the parameters."""
    # Templates that render tools themselves (Qwen's) put each call on its own lines; the system
    # prompt written here shows it inline.
    nl = "\n" if native else ""
    head = json.dumps(f'{nl}{{"name": {json.dumps(fn["name"])}, "arguments": ')
    tail = json.dumps(f"}}{nl}")
    schema = json.dumps(_arguments_schema(fn))
    return f"{name}: {markers[0]} {head} {name}_args {tail} {markers[1]}\n{name}_args: %json {schema}"


def tool_tags_lark(functions: Sequence[Mapping[str, Any]], native: bool, markers: tuple[str, str]) -> str:
    """A Lark grammar for tool_choice "auto": free text, in which every `<tool_call>` the model opens
    must be a call of one of the functions with arguments that follow its parameters, so a tool call
    is valid by construction and prose is untouched. Where the tag is one token, text runs until
    that token; otherwise the text tag is a lazy trigger (llguidance's StructTag)."""
    if markers[0].startswith("<["):
        rules = [_call_rule(f"tag_{i}", fn, markers, native) for i, fn in enumerate(functions)]
        options = " | ".join(f"TAG_TEXT tag_{i}" for i in range(len(functions)))
        return "\n".join(["%llguidance {}", f"start: ({options})* TAG_TEXT", "TAG_TEXT: /(.|\\n)*/", *rules])
    from llguidance import StructTag

    nl = "\n" if native else ""
    tags = [
        StructTag(
            trigger=OPEN,
            begin=f'{OPEN}{nl}{{"name": {json.dumps(fn["name"])}, "arguments": ',
            grammar=_arguments_schema(fn),
            end=f"}}{nl}{CLOSE}",
        )
        for fn in functions
    ]
    return str(StructTag.to_grammar(tags, assume_special=False))


def tool_call_lark(
    functions: Sequence[Mapping[str, Any]],
    parallel: bool,
    native: bool,
    markers: tuple[str, str] = ('"<tool_call>"', '"</tool_call>"'),
) -> str:
    """A Lark grammar (llguidance's dialect) of the answer a forced tool_choice allows: one call, or
    one or more with parallel_tool_calls, each in the model's own tool-call format with its arguments
    following the function's parameter schema."""
    rules = [_call_rule(f"call_{i}", fn, markers, native) for i, fn in enumerate(functions)]
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    top = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([top, f"call: {calls}", *rules])


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in str(chat_template)


def tools_system_prompt(tools: Sequence[Mapping[str, Any]], tool_choice: Any) -> str:
    specs = "\n".join(json.dumps(t["function"], separators=(",", ":")) for t in tools)
    text = (
        "You may call functions to help with the user's request. The functions are listed in "
        f"<tools></tools> tags:\n<tools>\n{specs}\n</tools>\n"
        "To call a function, reply with a JSON object holding its name and arguments inside "
        f'{OPEN}{CLOSE} tags, for example:\n{OPEN}{{"name": "fn", "arguments": {{"x": 1}}}}{CLOSE}'
    )
    if tool_choice == "required":
        text += "\nYou must call at least one function."
    elif isinstance(tool_choice, Mapping):
        text += f"\nYou must call the function {tool_choice.get('function', {}).get('name')!r}."
    return text


def render_tool_calls_as_text(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant turn's earlier tool calls, written back the way the model would have written them."""
    blocks = []
    for call in tool_calls:
        fn = call.get("function", {})
        args = fn.get("arguments", "{}")
        try:
            args_obj = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            args_obj = args
        blocks.append(f"{OPEN}{json.dumps({'name': fn.get('name'), 'arguments': args_obj})}{CLOSE}")
    return "\n".join(blocks)


class ToolCallParser:
    """Splits streamed text into plain content and tool calls.

    Text that may be the start of `<tool_call>` is held back until it is known not to be; text
    inside a block is kept until the block closes. Whitespace alone between blocks, or before the
    first or after the last, is the format's, not content: it is held until text follows it.
    `finish()` parses the blocks.
    """

    def __init__(self) -> None:
        self._held = ""
        self._blocks: list[str] = []
        self._inside = False
        self._text = False  # content shown since the start or the last block

    def feed(self, text: str) -> str:
        """Returns the content that can be shown now."""
        self._held += text
        out = []
        while self._held:
            if self._inside:
                end = self._held.find(CLOSE)
                if end < 0:
                    break
                self._blocks.append(self._held[:end])
                self._held = self._held[end + len(CLOSE) :]
                self._inside = False
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                before = self._held[:start]
                if self._text or before.strip():
                    out.append(before)
                self._held = self._held[start + len(OPEN) :]
                self._inside = True
                self._text = False
                continue
            keep = _partial_suffix(self._held, OPEN)
            visible = self._held[: len(self._held) - keep]
            if not self._text and not visible.strip():
                break  # whitespace alone since the last block: it waits to see what follows it
            self._text = True
            out.append(visible)
            self._held = self._held[len(self._held) - keep :]
            break
        return "".join(out)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still held back, parsed tool calls). An unparseable block stays content."""
        rest = self._held if not self._inside else OPEN + self._held
        if self._blocks and not rest.strip():
            rest = ""  # the whitespace after the last block
        calls: list[dict[str, Any]] = []
        bad: list[str] = []
        for block in self._blocks:
            call = _parse_block(block)
            if call is None:
                bad.append(f"{OPEN}{block}{CLOSE}")
            else:
                calls.append(call)
        return "".join(bad) + rest, calls


def _partial_suffix(text: str, token: str) -> int:
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def _parse_block(block: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(block.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
    }
