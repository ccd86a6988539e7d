"""The active routing policy: loaded from its version row at start (warm start), swapped atomically
on an operator's edit, a retrain that wins its evaluation, or a rollback.

Every change is a new `policy_versions` row, so any earlier routing can be restored exactly. With a
telemetry database several processes route by the same versions (the workers of `serve --workers
N`, replicas on one PostgreSQL): each asks the database every `sync_interval` seconds which version
is active (one indexed query, in a thread) and installs it when it is not the one it routes by, so
a change made through any of them is live in all within a few seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import time
from typing import Any

from specgate.gateway.policy.store import PolicyStore, Version
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.settings import PolicySettings
from specgate.policies.decision import Decision, DecisionContext, Policy
from specgate.policies.exploration import ExplorationBudget
from specgate.policies.rules import RuleConfig
from specgate.policies.state import PolicyState
from specgate.policies.training.retrain import InsufficientData, retrain

logger = logging.getLogger("specgate.policy")


class PolicyManager:
    def __init__(self, settings: PolicySettings, store: PolicyStore, persistent: bool) -> None:
        self.settings = settings
        self.store = store
        self.persistent = persistent  # False: versions live in memory and there is no telemetry
        self.state = PolicyState()
        self.version: int | None = None
        self.budget = ExplorationBudget(self.state.rules.exploration_cap)
        self.policy: Policy = self.state.build(self.budget, settings.seed)
        self._lock = asyncio.Lock()  # one change at a time; routing never waits on it
        self._tasks: list[asyncio.Task[None]] = []

    # ---- routing (event loop, no I/O) ---------------------------------------------------------

    def decide(self, ctx: DecisionContext, explore: bool = True) -> Decision:
        return self.policy.decide(ctx, explore)

    # ---- versions -----------------------------------------------------------------------------

    def load(self) -> None:
        """Install the active version, or record the default rules as version 1 on a fresh database."""
        row = self.store.active()
        if row is None:
            values = self._values(PolicyState(), "default", "active", note="rules on a fresh install")
            self._activate(self.store.add(values))
        else:
            self._install(row)
        logger.info("routing policy version %s (%s) active", self.version, self.state.kind)

    def _install(self, row: Version) -> None:
        state = PolicyState.from_dict(row["artifact"])
        policy = state.build(self.budget, self.settings.seed)
        self.state, self.version, self.policy = state, int(row["version"]), policy  # one swap

    def _values(self, state: PolicyState, source: str, status: str, **extra: Any) -> dict[str, Any]:
        return {
            "kind": state.kind,
            "source": source,
            "status": status,
            "parent_version": self.version,
            "artifact": state.as_dict(),
            **extra,
        }

    def describe(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "kind": self.state.kind,
            "persistent": self.persistent,
            "rules": self.state.rules.as_dict(),
            "modelled_arms": sorted(self.state.model.arms) if self.state.model else [],
            "acceptance_priors": self.state.priors,
            "exploration_share": round(self.budget.share, 4),
            "step_cost": self._step_cost(),
            "pool_crossovers": self.state.crossovers,
            "settings": self.settings.model_dump(),
        }

    def _step_cost(self) -> dict[str, Any] | None:
        """The measured step cost curve and, per prior (class and method, and each temperature band
        measured: `code:ngram@t0.9+`), the batch from which speculation no longer pays (None: it
        pays at every batch measured)."""
        cost, state = self.state.step_cost, self.state
        if cost is None:
            return None
        crossover = {}
        for key, p in sorted(state.priors.items()):
            label = key.split(":", 1)[0]
            rule = state.rules.classes.get(label, state.rules.uncertain)
            crossover[key] = cost.crossover(p, rule.k_range[1])
        return {**cost.as_dict(), "crossover_batch": crossover}

    def versions(self, limit: int = 50) -> list[Version]:
        return [_summary(row) for row in self.store.recent(limit)]

    async def update_rules(self, rules: RuleConfig, note: str | None) -> Version:
        async with self._lock:
            if self.persistent:
                await self._follow()  # the new rules go on the latest model, wherever it was made
            state = dataclasses.replace(self.state, rules=rules)
            return await asyncio.to_thread(self._add_active, state, "edit", note)

    async def rollback(self, version: int) -> Version:
        async with self._lock:
            row = await asyncio.to_thread(self.store.get, version)
            if row is None:
                raise GatewayError(404, f"policy version {version} does not exist", code="version_not_found")
            state = PolicyState.from_dict(row["artifact"])
            return await asyncio.to_thread(
                self._add_active, state, "rollback", f"rollback to version {version}"
            )

    def _add_active(self, state: PolicyState, source: str, note: str | None) -> Version:
        return self._activate(self.store.add(self._values(state, source, "retired", note=note)))

    def _activate(self, version: int) -> Version:
        """Make a stored version the active one and route by it from now on; its summary."""
        self.store.activate(version)
        row = self.store.get(version)
        assert row is not None
        self._install(row)
        return _summary(row)

    async def retrain(self, force: bool = False, window_hours: float | None = None) -> dict[str, Any]:
        if not self.persistent:
            raise GatewayError(
                409, "retraining needs telemetry: it is disabled on this gateway", code="no_telemetry"
            )
        hours = window_hours or self.settings.train_window_hours
        async with self._lock:
            lease = await asyncio.to_thread(self.store.retrain_lease)
            if lease is None:
                raise GatewayError(
                    409,
                    "another gateway on this database is retraining the policy now; try again later",
                    code="retrain_in_progress",
                )
            try:
                return await self._retrain(force, hours)
            finally:
                await asyncio.to_thread(lease.release)

    async def _retrain(self, force: bool, hours: float) -> dict[str, Any]:
        """Under the lock and the lease."""
        await self._follow()  # compared with, and built on, the version active now
        since = time.time() - hours * 3600
        rows = await asyncio.to_thread(self.store.training_rows, since)
        steps = await asyncio.to_thread(self.store.step_rows, since)
        try:
            result = await asyncio.to_thread(
                retrain, rows, self.state.rules, self.state, self.settings.holdout_share, force, steps
            )
        except InsufficientData as exc:
            raise GatewayError(409, str(exc), code="insufficient_telemetry") from exc
        values = self._values(
            result.state,
            "retrain",
            "retired" if result.promote else "rejected",
            window_start=result.window[0],
            window_end=result.window[1],
            train_rows=result.n_train,
            metrics=result.as_dict(),
            note=result.reason,
        )
        version = await asyncio.to_thread(self.store.add, values)
        if result.promote:
            await asyncio.to_thread(self._activate, version)
        logger.info(
            "retrain: version %s %s (%s)",
            version,
            "promoted" if result.promote else "kept out",
            result.reason,
        )
        return {
            "version": version,
            "promoted": result.promote,
            "active_version": self.version,
            **result.as_dict(),
        }

    # ---- following the database ---------------------------------------------------------------

    async def sync(self) -> bool:
        """Install the database's active version if it is not ours; whether it did."""
        active = await asyncio.to_thread(self.store.active_version)
        if active is None or active == self.version:
            return False
        async with self._lock:  # not halfway through a change of our own
            return await self._follow()

    async def _follow(self) -> bool:
        """Under the lock: install the active version if another process changed it."""
        row = await asyncio.to_thread(self.store.active)
        if row is None or int(row["version"]) == self.version:
            return False
        before = self.version
        self._install(row)
        logger.info("routing policy version %s (%s) active, was %s", self.version, self.state.kind, before)
        return True

    async def _sync_loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.settings.sync_interval)
            try:
                await self.sync()
            except Exception:  # the database may be down for a while: keep routing, ask again
                if not failing:
                    logger.warning("cannot read the active policy version; will retry", exc_info=True)
                failing = True
            else:
                failing = False

    # ---- periodic retraining ------------------------------------------------------------------

    def start(self, retrain: bool = True) -> None:
        """Start following the database and, if `retrain` (one process of several retrains on
        schedule, not each), the scheduled retrains. Only with a database: in memory there is
        nobody to follow and nothing to learn from."""
        if not self.persistent:
            return
        self._tasks.append(asyncio.create_task(self._sync_loop()))
        if retrain and self.settings.retrain_interval > 0:
            self._tasks.append(asyncio.create_task(self._retrain_loop()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _retrain_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.retrain_interval)
            try:
                if await asyncio.to_thread(self._retrained_recently):
                    continue  # another gateway on this database did this round's retrain
                await self.retrain()
            except GatewayError as exc:
                logger.info("scheduled retrain skipped: %s", exc.message)
            except Exception:
                logger.exception("scheduled retrain failed")

    def _retrained_recently(self) -> bool:
        """Whether any gateway on this store retrained within the last 90% of an interval."""
        since = time.time() - 0.9 * self.settings.retrain_interval
        for row in self.store.recent(20):
            if row.get("source") == "retrain":
                created = row.get("created_at")
                return created is not None and dt.datetime.fromisoformat(created).timestamp() > since
        return False


def _summary(row: Version) -> Version:
    """A version row without its artifact (the fitted model can be large)."""
    return {k: v for k, v in row.items() if k != "artifact"}
