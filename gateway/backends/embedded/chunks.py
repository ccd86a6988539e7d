"""Engine outputs as OpenAI answers: the whole message of a completed request, and the chunks of a
streamed one (tool calls parsed out of the text as it comes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specgate.engine.outputs import RequestOutput, TokenLogprob
from specgate.gateway.backends.base import BackendCall
from specgate.gateway.backends.embedded.prompt import Prepared
from specgate.gateway.backends.embedded.tools import ToolCallParser
from specgate.gateway.protocol import openai_format as fmt


def chat_message(text: str, parse_tools: bool) -> dict[str, Any]:
    """The assistant message for a whole output, tool calls parsed out when the request had tools."""
    if not parse_tools:
        return {"role": "assistant", "content": text}
    parser = ToolCallParser()
    content = parser.feed(text)
    rest, calls = parser.finish()
    content += rest
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


def final_body(
    call: BackendCall,
    prep: Prepared,
    text: str,
    lps: list[TokenLogprob],
    finish: str | None,
    use: dict[str, Any],
    text_of: Callable[[int], str],
) -> dict[str, Any]:
    """The whole answer of a request that was not streamed."""
    rid, model = prep.response_id, call.model
    if call.kind == "completion":
        logprobs = None
        if prep.logprobs is not None:
            logprobs = fmt.completion_logprobs(lps, text_of, prep.logprobs, len(prep.echo))
        return fmt.completion_response(rid, call.created, model, prep.echo + text, finish, use, logprobs)
    message = chat_message(text, prep.tools)
    if "tool_calls" in message and finish == "stop":  # cut by max_tokens, it stays "length"
        finish = "tool_calls"
    logprobs = fmt.chat_logprobs(lps, text_of, prep.logprobs) if prep.logprobs is not None else None
    return fmt.chat_response(rid, call.created, model, message, finish, use, logprobs)


class ChunkWriter:
    """Turns engine outputs into OpenAI stream chunks (role first, tool calls parsed on the fly)."""

    def __init__(self, call: BackendCall, prep: Prepared, text_of: Any) -> None:
        self.call, self.prep, self.text_of = call, prep, text_of
        self.parser = ToolCallParser() if prep.tools else None
        self.started = False
        self.offset = len(prep.echo)

    def _chunk(
        self,
        text: str,
        finish: str | None = None,
        lps: list[TokenLogprob] | None = None,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        c, p = self.call, self.prep
        if c.kind == "completion":
            logprobs = None
            if p.logprobs is not None and lps is not None:
                logprobs = fmt.completion_logprobs(lps, self.text_of, p.logprobs, self.offset)
            self.offset += len(text)
            return fmt.completion_chunk(p.response_id, c.created, c.model, text, finish, logprobs)
        logprobs = (
            fmt.chat_logprobs(lps, self.text_of, p.logprobs) if p.logprobs is not None and lps else None
        )
        d = delta if delta is not None else ({"content": text} if text else {})
        return fmt.chat_chunk(p.response_id, c.created, c.model, d, finish, logprobs)

    def write(self, out: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        if not self.started:
            self.started = True
            if self.call.kind == "chat":
                chunks.append(self._chunk("", delta={"role": "assistant", "content": ""}))
            elif self.prep.echo:
                chunks.append(self._chunk(self.prep.echo))
        text = self.parser.feed(out.new_text) if self.parser is not None else out.new_text
        if text or (out.logprobs and self.prep.logprobs is not None):
            chunks.append(self._chunk(text, lps=out.logprobs))
        return chunks

    def finish(self, out: RequestOutput) -> list[dict[str, Any]]:
        chunks, finish = [], out.finish_reason
        if self.parser is not None:
            rest, calls = self.parser.finish()
            if rest:
                chunks.append(self._chunk(rest))
            if calls:
                if finish == "stop":  # cut by max_tokens, it stays "length"
                    finish = "tool_calls"
                deltas = [{**tc, "index": i} for i, tc in enumerate(calls)]
                chunks.append(self._chunk("", delta={"tool_calls": deltas}))
        last = self._chunk("", finish)
        last["metrics"] = fmt.metrics_from_stats(out.stats, self.call.route)
        use = fmt.usage(len(self.prep.prompt_ids), out.stats.num_output_tokens, out.stats.num_cached_tokens)
        if self.call.request.include_usage:
            last["usage"] = None
            obj = "chat.completion.chunk" if self.call.kind == "chat" else "text_completion"
            tail = fmt.usage_chunk(self.prep.response_id, self.call.created, self.call.model, obj, use)
            tail["metrics"] = last["metrics"]
            return [*chunks, last, tail]
        return [*chunks, last]
