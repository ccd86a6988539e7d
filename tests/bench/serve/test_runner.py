"""How an arm's name becomes the `spec` extension that forces it."""

from __future__ import annotations

import pytest

from specgate.bench.serve.runner import POLICY, arm_body, spec_of
from specgate.gateway.protocol.schemas import SpecRequest


def test_plain_and_methods_force_the_method_alone() -> None:
    assert spec_of("plain") == {"method": "off"}
    assert spec_of("ngram") == {"method": "ngram"}
    assert arm_body(POLICY) is None
    assert arm_body("suffix", cache_salt="s") == {"cache_salt": "s", "spec": {"method": "suffix"}}


def test_a_fixed_chain_is_a_static_k_without_trees_that_the_gateway_accepts() -> None:
    spec = spec_of("ngram:k3")
    fixed = {"controller": "static", "num_speculative_tokens": 3, "max_tree_nodes": 0}
    assert spec == {"method": "ngram", **fixed}
    parsed = SpecRequest.model_validate(spec)
    assert (parsed.controller, parsed.num_speculative_tokens, parsed.max_tree_nodes) == ("static", 3, 0)


@pytest.mark.parametrize("arm", ["ngram:3", "ngram:k0", "ngram:k", "ngram:kx", "ngram:k-1"])
def test_a_malformed_fixed_chain_is_refused(arm: str) -> None:
    with pytest.raises(ValueError, match="METHOD:kN"):
        spec_of(arm)
