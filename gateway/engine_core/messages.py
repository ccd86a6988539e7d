"""What an engine core and its clients tell each other, as typed messages.

A client sends `AddRequest`, `AbortRequest` or `Shutdown`; the core answers a connection once with
its `ModelInfo` (or `LoadFailed`), then sends one `Batch` per step: that step's outputs and refusals
together with the engine's load and state after it, so a client's view of the engine is always one
consistent snapshot. A step's outputs are that step's news (`RequestOutput`: new tokens, text,
logprobs); a sequence's counters come once, with its finished output, so the bytes a request costs
the connection grow with its tokens, not with its steps times its tokens. Everything here pickles
(over a socket, the shared core's messages do) and imports no torch: a gateway worker unpickles
these without ever loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specgate.engine.outputs import RequestOutput
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import LoadSnapshot, SpecParams

Item = RequestOutput | BaseException
READY, REBUILDING = "ready", "rebuilding"


@dataclass(frozen=True, slots=True)
class AddRequest:
    """One request for the engine, with the arguments of `Engine.add_request`. `params.n` > 1 asks
    for n sequences of one prefilled prompt (parallel sampling): their outputs come as the request's,
    each naming its sequence (`RequestOutput.index`), and the request is over when all n are."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecParams | None
    cache_scope: str | None = ""  # None: shares no drafting state
    prefix_salt: str | None = ""  # None: shares no cached prompt blocks
    tenant: str = ""  # whom batch slots are shared fairly with

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")

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


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Free the request's blocks before the next step; its outputs stop."""

    request_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str):
            raise ValueError("request_id must be a string")


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the core's loop (its owner's to send: the shared core ignores it from a worker)."""


Request = AddRequest | AbortRequest | Shutdown


class EngineUnavailable(RuntimeError):
    """The engine is being rebuilt or restarted: the request was not served, and may be sent again."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's news for a client."""

    deliveries: list[tuple[str, Item]]
    taken: int  # submissions the engine took (admitted or refused) since the last batch
    load: LoadSnapshot  # the engine's, after this step
    state: str = READY
    rebuilds: int = 0
    last_error: str | None = None

    def __post_init__(self) -> None:
        if self.taken < 0:
            raise ValueError("taken must not be negative")
        if self.state not in (READY, REBUILDING):
            raise ValueError(f"state must be {READY} or {REBUILDING}; got {self.state!r}")


@dataclass(frozen=True, slots=True)
class LoadFailed:
    """The core could not build its first engine: what each connection gets instead of a ModelInfo."""

    error: str
