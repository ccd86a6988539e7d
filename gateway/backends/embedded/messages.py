"""What the engine's owner (a thread, or the engine-core process) and the event loop tell each other.

The owner sends one `Batch` per step: that step's outputs and refusals together with the engine's
load and state after it, so the gateway's view of the engine is always one consistent snapshot.
Everything here is picklable: in process mode it crosses a socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specgate.engine.outputs import RequestOutput

Item = RequestOutput | BaseException
# ("add", (request_id, prompt_ids, params, spec, cache_scope, prefix_salt)), ("abort", request_id),
# ("stop", None)
Command = tuple[str, Any]
READY, REBUILDING = "ready", "rebuilding"


class EngineUnavailable(RuntimeError):
    """The engine is being rebuilt or restarted: the request was not served, and may be sent again."""


@dataclass(slots=True)
class Load:
    """The engine's load as of its last step."""

    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    batch_tokens: int = 0
    step_time: float = 0.0
    steps: int = 0
    kv_blocks_used: int = 0


@dataclass(slots=True)
class Batch:
    """One step's news for the event loop."""

    deliveries: list[tuple[str, Item]]
    taken: int  # submissions the engine took (admitted or refused) since the last batch
    load: Load
    state: str = READY
    rebuilds: int = 0
    last_error: str | None = None


@dataclass(slots=True)
class LoadFailed:
    """The engine-core process could not build its first engine; it exits after sending this."""

    error: str
