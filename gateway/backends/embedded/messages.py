"""What the engine's owner (a thread, or the engine-core process) and the event loop tell each other.

The owner sends one `Batch` per step: that step's outputs and refusals together with the engine's
load and state after it, so the gateway's view of the engine is always one consistent snapshot.
Everything here is picklable: in process mode it crosses a socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specgate.engine.outputs import RequestOutput
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.params import SpecParams

Item = RequestOutput | BaseException
# ("add", Submission), ("abort", request_id), ("stop", None)
Command = tuple[str, Any]
READY, REBUILDING = "ready", "rebuilding"


@dataclass(slots=True)
class Submission:
    """One request for the engine, with the arguments of `Engine.add_request`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecParams | None
    cache_scope: str | None = ""  # None: shares no drafting state
    prefix_salt: str | None = ""  # None: shares no cached prompt blocks
    tenant: str = ""  # whom batch slots are shared fairly with

    def add_to(self, engine: Any) -> None:
        engine.add_request(
            self.request_id,
            self.prompt_ids,
            self.params,
            self.spec,
            cache_scope=self.cache_scope,
            prefix_salt=self.prefix_salt,
            tenant=self.tenant,
        )


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
