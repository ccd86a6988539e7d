"""One live gateway on the embedded default model (SmolLM2-135M-Instruct), shared by every
client-library test in this package, and the rule that none of them reaches the internet."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from specgate.gateway.settings import Settings
from tests.gateway.clients.shared import MODEL
from tests.gateway.live import LiveGateway, start_gateway

# Tracing and telemetry of the libraries, off (LiteLLM's are set where it is imported).
_TRACING_ENV = (
    "LANGCHAIN_TRACING_V2",
    "LANGCHAIN_TRACING",
    "LANGCHAIN_API_KEY",
    "LANGCHAIN_ENDPOINT",
    "LANGSMITH_TRACING",
    "LANGSMITH_API_KEY",
    "LANGSMITH_ENDPOINT",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
)


def _local(sock: socket.socket, address: Any) -> bool:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return True  # Unix sockets, socketpairs
    host = str(address[0])
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


@pytest.fixture(scope="package", autouse=True)
def offline() -> Iterator[list[str]]:
    """Every connection from this process to anything but loopback is refused and remembered: the
    package fails if a library tried to call home (telemetry, tracing, a price list, a hub)."""
    attempts: list[str] = []
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guarded(real: Any) -> Any:
        def call(self: socket.socket, address: Any) -> Any:
            if not _local(self, address):
                attempts.append(repr(address))
                raise ConnectionRefusedError(f"tests/gateway/clients are offline: {address!r}")
            return real(self, address)

        return call

    with pytest.MonkeyPatch.context() as mp:
        for name in _TRACING_ENV:
            mp.delenv(name, raising=False)
        mp.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(socket.socket, "connect", guarded(connect))
        mp.setattr(socket.socket, "connect_ex", guarded(connect_ex))
        yield attempts
    assert not attempts, f"a client library tried to reach the internet: {attempts}"


@pytest.fixture(scope="package")
def smol(offline: list[str]) -> Iterator[LiveGateway]:
    """`specgate serve`'s app on the default model, with the default settings (the first load on a
    fresh machine dequantizes the GGUF file, ~15 s)."""
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    live = start_gateway(Settings(port=0, log_requests=False), timeout=300)
    try:
        models = httpx.get(f"{live.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="package")
def base_url(smol: LiveGateway) -> str:
    """What every client is pointed at, as its users write it."""
    return f"{smol.url}/v1"
