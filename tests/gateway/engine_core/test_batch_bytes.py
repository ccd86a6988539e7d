"""What the engine core sends a connection for one request grows linearly with the request's tokens:
each step's `Batch` carries that step's news (new tokens, text, the small per-step facts), and the
request's counters come once, with its finished output. A cumulative copy of them in every step's
output (every token's time, every verification step's numbers) made the bytes grow with the square
of the tokens, pickled to every worker of `specgate serve` step after step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from specgate.engine.engine import Engine
from specgate.engine.outputs import RequestOutput
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import SpecParams
from specgate.gateway.engine_core.channel import frame
from specgate.gateway.engine_core.core import EngineCore
from specgate.gateway.engine_core.messages import AddRequest, Batch, Request, Shutdown

pytestmark = pytest.mark.timeout(120)
N = 64


class _Counting:
    """One connection that frames every `Batch` as the shared core's sockets do and counts the bytes;
    it stops the core once its request has finished."""

    def __init__(self, add: AddRequest) -> None:
        self.requests: list[Request] = [add]
        self.bytes = 0
        self.final: RequestOutput | None = None

    def get(self, timeout: float | None) -> Request | None:
        return self.requests.pop(0) if self.requests else None

    def publish(self, batch: Batch) -> None:
        self.bytes += len(frame(batch))
        for _, item in batch.deliveries:
            assert isinstance(item, RequestOutput), item
            if item.finished:
                self.final = item
                self.requests.append(Shutdown())


def _bytes_sent(make_engine: Callable[..., Engine], max_tokens: int) -> tuple[int, RequestOutput]:
    engine = make_engine()
    prompt = engine.tokenizer.encode("abcabcabcabc")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    spec = SpecParams("ngram", "static", k_min=2, k_max=2, num_speculative_tokens=2)
    conn = _Counting(AddRequest("r", prompt, params, spec))
    EngineCore(engine, None, conn).run()
    assert conn.final is not None
    return conn.bytes, conn.final


def test_bytes_sent_per_request_are_linear_in_its_tokens(
    make_engine: Callable[..., Engine], tiny_fixed_point_dir: Path
) -> None:
    def make(**kw: object) -> Engine:
        return make_engine(model=str(tiny_fixed_point_dir), **kw)

    short, short_final = _bytes_sent(make, N)
    long, long_final = _bytes_sent(make, 4 * N)
    for final, n in ((short_final, N), (long_final, 4 * N)):
        assert final.stats is not None and final.stats.num_output_tokens == n
        assert final.stats.spec is not None and final.stats.spec.num_draft_tokens > 0  # it speculated
    # Four times the tokens: about four times the steps and their news (the longer request drafts at
    # least as well once its pattern has settled), plus one final counters' worth.
    assert long < 4.6 * short, (short, long, long / short)
