"""Response bodies after their content-encoding, decoded in bounded pieces.

A compressed bomb yields at most `DECODE_PIECE` bytes per step, so a caller that caps the size of
what it reads stops before memory runs out. Only what the gateway asks for (`ACCEPT_ENCODING`) is
decoded; anything else an upstream sends is a `DecodingError`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

from specgate.gateway.backends.upstream.errors import DecodingError

DECODE_PIECE = 1 << 16  # the most decoded bytes one step of a decompressor may produce
ACCEPT_ENCODING = "gzip, deflate"


def decoders(encoding: str) -> list[Any]:
    """zlib decompressors for a content-encoding list, in the order they undo it."""
    if not encoding:  # nearly always: nothing to undo
        return []
    out: list[Any] = []
    for name in reversed([e.strip().lower() for e in encoding.split(",") if e.strip()]):
        if name in ("gzip", "x-gzip"):
            out.append(zlib.decompressobj(zlib.MAX_WBITS | 16))
        elif name == "deflate":
            out.append(_Deflate())
        elif name != "identity":
            raise DecodingError(f"unsupported content-encoding {name[:32]!r}")
    return out


class _Deflate:
    """`deflate` as servers send it: zlib-wrapped per the RFC, raw by some; tried in that order."""

    def __init__(self) -> None:
        self._d: Any = None

    def decompress(self, data: bytes, max_length: int) -> bytes:
        if self._d is None:
            self._d = zlib.decompressobj()
            try:
                return bytes(self._d.decompress(data, max_length))
            except zlib.error:
                self._d = zlib.decompressobj(-zlib.MAX_WBITS)
        return bytes(self._d.decompress(data, max_length))

    @property
    def unconsumed_tail(self) -> bytes:
        return bytes(self._d.unconsumed_tail) if self._d is not None else b""

    def flush(self) -> bytes:
        return bytes(self._d.flush()) if self._d is not None else b""


def decode(decoders: list[Any], data: bytes) -> Iterator[bytes]:
    """`data` through the decoders, lazily: no step holds more than `DECODE_PIECE` new bytes."""
    if not decoders:
        if data:
            yield data
        return
    d, rest = decoders[0], decoders[1:]
    try:
        chunk = d.decompress(data, DECODE_PIECE)
        while True:
            yield from decode(rest, chunk)
            tail = d.unconsumed_tail
            if not tail and len(chunk) < DECODE_PIECE:
                return
            chunk = d.decompress(tail, DECODE_PIECE)  # more input left, or output held back
            if not chunk and not tail:
                return
    except zlib.error as exc:
        raise DecodingError(str(exc)) from None


def flush(decoders: list[Any]) -> Iterator[bytes]:
    """What each decoder still holds at the end of the body, through the decoders after it."""
    for i, d in enumerate(decoders):
        try:
            tail = d.flush()
        except zlib.error as exc:
            raise DecodingError(str(exc)) from None
        yield from decode(decoders[i + 1 :], tail)
