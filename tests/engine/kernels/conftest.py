"""What the kernel tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from specgate.engine.kernels import extension


@pytest.fixture
def levels() -> Iterator[list[int]]:
    """The instruction sets this CPU runs (0 portable, 1 AVX2, 2 AVX-512 VNNI); restored after."""
    if not extension.load():
        pytest.skip(f"GGUF kernels unavailable: {extension.unavailable_reason()}")
    best = extension.isa_level()
    yield list(range(best + 1))
    extension.ops().set_isa_level(best)
