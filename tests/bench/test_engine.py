"""`specgate bench engine`: its served row reads a real gateway's stream, every token counted, TPOT
after the first."""

from __future__ import annotations

from pathlib import Path

import httpx

from specgate.bench.engine import stream_completion
from tests.gateway.live import start_gateway, tiny_settings


def test_the_served_row_counts_what_the_gateway_streamed(tiny_llama_dir: Path) -> None:
    live = start_gateway(tiny_settings(str(tiny_llama_dir)))
    try:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            tokens, seconds, tpot = stream_completion(client, model, [5, 17, 3, 44, 9], 12)
    finally:
        live.stop()
    assert tokens == 12  # ignore_eos: exactly max_tokens
    assert seconds > 0 and 0 < tpot * 11 / 1e3 <= seconds
