"""Arms: where a request goes and how it speculates there. The policy picks one per request."""

from __future__ import annotations

from dataclasses import dataclass

from specgate.engine.vocab import SPEC_OFF

OFF = SPEC_OFF  # the method of a plain arm: the engine's "off"

# An external backend (or replica group) that does not speculate, or whose speculation is unknown;
# one that does is `upstream-<method>` ("upstream-on" where the method is not known). The server
# decides its own drafts: the arm says only what kind of pool it is.
UPSTREAM = "upstream"
UPSTREAM_SPEC = "upstream-"


@dataclass(slots=True, frozen=True)
class Arm:
    backend: str
    method: str = OFF  # a registered proposer, "off", or "upstream" on an external backend

    def __post_init__(self) -> None:
        if not self.backend or ":" in self.backend:
            raise ValueError(f"arm backend must be a non-empty name without ':', got {self.backend!r}")
        if not self.method:
            raise ValueError("arm method must be a proposer name, 'off' or 'upstream'")

    @property
    def key(self) -> str:
        return f"{self.backend}:{self.method}"

    @property
    def external(self) -> bool:
        return self.method == UPSTREAM or self.method.startswith(UPSTREAM_SPEC)

    @property
    def speculative(self) -> bool:
        return self.method not in (OFF, UPSTREAM)

    @property
    def proposer(self) -> str:
        """The drafting method, embedded or external ("off" / "upstream" when none)."""
        return self.method.removeprefix(UPSTREAM_SPEC)

    @classmethod
    def upstream(cls, backend: str, speculation: str | None) -> Arm:
        """An external pool's arm: `speculation` is its method, "on" (unknown method) or None / "off"."""
        if speculation is None or speculation == OFF:
            return cls(backend, UPSTREAM)
        if not speculation or speculation.startswith(UPSTREAM) or ":" in speculation:
            raise ValueError(f"not a speculation method: {speculation!r}")
        return cls(backend, UPSTREAM_SPEC + speculation)

    @classmethod
    def parse(cls, key: str) -> Arm:
        backend, sep, method = key.rpartition(":")
        if not sep:
            raise ValueError(f"arm key must look like 'backend:method', got {key!r}")
        return cls(backend, method)
