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
        )


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
