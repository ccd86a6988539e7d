"""What the endpoints share, built once per app in its lifespan (no import-time singletons)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specgate.gateway.backends.registry import BackendRegistry
from specgate.gateway.backends.upstream.client import UpstreamClient
from specgate.gateway.keyring import KeyIds, gateway_secret
from specgate.gateway.limits.limiters import (
    Concurrency,
    ConcurrencyLimiter,
    Limiter,
    RateLimiter,
    RefusalBudget,
)
from specgate.gateway.limits.shared import SharedTables, attached
from specgate.gateway.limits.shared_buckets import SharedRateLimiter
from specgate.gateway.policy.manager import PolicyManager
from specgate.gateway.policy.store import MemoryPolicyStore, SqlPolicyStore
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.routing.router import Router, RoutingPolicy
from specgate.gateway.settings import Settings
from specgate.gateway.telemetry.metrics import Metrics
from specgate.gateway.telemetry.records import MemorySink, RecordSink, RequestRecord
from specgate.gateway.telemetry.responses_store import ResponseStore
from specgate.gateway.telemetry.schema import default_data_dir
from specgate.gateway.telemetry.store import TelemetryStore
from specgate.gateway.worker_context import WorkerContext
from specgate.policies.classifier import DEFAULT_ARTIFACT, WorkloadClassifier
from specgate.policies.decision import Slo
from specgate.policies.load import Load

logger = logging.getLogger("specgate.gateway")

ReadinessCheck = Callable[[], Awaitable[tuple[bool, str]]]


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """What one tenant (an API key, or a client address in open mode) may hold at once; 0: no cap."""

    max_in_flight: int
    max_streams: int
    rate_limit_rpm: int

    def __post_init__(self) -> None:
        if min(self.max_in_flight, self.max_streams, self.rate_limit_rpm) < 0:
            raise ValueError("tenant limits must not be negative")


def secret_path(settings: Settings) -> Path:
    return Path(settings.secret_file) if settings.secret_file else default_data_dir() / "gateway.secret"


@dataclass
class Services:
    settings: Settings
    client: UpstreamClient
    registry: BackendRegistry
    router: Router
    metrics: Metrics
    recent: MemorySink  # the latest records, in memory
    store: TelemetryStore | None  # durable rows (SQLite / PostgreSQL)
    limiter: Limiter  # RateLimiter, or in a worker the one shared by all (limits/shared.py)
    refusals: RefusalBudget  # 401 / 413 answers per client address
    policy: PolicyManager | None = None  # None: the static router
    extra_sinks: list[RecordSink] = field(default_factory=list)
    # Extra readiness checks by name (the telemetry store adds "store").
    readiness: dict[str, ReadinessCheck] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    api_keys: list[str] = field(default_factory=list)  # the accepted /v1 keys, read once
    worker: WorkerContext | None = None  # set in a worker of `serve --workers N`: what it shares
    # Fingerprints of API keys (`build` keys them with the gateway's secret file; by default a
    # secret of this process alone).
    key_ids: KeyIds = field(default_factory=lambda: KeyIds(secrets.token_bytes(32)))
    in_flight: Concurrency = field(default_factory=ConcurrencyLimiter)  # per tenant: requests, streams
    # Limits of the keys that have their own, by key id; everyone else has `default_limits`.
    key_limits: dict[str, TenantLimits] = field(default_factory=dict)
    default_limits: TenantLimits = TenantLimits(0, 0, 0)
    shared: SharedTables | None = None
    # Latency targets of the keys that set their own (ApiKey.slo_*), by key id.
    key_slos: dict[str, Slo] = field(default_factory=dict)
    _limiters: dict[int, Limiter] = field(default_factory=dict)
    responses: ResponseStore | None = None  # stored Responses API answers (with the telemetry store)

    @classmethod
    def build(
        cls,
        settings: Settings,
        cache_dir: str | None,
        sink: RecordSink | None = None,
        worker: WorkerContext | None = None,
    ) -> Services:
        # One pooled client for every external backend; per-backend timeouts are set per request.
        client = UpstreamClient(max_connections=1000)
        engine_socket = worker.engine_socket if worker is not None else None
        shared = attached(worker.shared_limits if worker is not None else None)
        in_flight: Concurrency = ConcurrencyLimiter()
        if shared is not None and worker is not None:
            counters = shared.in_flight(worker.index, worker.workers)
            # A new generation of this worker's counts: what a dead predecessor in its slot held
            # stops counting.
            counters.bump(worker.index)
            in_flight = counters
        registry = BackendRegistry.from_settings(
            settings, client, cache_dir, engine_socket, in_flight if shared is not None else None
        )
        relay = worker.telemetry_socket if worker is not None else None  # the supervisor's one writer
        store = TelemetryStore(settings.telemetry, relay) if settings.telemetry.enabled else None
        policy: PolicyManager | None = None
        routing: RoutingPolicy | None = None
        if settings.policy.enabled:
            path = settings.policy.classifier_path
            classifier = WorkloadClassifier.load(Path(path) if path else DEFAULT_ARTIFACT)
            versions = SqlPolicyStore(store.engine) if store is not None else MemoryPolicyStore()
            policy = PolicyManager(settings.policy, versions, persistent=store is not None)
            routing = RoutingPolicy(classifier, policy)
        router = Router(settings, registry, routing)
        key_ids = KeyIds(gateway_secret(secret_path(settings)))
        defaults = TenantLimits(
            settings.max_in_flight_per_key, settings.max_streams_per_key, settings.rate_limit_rpm
        )
        key_limits = {
            key_ids.of(k.key.get_secret_value()): TenantLimits(
                defaults.max_in_flight if k.max_in_flight is None else k.max_in_flight,
                defaults.max_streams if k.max_streams is None else k.max_streams,
                defaults.rate_limit_rpm if k.rate_limit_rpm is None else k.rate_limit_rpm,
            )
            for k in settings.api_keys
        }
        key_slos = {
            key_ids.of(k.key.get_secret_value()): Slo(k.slo_ttft_ms, k.slo_tpot_ms)
            for k in settings.api_keys
            if k.slo_ttft_ms is not None or k.slo_tpot_ms is not None
        }
        services = cls(
            settings=settings,
            client=client,
            registry=registry,
            router=router,
            metrics=Metrics(multiprocess=worker is not None and worker.metrics_dir is not None),
            recent=MemorySink(),
            store=store,
            limiter=shared.api if shared else RateLimiter(settings.rate_limit_rpm),
            refusals=RefusalBudget(shared.refusals if shared else RateLimiter(settings.refused_rpm)),
            policy=policy,
            extra_sinks=[sink] if sink is not None else [],
            api_keys=[k.key.get_secret_value() for k in settings.api_keys],
            worker=worker,
            key_ids=key_ids,
            in_flight=in_flight,
            key_limits=key_limits,
            default_limits=defaults,
            shared=shared,
            key_slos=key_slos,
            responses=ResponseStore(store.engine) if store is not None else None,
        )
        services.metrics.models = registry.models
        if store is not None:
            services.readiness["store"] = store.ready
            services.metrics.watch_writer(store.counters, store.queue_size)
        return services

    def complete(self, record: RequestRecord, prefix_blocks: Sequence[int] | None = None) -> None:
        """The request is over (the middleware calls this once, whatever happened): count its
        record and hand it to the sinks. `prefix_blocks`: the prompt's block hashes where prefix
        affinity read them (`Plan.prefix_blocks`), for it to learn from how the request went."""
        try:
            self.metrics.observe(record)
        except Exception:  # a metrics bug must not cost the row
            logger.exception("counting request %s failed", record.request_id)
        route = record.route
        if route is not None and prefix_blocks:
            try:
                if record.outcome == "ok":
                    self.router.affinity.observe(
                        route, prefix_blocks, record.cached_tokens, record.prompt_tokens
                    )
                else:
                    self.router.affinity.undo(route, prefix_blocks)
            except Exception:  # nor may the prefix index's
                logger.exception("updating the prefix index for %s failed", record.request_id)
        self.submit(record)
        if self.settings.log_requests:
            logger.info(
                "%s %s model=%r backend=%s status=%s outcome=%s tokens=%s/%s e2e_ms=%.1f",
                record.request_id,
                record.endpoint,
                record.model[:64],
                record.backend,
                record.status,
                record.outcome,
                record.prompt_tokens,
                record.completion_tokens,
                record.e2e_ms or 0.0,
            )

    def submit(self, record: RequestRecord) -> None:
        """Hand a finished request's record to every sink; a failing sink never fails the request."""
        sinks: list[RecordSink | None] = [self.recent, self.store, *self.extra_sinks]
        for sink in sinks:
            if sink is None:
                continue
            try:
                sink.submit(record)
            except Exception:
                logger.exception("record sink %s refused request %s", type(sink).__name__, record.request_id)

    def tenant_limits(self, key_id: str | None) -> TenantLimits:
        """The limits of a key (by its id; None: a client address in open mode)."""
        return self.key_limits.get(key_id, self.default_limits) if key_id else self.default_limits

    def limiter_for(self, rpm: int) -> Limiter:
        """The rate limiter of keys allowed `rpm` requests a minute (the gateway-wide one for the
        default rate): one set of buckets, in shared memory with several workers."""
        if rpm == self.settings.rate_limit_rpm:
            return self.limiter
        limiter = self._limiters.get(rpm)
        if limiter is None:
            if self.shared is not None:
                limiter = SharedRateLimiter(self.shared.tables["api"], rpm)
            else:
                limiter = RateLimiter(rpm)
            self._limiters[rpm] = limiter
        return limiter

    async def start(self) -> None:
        if self.store is not None:
            await asyncio.to_thread(self.store.open)
        if self.policy is not None:
            await asyncio.to_thread(self.policy.load)  # warm start from the active version
            # Every worker follows the active version; one retrains on schedule, not N.
            self.policy.start(retrain=self.worker is None or self.worker.index == 0)
        await self.registry.start()

    async def close(self) -> None:
        if self.policy is not None:
            await self.policy.close()
        await self.registry.close()
        await self.client.aclose()
        if self.responses is not None:
            await asyncio.to_thread(self.responses.close)  # writes every queued response first
        if self.store is not None:
            await asyncio.to_thread(self.store.close)  # flushes every queued row first

    def refresh_gauges(self) -> None:
        """Set the load and health gauges from their sources; called when /metrics is scraped."""
        self.metrics.refresh_backends(self.registry.status())
        embedded = self.registry.embedded
        if embedded is not None and embedded.client is not None:
            w = embedded.client
            self.metrics.refresh_engine(
                w.num_waiting, w.load.num_running, w.load.kv_cache_usage, w.load.kv_blocks_used
            )

    def cache_scope(self, key_id: str | None, addr: str) -> str | None:
        """The drafting-cache scope of a request from this key / address (settings.embedded)."""
        return self._scope(self.settings.embedded.draft_cache_scope, key_id, addr)

    def prefix_salt(self, key_id: str | None, addr: str, cache_salt: str | None = None) -> str | None:
        """The prefix-cache salt of a request: its tenant's scope (settings.embedded
        .prefix_cache_scope), partitioned further by the client's own `cache_salt` if it sent one.
        None: the request shares cached prompts with nobody."""
        scope = self._scope(self.settings.embedded.prefix_cache_scope, key_id, addr)
        if scope is None or cache_salt is None:
            return scope
        return salted(scope, cache_salt)

    def _scope(self, mode: str, key_id: str | None, addr: str) -> str | None:
        if mode == "off":
            return None
        if mode == "global":
            return ""
        if mode == "tenant" and self.api_keys and key_id:
            return key_id
        return f"addr:{addr}"

    def slo(self, key_id: str | None, headers: Mapping[str, str]) -> Slo | None:
        """A request's latency targets: its headers, else its key's, else the gateway's; each
        target on its own. 400 for a header that is not a positive number of milliseconds."""
        key = self.key_slos.get(key_id or "") or Slo()
        gw = self.settings.slo
        ttft = _slo_header(headers, "x-slo-ttft-ms", gw.ttft_ms if key.ttft_ms is None else key.ttft_ms)
        tpot = _slo_header(headers, "x-slo-tpot-ms", gw.tpot_ms if key.tpot_ms is None else key.tpot_ms)
        return None if ttft is None and tpot is None else Slo(ttft, tpot)

    def load_signals(self) -> Load:
        """What the routing policy reads of the current load."""
        backends = self.registry.loads()
        embedded = self.registry.embedded
        if embedded is None or embedded.client is None:
            return Load(backends=backends)
        w = embedded.client
        # Waiting: what the engine reported, plus this worker's submissions it has not taken yet.
        return Load(engine=dataclasses.replace(w.load, num_waiting=w.num_waiting), backends=backends)


def salted(scope: str, cache_salt: str) -> str:
    """A scope combined with a client's salt. Hashed, so that the result is short whatever the
    client sent and no choice of salt can spell another scope (the NUL separator appears in
    neither part: scopes are key hashes or addresses, and salts may hold no control characters)."""
    digest = hashlib.sha256(f"{scope}\x00{cache_salt}".encode()).hexdigest()
    return f"salt:{digest}"


def _slo_header(headers: Mapping[str, str], name: str, default: float | None) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return default
    try:
        value = float(raw.strip()) if len(raw) <= 32 else math.nan
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1e7:  # NaN fails too
        raise GatewayError(
            400,
            f"{name} must be a positive number of milliseconds (at most 1e7)",
            param=name,
            code="invalid_value",
        )
    return value
