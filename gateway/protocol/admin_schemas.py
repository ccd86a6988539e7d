"""Bodies of the admin API, validated at the edge: a bad field gets a 422 that names it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specgate.engine.vocab import K_MAX
from specgate.gateway.protocol.schemas import Controller
from specgate.policies.classes import WORKLOAD_CLASSES

WorkloadClass = Literal[WORKLOAD_CLASSES]  # type: ignore[valid-type]


class ClassRulePatch(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    method: str | None = Field(
        None, min_length=1, max_length=64, description='a proposer ("ngram", "suffix", ...) or "off"'
    )
    k_min: int | None = Field(None, ge=0, le=K_MAX)
    k_max: int | None = Field(None, ge=0, le=K_MAX)
    controller: Controller | None = None


class PolicyPatch(BaseModel):
    """Rule changes; fields left out keep their current value. Creates a new active version."""

    # Finite, bounded numbers only: an operator's typo must not turn into NaN goodput predictions.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    classes: dict[WorkloadClass, ClassRulePatch] | None = None
    uncertain: ClassRulePatch | None = None
    min_confidence: float | None = Field(None, ge=0.0, le=1.0)
    high_temperature: float | None = Field(
        None,
        ge=0.0,
        le=100.0,
        description=(
            "cold-start fallback: open chat at or above this temperature does not speculate while "
            "no acceptance is measured for its class, method and temperature band; once one is "
            "(and the step cost), the measurement decides instead, for every class"
        ),
    )
    max_batch_for_spec: int | None = Field(None, ge=0, le=1_000_000)
    structured_methods: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        None, max_length=32
    )
    across_backends: bool | None = None
    exploration_rate: float | None = Field(None, ge=0.0, le=1.0)
    exploration_cap: float | None = Field(None, ge=0.0, le=1.0)
    thompson_scale: float | None = Field(None, ge=0.0, le=100.0)
    deviation_z: float | None = Field(None, ge=0.0, le=10.0)
    min_train_rows: int | None = Field(None, ge=10, le=10_000_000)
    min_arm_rows: int | None = Field(None, ge=5, le=1_000_000)
    note: str | None = Field(None, max_length=500)

    def changes(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True, exclude={"note"})
        for key in ("classes",):
            if key in out:
                out[key] = {
                    k: {f: v for f, v in rule.items() if v is not None} for k, rule in out[key].items()
                }
        return out


class RetrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    force: bool = Field(False, description="promote even if the offline evaluation does not favour it")
    window_hours: float | None = Field(
        None, gt=0.0, le=24 * 3650, description="telemetry window to learn from"
    )
