"""What a client needs to know of the loaded model, wherever the engine runs: the core's answer to
each connection, before any `Batch`.

Requests are validated and tokenized on the gateway side (`backends/embedded/prompt.py`), so the
gateway needs the tokenizer and a few limits, but never the engine itself. Nothing here imports
torch, and nothing it holds unpickles into torch: a gateway worker of `serve` reads it without
loading the engine (reading it off an engine, `ModelInfo.of`, is the core's job).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specgate.engine.engine import Engine

logger = logging.getLogger("specgate.embedded")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    # The engine's own tokenizer (pickled across from the core: the very object the engine
    # detokenizes with, with no second copy of the loader's logic, GGUF conversion cache included).
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    dtype: str  # as the engine resolved them ("auto" decided)
    device: str
    methods: list[str]  # speculation methods this engine can build
    known_methods: list[str]  # every method the engine registers, buildable here or not
    # No token decodes to more characters than this: a text over max_model_len times as long
    # cannot fit, and is refused before it is tokenized.
    max_token_chars: int = 256
    # The configured chat template (`embedded.chat_template`: a built-in name or Jinja), which
    # overrides the tokenizer's own. The gateway side sets it (it renders chat; the core never does).
    chat_template: str | None = None
    # The KV pool: what the n sequences of one request (n > 1) must fit in together.
    kv_blocks: int = 1 << 30
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.max_model_len < 1 or self.max_token_chars < 1:
            raise ValueError("vocab_size, max_model_len and max_token_chars must be positive")
        if self.kv_blocks < 1 or self.block_size < 1:
            raise ValueError("kv_blocks and block_size must be positive")

    @classmethod
    def of(cls, engine: Engine) -> ModelInfo:
        """Read off a loaded engine (on whichever thread or process owns it: building proposers
        may load a draft model)."""
        from specgate.engine.spec_decode.proposers import proposer_names  # torch: the core's side only

        return cls(
            engine.tokenizer,
            engine.runner.vocab_size,
            engine.max_model_len,
            engine.config.dtype,
            engine.config.device,
            buildable_methods(engine),
            proposer_names(),
            longest_token(engine.tokenizer),
            kv_blocks=engine.block_manager.num_blocks,
            block_size=engine.block_manager.block_size,
        )


def longest_token(tokenizer: Any) -> int:
    """The most characters one token's text has: its vocabulary entry is at least as long (a
    byte-level token spells each byte as one character, a byte-fallback token as six), and added
    tokens are spelled out whole."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary to list: assume the worst we allow
        return 256
    return max(1, max((len(t) for t in vocab), default=1))


def buildable_methods(engine: Engine) -> list[str]:
    """Registered proposers that build for this engine; the others (no draft model configured, no
    EAGLE head for this model) are left out of routing with the reason logged."""
    from specgate.engine.spec_decode.proposers import proposer_names  # torch: the core's side only

    out = []
    for name in proposer_names():
        try:
            engine.proposer(name)
        except (ValueError, FileNotFoundError) as exc:
            logger.info("speculation method %s unavailable: %s", name, exc)
        else:
            out.append(name)
    return out
