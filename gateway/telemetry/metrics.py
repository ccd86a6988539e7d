"""Prometheus metrics, one registry per app (no process-wide singletons, so apps in tests are independent).

In a worker of `specgate serve --workers N` (`multiprocess=True`), prometheus_client keeps every
value in a file of this process under PROMETHEUS_MULTIPROC_DIR (set by the supervisor before the
worker imported prometheus_client), and `render` shows the sum over all the workers, the live and
the dead: any worker's /metrics counts every request. Gauges say how they combine: requests in
flight add up over the live workers; the engine's gauges are one engine's (the core is shared, so
the most recent worker's reading, not N times it); a backend's health is the scraping worker's view.

Label values come only from bounded sets: configured backends, the models they serve (anything else
a client names is `unknown`), endpoints, statuses, classes and arms. Nothing a client sends
unauthenticated can mint a new series or put a string Prometheus cannot encode into the output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeGuard

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specgate.gateway.telemetry.multiproc import multiprocess_view
from specgate.gateway.telemetry.records import RequestRecord

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1)
_OVERHEAD = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)


UNKNOWN = "unknown"
MAX_MODEL_LABELS = 512  # served models beyond this many share the label "other"
MAX_COUNT = 2**31 - 1  # the most tokens one request may add to a counter


GaugeMode = Literal["livesum", "livemostrecent"]


class Metrics:
    def __init__(self, *, multiprocess: bool = False) -> None:
        # The models backends serve now (set by Services); label values for `model`.
        self.models: Callable[[], Mapping[str, Any]] = dict
        self._model_labels: set[str] = set()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry = CollectorRegistry()
        # What /metrics shows: this app's registry, or (multiprocess) every worker's files plus this
        # worker's own collectors (the telemetry writer's counters).
        self.view = multiprocess_view() if multiprocess else r

        def gauge(name: str, doc: str, labels: tuple[str, ...] = (), *, mode: GaugeMode) -> Gauge:
            # The mode matters only in multiprocess mode (the default would show one series per pid).
            return Gauge(name, doc, labels, registry=r, multiprocess_mode=mode)

        self.requests = Counter(
            "specgate_requests",
            "Requests by endpoint, model, backend and HTTP status",
            ["endpoint", "model", "backend", "status", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "specgate_ttft_seconds", "Time to first token", ["model", "backend"], buckets=_LATENCY, registry=r
        )
        self.tpot = Histogram(
            "specgate_tpot_seconds",
            "Time per output token after the first",
            ["model", "backend"],
            buckets=_TPOT,
            registry=r,
        )
        self.e2e = Histogram(
            "specgate_e2e_seconds",
            "Request latency, end to end",
            ["model", "backend"],
            buckets=_LATENCY,
            registry=r,
        )
        self.overhead = Histogram(
            "specgate_gateway_overhead_seconds",
            "Time spent in the gateway before the backend was called",
            ["endpoint"],
            buckets=_OVERHEAD,
            registry=r,
        )
        self.tokens = Counter("specgate_tokens", "Tokens by kind", ["model", "kind"], registry=r)
        self.routes = Counter(
            "specgate_route_decisions",
            "Routed requests by workload class, the arm that served them, and the policy that chose it",
            ["workload_class", "arm", "policy", "explored"],
            registry=r,
        )
        # Replica affinity: hit (the conversation's home replica served it), miss (load or a failure
        # moved it), unkeyed (nothing identified the conversation: least loaded replica).
        self.affinity = Counter(
            "specgate_affinity_requests",
            "Requests routed within a replica group, by whether the conversation's home replica served",
            ["group", "result"],
            registry=r,
        )
        # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens: hit rate = hits / queried.
        # Counted only where the backend reports its hits (the embedded engine always does).
        self.prefix_queried = Counter(
            "specgate_prefix_cache_queried_tokens",
            "Prompt tokens looked up in a prefix cache",
            ["model", "backend"],
            registry=r,
        )
        self.prefix_hits = Counter(
            "specgate_prefix_cache_hit_tokens",
            "Prompt tokens served from a prefix cache",
            ["model", "backend"],
            registry=r,
        )
        self.draft_tokens = Counter(
            "specgate_spec_draft_tokens", "Drafted tokens", ["model", "method"], registry=r
        )
        self.accepted_tokens = Counter(
            "specgate_spec_accepted_tokens", "Accepted drafted tokens", ["model", "method"], registry=r
        )
        self.acceptance_length = Histogram(
            "specgate_spec_acceptance_length",
            "Mean tokens per verification step, per request",
            ["model", "method"],
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8),
            registry=r,
        )
        one: GaugeMode = "livemostrecent"  # the engine is shared: one value whichever worker read it
        self.queue_depth = gauge("specgate_engine_queue_depth", "Requests waiting for a batch slot", mode=one)
        self.batch_size = gauge("specgate_engine_batch_size", "Requests running in the engine", mode=one)
        self.kv_usage = gauge("specgate_engine_kv_usage", "Fraction of KV-cache blocks in use", mode=one)
        self.kv_blocks = gauge(
            "specgate_engine_kv_blocks_used", "KV-cache blocks held by requests (0 when idle)", mode=one
        )
        self.in_flight = gauge("specgate_in_flight_requests", "Requests being served now", mode="livesum")
        # Each worker has its own breakers and upstream connections: health is the scraping
        # worker's view; in-flight counts are summed (as of each worker's latest scrape).
        self.backend_up = gauge(
            "specgate_backend_up", "1 if the backend takes traffic", ("backend",), mode=one
        )
        self.backend_in_flight = gauge(
            "specgate_backend_in_flight", "Requests in flight per backend", ("backend",), mode="livesum"
        )
        self.breaker_open = gauge(
            "specgate_backend_breaker_open", "1 while the backend's breaker is open", ("backend",), mode=one
        )
        self.retries = Counter(
            "specgate_backend_attempts", "Upstream attempts, retries included", ["backend"], registry=r
        )
        self.failovers = Counter(
            "specgate_failovers", "Requests served by a later candidate backend", ["model"], registry=r
        )

    def model_label(self, model: str) -> str:
        if model in self._model_labels:
            return model
        if model not in self.models():
            return UNKNOWN
        if len(self._model_labels) >= MAX_MODEL_LABELS:
            return "other"
        self._model_labels.add(model)
        return model

    def observe(self, rec: RequestRecord) -> None:
        backend = rec.backend or "none"
        model = self.model_label(rec.model)
        self._child(self.requests, rec.endpoint, model, backend, str(rec.status), rec.outcome).inc()
        if rec.overhead_ms is not None:
            self._child(self.overhead, rec.endpoint).observe(rec.overhead_ms / 1e3)
        route = rec.route
        if rec.workload_class is not None and route is not None and route.arm:
            explored = str(route.explored).lower()
            self._child(self.routes, rec.workload_class, route.arm, route.policy, explored).inc()
        affinity = route.affinity if route is not None else None
        if affinity is not None and rec.backend:
            hit = affinity.get("hit")
            result = "unkeyed" if hit is None else "hit" if hit else "miss"
            self._child(self.affinity, affinity["group"], result).inc()
        if rec.backend and rec.attempts:
            self._child(self.retries, rec.backend).inc(rec.attempts)
        self._observe_prefix_cache(rec, model, backend)
        if rec.outcome != "ok":
            return
        for value, hist in ((rec.ttft_ms, self.ttft), (rec.tpot_ms, self.tpot), (rec.e2e_ms, self.e2e)):
            if value is not None:
                self._child(hist, model, backend).observe(value / 1e3)
        if _is_count(rec.prompt_tokens) and rec.prompt_tokens:
            self._child(self.tokens, model, "prompt").inc(rec.prompt_tokens)
        if _is_count(rec.completion_tokens) and rec.completion_tokens:
            self._child(self.tokens, model, "completion").inc(rec.completion_tokens)
        spec = rec.spec_decoding or {}
        method = spec.get("method")
        if method:
            self._child(self.draft_tokens, model, method).inc(spec.get("num_draft_tokens") or 0)
            self._child(self.accepted_tokens, model, method).inc(spec.get("num_accepted_tokens") or 0)
            if spec.get("num_drafts") and spec.get("mean_acceptance_length"):
                self._child(self.acceptance_length, model, method).observe(spec["mean_acceptance_length"])

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: prometheus_client validates and locks on every call,
        and a request observes about ten series. Bounded: every label value comes from a bounded set."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _observe_prefix_cache(self, rec: RequestRecord, model: str, backend: str) -> None:
        """Any outcome counts: the lookup happened when the prompt was scheduled. Only counts a
        counter can take (an upstream's numbers are checked before they get here, but a negative or
        non-integer value would make the counter raise and cost the rest of this request's series)."""
        queried, hits = rec.prompt_tokens, rec.cached_tokens
        if _is_count(queried) and _is_count(hits):
            self.prefix_queried.labels(model, backend).inc(queried)
            self.prefix_hits.labels(model, backend).inc(min(hits, queried))

    def refresh_engine(self, waiting: int, running: int, kv_usage: float, kv_blocks: int = 0) -> None:
        self.queue_depth.set(waiting)
        self.batch_size.set(running)
        self.kv_usage.set(kv_usage)
        self.kv_blocks.set(kv_blocks)

    def refresh_backends(self, status: dict[str, dict[str, Any]]) -> None:
        for name, st in status.items():
            self.backend_up.labels(name).set(1 if st.get("healthy") else 0)
            self.breaker_open.labels(name).set(1 if st.get("breaker") == "open" else 0)
            if "in_flight" in st:
                self.backend_in_flight.labels(name).set(st["in_flight"])

    def watch_writer(self, counters: Any, queue_size: Callable[[], int]) -> None:
        """Export the telemetry writer's counters (read at scrape time, no locking needed)."""
        collector = _WriterCollector(counters, queue_size)
        self.registry.register(collector)
        if self.view is not self.registry:
            self.view.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.view)


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


class _WriterCollector(Collector):
    def __init__(self, counters: Any, queue_size: Callable[[], int]) -> None:
        self.counters = counters
        self.queue_size = queue_size

    def collect(self) -> Iterator[Metric]:
        c = self.counters
        for name, value, doc in (
            ("queued", c.queued, "Rows handed to the telemetry writer"),
            ("written", c.written, "Rows inserted into the database directly"),
            ("spooled", c.spooled, "Rows written to the spool file while the database was unavailable"),
            ("replayed", c.replayed, "Spooled rows replayed into the database"),
            ("dropped", c.dropped, "Rows lost (the spool's disk failed); must stay 0"),
            ("db_errors", c.db_errors, "Failed database writes"),
            ("quarantined", c.quarantined, "Rows the database refused (kept in telemetry_quarantine)"),
        ):
            yield CounterMetricFamily(f"specgate_telemetry_rows_{name}", doc, value=value)
        yield GaugeMetricFamily(
            "specgate_telemetry_queue_depth", "Rows waiting for the writer", value=self.queue_size()
        )
        yield GaugeMetricFamily(
            "specgate_telemetry_spool_backlog",
            "Rows in this process's spool, not yet in the database",
            value=c.spool_backlog,
        )
