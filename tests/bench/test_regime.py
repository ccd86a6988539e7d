"""`specgate bench regime`: the per-position acceptance a static-K run implies."""

from __future__ import annotations

import pytest

from specgate.bench.regime import acceptance
from specgate.engine.step_cost import expected_accepted


@pytest.mark.parametrize(("p", "k"), [(0.3, 3), (0.7, 3), (0.9, 5)])
def test_acceptance_inverts_the_expected_accepted_run(p: float, k: int) -> None:
    steps = 1000
    accepted = round(expected_accepted(p, k) * steps)
    assert acceptance(accepted, k * steps, k) == pytest.approx(p, abs=1e-3)


def test_no_drafts_is_no_acceptance() -> None:
    assert acceptance(0, 0, 3) == pytest.approx(0.0, abs=1e-9)
    assert acceptance(3000, 3000, 3) == pytest.approx(1.0, abs=1e-6)
