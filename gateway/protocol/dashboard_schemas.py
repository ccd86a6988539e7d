"""Bodies of the dashboard's JSON endpoints (`/admin/ui/login`, `/admin/ui/session`,
`/admin/timeseries/*`, `/admin/policy/diff`), for validation and the OpenAPI schema: what each
number means and in which unit."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class SignIn(BaseModel):
    """The dashboard's sign-in (also accepted as an HTML form field `key`)."""

    model_config = ConfigDict(extra="forbid")
    key: str = Field(min_length=1, max_length=1024, description="the admin key")


class SessionInfo(BaseModel):
    signed_in: bool = True
    issued_at: float = Field(description="unix seconds")
    expires_at: float = Field(description="unix seconds; sign in again after this")
    csrf_token: str = Field(description="send as the x-csrf-token header with every action")


class Percentiles(BaseModel):
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class Window(BaseModel):
    start: float = Field(description="unix seconds; the first step starts here")
    end: float = Field(description="unix seconds; the last step ends here (the step holding now)")
    step: float = Field(description="seconds per point")
    model: str | None = None
    backend: str | None = None
    models: list[str] = Field(description="models seen in the window (filter choices)")
    backends: list[str] = Field(description="backends seen in the window (filter choices)")


class TrafficPoint(BaseModel):
    t: float = Field(description="start of the step, unix seconds")
    requests: int
    requests_per_s: float
    ok: int
    errors: int
    cancelled: int
    errors_by_code: dict[str, int] = Field(description="error code (or HTTP status) -> requests")
    completion_tokens: int = Field(description="output tokens of successful requests")
    prompt_tokens: int
    tokens_per_s: float = Field(description="output tokens per second of the step, all requests together")
    mean_request_tokens_per_s: float | None = Field(description="mean of each request's own tokens/s")
    ttft_ms: Percentiles = Field(description="time to first token, successful requests")
    tpot_ms: Percentiles = Field(description="time per output token after the first")


class RouteRow(BaseModel):
    model: str
    backend: str | None
    requests: int
    requests_per_s: float
    errors: int
    error_rate: float
    tokens_per_s: float
    mean_request_tokens_per_s: float | None
    ttft_ms: Percentiles
    tpot_ms: Percentiles


class TrafficSeries(BaseModel):
    """Percentiles are estimated from log-spaced histograms counted by the database (within 15%,
    exact at a step's minimum and maximum)."""

    window: Window
    points: list[TrafficPoint]
    by_route: list[RouteRow] = Field(description="per model and backend over the whole window")


class SpecPoint(BaseModel):
    t: float
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None = Field(description="accepted / drafted tokens")
    mean_acceptance_length: float | None = Field(description="tokens per verification step, mean")
    route_mix: dict[str, int] = Field(description="backend:method -> successful requests")


class ClassMethodRow(BaseModel):
    workload_class: str
    method: str = Field(description='a proposer, "off" (plain), or "upstream" (external backend)')
    requests: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    mean_tokens_per_s: float | None
    speedup_vs_plain: float | None = Field(
        description="mean tokens/s over that of plain requests of the same class"
    )


class LoadBand(BaseModel):
    batch_min: int = Field(description="sequences running + waiting at arrival, from")
    batch_max: int | None = Field(description="to (inclusive); null: and above")
    requests: int
    speculating: int
    speculating_share: float
    off_for_load: int = Field(description="requests the policy kept plain because of the batch")


class LoadSummary(BaseModel):
    bands: list[LoadBand]
    turned_off_at_batch: int | None = Field(
        description="the least batch at which the policy turned speculation off in the window"
    )


class SpeculationSeries(BaseModel):
    window: Window
    points: list[SpecPoint]
    by_class: list[ClassMethodRow]
    by_load: LoadSummary


class VersionSide(BaseModel):
    version: int
    kind: str
    source: str
    status: str
    created_at: str | None
    note: str | None
    rules: dict[str, Any]
    priors: dict[str, float]
    modelled_arms: list[str]


class Change(BaseModel):
    path: str = Field(description='dotted path, e.g. "rules.classes.code.method"')
    a: Any = None
    b: Any = None


class PolicyDiff(BaseModel):
    a: VersionSide
    b: VersionSide
    changes: list[Change]
