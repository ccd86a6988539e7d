"""What the gateway needs to know of the loaded model, wherever the engine runs.

Requests are validated and tokenized on the gateway side (`prompt.py`), so the gateway needs the
tokenizer and a few limits, but never the engine itself: in process mode the engine lives in the
engine-core process, which sends this once, in its ready message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from specgate.engine.config import EngineConfig
from specgate.engine.engine import Engine
from specgate.engine.spec_decode.proposers import proposer_names

logger = logging.getLogger("specgate.embedded")


@dataclass(slots=True)
class ModelInfo:
    # The engine's own tokenizer (pickled across in process mode: the very object the engine
    # detokenizes with, with no second copy of the loader's logic, GGUF conversion cache included).
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    config: EngineConfig  # as the engine resolved it ("auto" dtype and device decided)
    methods: list[str]  # speculation methods this engine can build
    # No token decodes to more characters than this: a text over max_model_len times as long
    # cannot fit, and is refused before it is tokenized.
    max_token_chars: int = 256

    @classmethod
    def of(cls, engine: Engine) -> ModelInfo:
        """Read off a loaded engine (on whichever thread or process owns it: building proposers
        may load a draft model)."""
        return cls(
            engine.tokenizer,
            engine.runner.vocab_size,
            engine.max_model_len,
            engine.config,
            buildable_methods(engine),
            longest_token(engine.tokenizer),
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
    out = []
    for name in proposer_names():
        try:
            engine.proposer(name)
        except (ValueError, FileNotFoundError) as exc:
            logger.info("speculation method %s unavailable: %s", name, exc)
        else:
            out.append(name)
    return out
