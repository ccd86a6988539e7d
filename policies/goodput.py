"""Per-arm goodput models: predicted output tokens/s (with its uncertainty) and TPOT from request
features and load, fitted on telemetry rows.

Each arm gets a Bayesian ridge regression on log tokens/s, so its posterior spread drives Thompson
sampling, and a ridge regression on log TPOT. The fitted parameters are kept as plain lists (a
policy version is a JSON document in the database, loadable under any scikit-learn version).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specgate.policies.classes import WORKLOAD_CLASSES
from specgate.policies.load import ARM_LOAD, arm_input

REQUEST_FEATURES = (
    *(f"p_{c}" for c in WORKLOAD_CLASSES),
    "log_prompt_tokens",
    "log_max_tokens",
    "temperature",
    "top_p",
    "copyability",
    "tools_or_json",
)
LOAD_FEATURES = ARM_LOAD  # each about the arm's own backend (policies/load.py)
MODEL_FEATURES = REQUEST_FEATURES + LOAD_FEATURES
Z_LIMIT = 4.0  # standardized inputs are clipped to this many training standard deviations
CONSTANT_SCALE = 1e12  # the scale of a feature constant in training (see ArmModel.fit)


@dataclass(slots=True)
class TrainingRow:
    arm: str  # Arm.key
    features: dict[str, float]  # request and load features as recorded at decision time
    tokens_per_s: float
    tpot_ms: float | None = None
    label: str | None = None
    arrival_time: float = 0.0
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    propensity: float | None = None  # the logging policy's chance of this arm; None: not logged
    ttft_ms: float | None = None  # None: unknown (a non-streamed call whose backend did not say)

    def __post_init__(self) -> None:
        if not self.tokens_per_s > 0:
            raise ValueError("tokens_per_s must be positive")
        if self.propensity is not None and not 0.0 < self.propensity <= 1.0:
            raise ValueError("propensity must be in (0, 1]")


def vector(features: dict[str, float], arm: str) -> np.ndarray:
    """The model input of arm `arm` (its key): the request's features and its own backend's load."""
    own = arm_input(features, arm.rpartition(":")[0])
    return np.array([float(own.get(n, 0.0)) for n in MODEL_FEATURES])  # [n_features]


@dataclass(slots=True)
class Prediction:
    log_mean: float  # posterior mean of log tokens/s
    log_std: float  # posterior predictive spread of log tokens/s (one request's: noise included)
    tpot_ms: float | None
    # Posterior spread of the mean alone: how sure the model is of the arm's expected goodput,
    # which more rows narrow (the noise term in `log_std` never shrinks).
    mean_std: float = 0.0
    ttft_ms: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return math.exp(self.log_mean)

    def as_dict(self) -> dict[str, float]:
        out = {"tokens_per_s": round(self.tokens_per_s, 3), "log_std": round(self.log_std, 4)}
        if self.tpot_ms is not None:
            out["tpot_ms"] = round(self.tpot_ms, 3)
        if self.ttft_ms is not None:
            out["ttft_ms"] = round(self.ttft_ms, 3)
        return out


@dataclass(slots=True)
class ArmModel:
    n_rows: int
    mean: np.ndarray  # [n_features] standardization
    scale: np.ndarray  # [n_features]
    coef: np.ndarray  # [n_features] on standardized inputs, target log tokens/s
    intercept: float
    noise_precision: float  # BayesianRidge alpha_
    sigma: np.ndarray  # [n_features, n_features] posterior covariance of coef
    tpot_coef: np.ndarray | None  # [n_features], target log TPOT ms
    tpot_intercept: float = 0.0
    ttft_coef: np.ndarray | None = None  # [n_features], target log TTFT ms
    ttft_intercept: float = 0.0

    def _standardize(self, x: np.ndarray) -> np.ndarray:
        # A linear model extrapolates without limit: inputs far outside the training range (a load
        # never seen) are held at its edge.
        z: np.ndarray = np.clip((x - self.mean) / self.scale, -Z_LIMIT, Z_LIMIT)  # [n_features]
        return z

    def _moments(self, z: np.ndarray) -> tuple[float, float, float]:
        """(mean, predictive spread, spread of the mean) of log tokens/s."""
        mu = float(z @ self.coef + self.intercept)
        coef_var = max(float(z @ self.sigma @ z), 0.0)
        noise_var = 1.0 / self.noise_precision
        # The intercept is the rows' mean (the inputs are centred), known to noise / n; sklearn's
        # predictive spread leaves that term out, which would make the mean look exact at the
        # centre of the data however few rows there were.
        mean_var = coef_var + noise_var / max(self.n_rows, 1)
        return mu, math.sqrt(coef_var + noise_var), math.sqrt(mean_var)

    def predict_log(self, x: np.ndarray) -> tuple[float, float]:
        """Posterior mean and predictive spread of log tokens/s."""
        mu, std, _ = self._moments(self._standardize(x))
        return mu, std

    def predict(self, x: np.ndarray) -> Prediction:
        z = self._standardize(x)
        mu, std, mean_std = self._moments(z)
        tpot = ttft = None
        if self.tpot_coef is not None:
            tpot = math.exp(min(30.0, float(z @ self.tpot_coef + self.tpot_intercept)))
        if self.ttft_coef is not None:
            ttft = math.exp(min(30.0, float(z @ self.ttft_coef + self.ttft_intercept)))
        return Prediction(mu, std, tpot, mean_std, ttft)

    @classmethod
    def fit(
        cls, x: np.ndarray, tps: np.ndarray, tpot: np.ndarray, ttft: np.ndarray | None = None
    ) -> ArmModel:
        from sklearn.linear_model import BayesianRidge, Ridge

        mean = x.mean(axis=0)
        scale = x.std(axis=0)
        # A feature that never varied in training says nothing about goodput: a scale this large
        # standardizes any value of it to ~0, so it moves neither the prediction nor its spread
        # (with a scale of 1 its unidentified coefficient's prior variance made every live value
        # off the training constant look uncertain).
        scale[scale < 1e-9] = CONSTANT_SCALE
        z = (x - mean) / scale  # [n_rows, n_features]
        br = BayesianRidge().fit(z, np.log(tps))

        def latency(target: np.ndarray | None) -> tuple[np.ndarray | None, float]:
            """A ridge regression of log latency on the rows that know it (at least 5)."""
            if target is None:
                return None, 0.0
            known = ~np.isnan(target)
            if known.sum() < 5:
                return None, 0.0
            ridge = Ridge(alpha=1.0).fit(z[known], np.log(target[known]))
            return ridge.coef_, float(ridge.intercept_)

        tpot_coef, tpot_intercept = latency(tpot)
        ttft_coef, ttft_intercept = latency(ttft)
        return cls(
            len(x),
            mean,
            scale,
            br.coef_,
            float(br.intercept_),
            float(br.alpha_),
            br.sigma_,
            tpot_coef,
            tpot_intercept,
            ttft_coef,
            ttft_intercept,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "n_rows": self.n_rows,
            "mean": self.mean.tolist(),
            "scale": self.scale.tolist(),
            "coef": self.coef.tolist(),
            "intercept": self.intercept,
            "noise_precision": self.noise_precision,
            "sigma": self.sigma.tolist(),
            "tpot_coef": None if self.tpot_coef is None else self.tpot_coef.tolist(),
            "tpot_intercept": self.tpot_intercept,
            "ttft_coef": None if self.ttft_coef is None else self.ttft_coef.tolist(),
            "ttft_intercept": self.ttft_intercept,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArmModel:
        def arr(v: Any) -> np.ndarray:
            return np.asarray(v, dtype=np.float64)

        return cls(
            int(d["n_rows"]),
            arr(d["mean"]),
            arr(d["scale"]),
            arr(d["coef"]),
            float(d["intercept"]),
            float(d["noise_precision"]),
            arr(d["sigma"]),
            None if d.get("tpot_coef") is None else arr(d["tpot_coef"]),
            float(d.get("tpot_intercept", 0.0)),
            None if d.get("ttft_coef") is None else arr(d["ttft_coef"]),
            float(d.get("ttft_intercept", 0.0)),
        )


@dataclass(slots=True)
class GoodputModel:
    arms: dict[str, ArmModel]
    features: tuple[str, ...] = MODEL_FEATURES

    def __post_init__(self) -> None:
        if tuple(self.features) != MODEL_FEATURES:
            raise ValueError("goodput model was fitted on a different feature set; retrain it")

    def predict(self, arm: str, features: dict[str, float]) -> Prediction:
        return self.arms[arm].predict(vector(features, arm))

    @classmethod
    def fit(cls, rows: Sequence[TrainingRow], min_arm_rows: int) -> GoodputModel:
        by_arm: dict[str, list[TrainingRow]] = {}
        for r in rows:
            by_arm.setdefault(r.arm, []).append(r)
        arms = {}
        for key, group in sorted(by_arm.items()):
            if len(group) < min_arm_rows:
                continue
            x = np.stack([vector(r.features, key) for r in group])  # [n_rows, n_features]
            tps = np.array([r.tokens_per_s for r in group])
            tpot = np.array([r.tpot_ms if r.tpot_ms and r.tpot_ms > 0 else np.nan for r in group])
            ttft = np.array([r.ttft_ms if r.ttft_ms and r.ttft_ms > 0 else np.nan for r in group])
            arms[key] = ArmModel.fit(x, tps, tpot, ttft)
        return cls(arms)

    def as_dict(self) -> dict[str, Any]:
        return {"features": list(self.features), "arms": {k: m.as_dict() for k, m in self.arms.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GoodputModel:
        return cls({k: ArmModel.from_dict(v) for k, v in d["arms"].items()}, tuple(d["features"]))
