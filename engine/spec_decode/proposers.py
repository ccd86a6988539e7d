"""Every speculation method the engine can run: one explicit table, name -> proposer factory.

A new method is one file implementing `Proposer` (proposer.py) and one line here. "off" is not a
method: it is the absence of one.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from specgate.engine.spec_decode.draft_model import DraftModelProposer
from specgate.engine.spec_decode.eagle import EagleProposer
from specgate.engine.spec_decode.ngram import NgramProposer
from specgate.engine.spec_decode.proposer import ProposerFactory
from specgate.engine.spec_decode.suffix import SuffixProposer

PROPOSERS: Mapping[str, ProposerFactory] = MappingProxyType(
    {
        "ngram": NgramProposer,
        "suffix": SuffixProposer,
        "draft_model": DraftModelProposer,
        "eagle": EagleProposer,
    }
)


def proposer_factory(name: str) -> ProposerFactory:
    try:
        return PROPOSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown speculation method {name!r}; known: off, {', '.join(sorted(PROPOSERS))}"
        ) from None


def proposer_names() -> list[str]:
    return sorted(PROPOSERS)
