"""A live gateway on the tiny model, shared by the tests of a module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway.live import TEST_ADMIN_KEY, LiveGateway, start_gateway, tiny_settings


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(tiny_settings(str(tiny_llama_dir), admin_key=TEST_ADMIN_KEY))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(tiny_llama_dir: Path) -> str:
    return tiny_llama_dir.name
