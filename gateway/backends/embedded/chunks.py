"""Engine outputs as OpenAI answers: the whole message of a completed request, and the chunks of a
streamed one (tool calls parsed out of the text as it comes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specgate.engine.outputs import RequestOutput, RequestStats, TokenLogprob
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


# One sequence's whole output: its text, its logprobs, its finish reason.
Answer = tuple[str, list[TokenLogprob], str | None]


def final_body(
    call: BackendCall,
    prep: Prepared,
    answers: list[Answer],
    use: dict[str, Any],
    text_of: Callable[[int], str],
) -> dict[str, Any]:
    """The whole answer of a request that was not streamed: one choice per sequence (n), by index."""
    rid, model = prep.response_id, call.model
    choices = []
    for index, (text, lps, finish) in enumerate(answers):
        if call.kind == "completion":
            logprobs = None
            if prep.logprobs is not None:
                logprobs = fmt.completion_logprobs(lps, text_of, prep.logprobs, len(prep.echo))
            choices.append(fmt.completion_choice(index, prep.echo + text, finish, logprobs))
            continue
        message = chat_message(text, prep.tools)
        if "tool_calls" in message and finish == "stop":  # cut by max_tokens, it stays "length"
            finish = "tool_calls"
        logprobs = fmt.chat_logprobs(lps, text_of, prep.logprobs) if prep.logprobs is not None else None
        choices.append(fmt.chat_choice(index, message, finish, logprobs))
    if call.kind == "completion":
        body = fmt.completion_response(rid, call.created, model, "", None, use)
    else:
        body = fmt.chat_response(rid, call.created, model, {}, None, use)
    body["choices"] = choices
    return body


class _Choice:
    """One choice's stream state: whether its first chunk went out, its tool-call parser, and (for
    completions' logprobs) the text offset it has reached."""

    __slots__ = ("index", "offset", "parser", "started")

    def __init__(self, index: int, prep: Prepared) -> None:
        self.index = index
        self.parser = ToolCallParser() if prep.tools else None
        self.started = False
        self.offset = len(prep.echo)


def final_stats(finals: list[RequestOutput]) -> list[RequestStats]:
    """Each sequence's counters, from its finished output (the one output that carries them)."""
    stats = [o.stats for o in finals]
    if any(s is None for s in stats):
        raise ValueError("counters come with finished outputs only")
    return [s for s in stats if s is not None]


def usage_of(prep: Prepared, stats: list[RequestStats]) -> dict[str, Any]:
    """OpenAI's usage of a request's sequences: the prompt (and its cached tokens) once, the
    completion tokens of every choice summed."""
    out = sum(s.num_output_tokens for s in stats)
    return fmt.usage(len(prep.prompt_ids), out, stats[0].num_cached_tokens)


def metrics_of(call: BackendCall, stats: list[RequestStats]) -> dict[str, Any]:
    """The request's `metrics`: its one sequence's, or its n choices' together."""
    if len(stats) == 1:
        return fmt.metrics_from_stats(stats[0], call.route)
    return fmt.metrics_of_choices(stats, call.route)


class ChunkWriter:
    """Turns engine outputs into OpenAI stream chunks (role first, tool calls parsed on the fly).

    With n > 1 the choices' chunks interleave as their sequences' outputs come, each naming its
    `index`; each choice's last chunk carries its finish reason and that sequence's `metrics`, and
    once every choice has finished, the usage chunk (when asked) carries the request's usage and
    metrics, all choices together."""

    def __init__(self, call: BackendCall, prep: Prepared, text_of: Any) -> None:
        self.call, self.prep, self.text_of = call, prep, text_of
        self.choices = [_Choice(i, prep) for i in range(prep.n)]
        self.finals: dict[int, RequestOutput] = {}  # each finished choice's last output

    @property
    def done(self) -> bool:
        return len(self.finals) == len(self.choices)

    def final_stats(self) -> list[RequestStats]:
        """Every choice's counters, by index, once all have finished."""
        return final_stats([self.finals[i] for i in range(len(self.choices))])

    def _chunk(
        self,
        choice: _Choice,
        text: str,
        finish: str | None = None,
        lps: list[TokenLogprob] | None = None,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        c, p = self.call, self.prep
        if c.kind == "completion":
            logprobs = None
            if p.logprobs is not None and lps is not None:
                logprobs = fmt.completion_logprobs(lps, self.text_of, p.logprobs, choice.offset)
            choice.offset += len(text)
            return fmt.completion_chunk(
                p.response_id, c.created, c.model, text, finish, logprobs, choice.index
            )
        logprobs = (
            fmt.chat_logprobs(lps, self.text_of, p.logprobs) if p.logprobs is not None and lps else None
        )
        d = delta if delta is not None else ({"content": text} if text else {})
        return fmt.chat_chunk(p.response_id, c.created, c.model, d, finish, logprobs, choice.index)

    def write(self, out: RequestOutput) -> list[dict[str, Any]]:
        choice = self.choices[out.index]
        chunks = []
        if not choice.started:
            choice.started = True
            if self.call.kind == "chat":
                chunks.append(self._chunk(choice, "", delta={"role": "assistant", "content": ""}))
            elif self.prep.echo:
                chunks.append(self._chunk(choice, self.prep.echo))
        text = choice.parser.feed(out.new_text) if choice.parser is not None else out.new_text
        if text or (out.logprobs and self.prep.logprobs is not None):
            chunks.append(self._chunk(choice, text, lps=out.logprobs))
        return chunks

    def finish(self, out: RequestOutput) -> list[dict[str, Any]]:
        """A choice's last chunks (the rest of its text, its tool calls, its finish reason), and the
        usage chunk after the last choice's when the client asked for usage."""
        choice = self.choices[out.index]
        self.finals[out.index] = out
        chunks, finish = [], out.finish_reason
        if choice.parser is not None:
            rest, calls = choice.parser.finish()
            if rest:
                chunks.append(self._chunk(choice, rest))
            if calls:
                if finish == "stop":  # cut by max_tokens, it stays "length"
                    finish = "tool_calls"
                deltas = [{**tc, "index": i} for i, tc in enumerate(calls)]
                chunks.append(self._chunk(choice, "", delta={"tool_calls": deltas}))
        last = self._chunk(choice, "", finish)
        (own,) = final_stats([out])
        last["metrics"] = fmt.metrics_from_stats(own, self.call.route)
        if not self.call.request.include_usage:
            return [*chunks, last]
        last["usage"] = None
        if not self.done:
            return [*chunks, last]
        stats = self.final_stats()
        obj = "chat.completion.chunk" if self.call.kind == "chat" else "text_completion"
        use = usage_of(self.prep, stats)
        tail = fmt.usage_chunk(self.prep.response_id, self.call.created, self.call.model, obj, use)
        tail["metrics"] = last["metrics"] if len(stats) == 1 else metrics_of(self.call, stats)
        return [*chunks, last, tail]
