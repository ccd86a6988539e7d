"""What the policy knows of a request before dispatch, free of any web framework's types."""

from __future__ import annotations

from dataclasses import dataclass, field

# The classifier reads the head and the tail of a long prompt: the instruction sits at one end or
# the other, and the cost of featurizing must not grow with a 100 KB RAG context.
HEAD_CHARS = 1500
TAIL_CHARS = 500


@dataclass(slots=True)
class RequestInfo:
    text: str  # the user-visible prompt: system + user turns (or the completion prompt)
    last_user: str = ""  # the latest user turn; the instruction usually lives here
    tool_names: list[str] = field(default_factory=list)
    tool_descriptions: list[str] = field(default_factory=list)
    json_mode: bool = False  # response_format json_object / json_schema, or tool_choice forcing a call
    num_messages: int = 1
    prompt_tokens: int | None = None  # exact when the gateway could count them, else estimated
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")

    @property
    def has_tools(self) -> bool:
        return bool(self.tool_names)

    @property
    def approx_prompt_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else max(1, len(self.text) // 4)

    def classifier_text(self) -> str:
        """The bounded text the text model reads: head and tail of the prompt, then tool summaries."""
        text = self.text
        if len(text) > HEAD_CHARS + TAIL_CHARS:
            text = text[:HEAD_CHARS] + "\n" + text[-TAIL_CHARS:]
        if self.last_user and self.last_user not in text:
            text = text + "\n" + self.last_user[:TAIL_CHARS]
        if self.tool_names:
            tools = "; ".join(
                f"{n}: {d}" for n, d in zip(self.tool_names, self.tool_descriptions, strict=False)
            )
            text = text + "\nTOOLS " + tools[:TAIL_CHARS]
        return text
