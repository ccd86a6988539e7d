"""Where an external speculative pool stops paying: the batch at which its measured TPOT meets the
plain pools'.

A server that speculates spends each step verifying drafts; as its batch grows, verification eats
the compute that idle cycles paid for at light load, and its time per output token rises faster
than a plain server's. Telemetry holds both: each row's TPOT and the load of the backend that
served it (`<backend>:load_running` / `load_queue`). Per workload class and speculative arm, TPOT is
fitted as a line in the backend's batch, and so is the best plain pool's (the class's, else over all
classes); the crossover is the batch from which the speculative line is no lower. The guards drop
the speculative pool for that class from there on (policies/guards.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specgate.policies.arms import Arm
from specgate.policies.goodput import TrainingRow
from specgate.policies.load import arm_input

MIN_ROWS = 10  # rows a line is fitted on
NEVER = 1e6  # the speculative pool is no slower at any batch seen: no crossover


def _batch(row: TrainingRow) -> float:
    own = arm_input(row.features, Arm.parse(row.arm).backend)
    return float(own.get("load_running", 0.0)) + float(own.get("load_queue", 0.0))


def _line(rows: Sequence[TrainingRow]) -> tuple[float, float] | None:
    """(intercept, slope) of TPOT ms against batch, or None: too few rows or no spread in batch."""
    pts = [(_batch(r), float(r.tpot_ms)) for r in rows if r.tpot_ms is not None and r.tpot_ms > 0]
    if len(pts) < MIN_ROWS:
        return None
    x = np.array([p[0] for p in pts])  # [rows]
    y = np.array([p[1] for p in pts])  # [rows]
    if float(x.std()) < 1e-9:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def _crossing(spec: tuple[float, float], plain: list[tuple[float, float]]) -> float:
    """The least batch >= 0 where the speculative line is at or above the lowest plain line."""
    grid = np.arange(0.0, 1025.0)  # [batches]
    best_plain = np.min(np.stack([a + b * grid for a, b in plain]), axis=0)  # [batches]
    worse = np.nonzero(spec[0] + spec[1] * grid >= best_plain)[0]
    return float(grid[worse[0]]) if len(worse) else NEVER


def pool_crossovers(rows: Sequence[TrainingRow]) -> dict[str, float]:
    """`<class>:<arm key>` -> the batch from which that speculative external arm no longer beats the
    plain external pools on TPOT for that class (NEVER: at no batch seen). Per class only: a line
    over all classes mixes prompts the pool copies from with prose it cannot, and its crossover says
    nothing true of either."""
    by_arm: dict[str, list[TrainingRow]] = {}
    for r in rows:
        arm = Arm.parse(r.arm)
        if arm.external:
            by_arm.setdefault(r.arm, []).append(r)
    plain = [line for key, rs in by_arm.items() if not Arm.parse(key).speculative if (line := _line(rs))]
    out: dict[str, float] = {}
    if not plain:
        return out
    for key, rs in by_arm.items():
        if not Arm.parse(key).speculative:
            continue
        labels = {r.label for r in rs if r.label}
        for label in sorted(labels):
            mine = _line([r for r in rs if r.label == label])
            theirs = [
                ln
                for k, prs in by_arm.items()
                if not Arm.parse(k).speculative
                if (ln := _line([r for r in prs if r.label == label]))
            ] or plain
            if mine is not None:
                out[f"{label}:{key}"] = _crossing(mine, theirs)
    return out
