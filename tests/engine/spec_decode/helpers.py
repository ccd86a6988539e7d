"""Builders shared by the proposer tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specgate.engine.sampler import SamplingRow
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.proposer import ProposalRequest, ProposerContext


def context(**options: Any) -> ProposerContext:
    return ProposerContext(
        vocab_size=96, device=torch.device("cpu"), dtype="float32", tokenizer=None, options=options
    )


def request(request_id: str, tokens: Sequence[int], k: int) -> ProposalRequest:
    row = SamplingRow(SamplingParams(), list(tokens), len(tokens), None)
    return ProposalRequest(request_id, list(tokens), len(tokens), k, row)
