"""A pass-through call: a request for an endpoint the gateway does not serve itself (embeddings,
rerank, tokenize and detokenize of an external model), relayed to an external backend as sent.

It is not a `BackendCall`: there is no completion request behind it, nothing to route by policy
and no stream; only the body, where it goes, and the `Observation` the record is built from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from specgate.gateway.backends.base import Observation

Relayed = Literal["embeddings", "rerank", "tokenize", "detokenize"]


@dataclass(slots=True)
class RelayCall:
    request_id: str
    endpoint: Relayed
    model: str  # the public model name the client asked for (the backend gets its own name for it)
    body: dict[str, Any]  # the client's body as validated, unknown fields kept
    # Where it goes on the backend: below its `base_url` (`/embeddings`), or with `root` below the
    # server's root, `base_url` without its /v1 (vLLM's and llama.cpp's `/tokenize`).
    path: str
    root: bool = False
    observed: Observation = field(default_factory=Observation)
