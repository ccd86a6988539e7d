"""Arms: where a request goes and how it speculates there. The policy picks one per request."""

from __future__ import annotations

from dataclasses import dataclass

OFF = "off"
UPSTREAM = "upstream"  # an external backend: it decides its own speculation


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
    def speculative(self) -> bool:
        return self.method not in (OFF, UPSTREAM)

    @classmethod
    def parse(cls, key: str) -> Arm:
        backend, sep, method = key.rpartition(":")
        if not sep:
            raise ValueError(f"arm key must look like 'backend:method', got {key!r}")
        return cls(backend, method)
