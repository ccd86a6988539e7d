"""Table metadata of the telemetry store: the one thing Alembic's env.py imports.

Keep this module free of imports from the rest of the project.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
    }
)

requests = Table(
    "requests",
    metadata,
    # Identity. request_id is the gateway's own (unique); client_request_id the client's
    # x-request-id as sent (it may repeat). The key id is an HMAC of the API key under the
    # gateway's secret (gateway/keyring.py), never the key; `legacy-...` on rows from before 0008.
    Column("request_id", String(128), primary_key=True),
    Column("client_request_id", String(128)),
    Column("api_key_id", String(32)),
    Column("endpoint", String(16), nullable=False),
    Column("model", String(256), nullable=False),
    Column("stream", Boolean, nullable=False),
    # Timestamps (UTC).
    Column("arrival_time", DateTime(timezone=True), nullable=False),
    Column("first_token_time", DateTime(timezone=True)),
    Column("finished_time", DateTime(timezone=True)),
    # Outcome.
    Column("status", Integer, nullable=False),
    Column("outcome", String(16), nullable=False),  # ok | error | cancelled
    Column("cancelled", Boolean, nullable=False),
    Column("finish_reason", String(32)),
    Column("error_code", String(64)),
    # Tokens and timing.
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    # Prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens); NULL
    # when the backend does not report it.
    Column("cached_tokens", Integer),
    Column("queue_time_ms", Float),
    Column("ttft_ms", Float),
    Column("tpot_ms", Float),
    Column("e2e_ms", Float),
    Column("tokens_per_s", Float),
    Column("overhead_ms", Float),
    Column("attempts", Integer),
    # The route decision.
    Column("backend", String(128)),
    Column("spec_method", String(64)),
    Column("spec_controller", String(32)),
    Column("k_min", Integer),
    Column("k_max", Integer),
    Column("policy", String(64)),
    Column("policy_version", String(64)),
    Column("decision_reason", Text),
    Column("route", JSON),
    # What the policy saw: the request's workload class and features.
    Column("workload_class", String(32)),
    Column("class_confidence", Float),
    Column("features", JSON),
    # Load at arrival.
    Column("load_queue_depth", Integer),
    Column("load_running", Integer),
    Column("load_kv_usage", Float),
    Column("load_backend_in_flight", Integer),
    # Speculation (vLLM's names).
    Column("num_drafts", Integer),
    Column("num_draft_tokens", Integer),
    Column("num_accepted_tokens", Integer),
    Column("mean_acceptance_length", Float),
    Column("draft_acceptance_rate", Float),
    Column("num_accepted_tokens_per_pos", JSON),  # by depth when drafts are trees
    # Draft trees: verification steps whose draft branched; drafted tokens (tree nodes) per step.
    Column("num_tree_drafts", Integer),
    Column("mean_draft_nodes", Float),
    # Structured outputs: the constraint's kind (json_schema | regex | choice | lark | gbnf; NULL:
    # none) and the drafted tokens its grammar forced (counted in num_draft_tokens too when the
    # request speculated).
    Column("grammar", String(16)),
    Column("num_forced_draft_tokens", Integer),
    # Latency targets (x-slo-* headers or the key's defaults) and whether they were met (NULL: no
    # target, or a latency unknown).
    Column("slo_ttft_ms", Float),
    Column("slo_tpot_ms", Float),
    Column("slo_met", Boolean),
    # The serving backend's requests running and waiting as the router saw them (its /metrics, else
    # this gateway's requests in flight there).
    Column("load_backend_batch", Integer),
    # Prefix affinity: the prompt blocks the index believed the chosen replica held.
    Column("prefix_matched_blocks", Integer),
    # The probability the routing policy had of choosing the arm it chose (off-policy evaluation).
    Column("propensity", Float),
    # Replica affinity (routing/affinity.py): the replica group, what keyed the conversation
    # (user | prefix | none) and whether its home replica served it: the affinity hit rate.
    Column("affinity_group", String(64)),
    Column("affinity_source", String(16)),
    Column("affinity_hit", Boolean),
    Column("upstream", JSON),  # what an external backend reported (vLLM metrics, SGLang meta_info...)
    Index(None, "arrival_time"),
    Index(None, "model", "arrival_time"),
    Index(None, "workload_class", "spec_method"),
    Index(None, "backend", "spec_method", "arrival_time"),
    Index(None, "outcome", "arrival_time"),
    Index(None, "client_request_id"),
)

spec_steps = Table(
    "spec_steps",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("request_id", String(128), nullable=False),
    Column("step_index", Integer, nullable=False),
    Column("k_proposed", Integer, nullable=False),
    Column("accepted", Integer, nullable=False),
    Column("batch_tokens", Integer),
    Column("step_ms", Float),
    # The draft's depth: k_proposed for a chain, less for a tree of k_proposed nodes (then
    # `accepted` is the accepted path's depth).
    Column("depth", Integer),
    UniqueConstraint("request_id", "step_index"),
)

# One row per fitted or edited routing policy; exactly one is active at a time. Request rows name
# the version that routed them in requests.policy_version.
policy_versions = Table(
    "policy_versions",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("kind", String(16), nullable=False),  # rules | learned
    Column("source", String(16), nullable=False),  # default | retrain | edit | rollback
    Column("status", String(16), nullable=False),  # active | retired | rejected
    Column("parent_version", Integer),  # the version this one was derived from
    Column("promoted_at", DateTime(timezone=True)),
    Column("window_start", DateTime(timezone=True)),  # training window (retrains only)
    Column("window_end", DateTime(timezone=True)),
    Column("train_rows", Integer),
    Column("metrics", JSON),  # offline evaluation: candidate vs the version it was compared with
    Column("artifact", JSON, nullable=False),  # policies.state.PolicyState.as_dict()
    Column("note", Text),
    Index(None, "status"),
)

# Rows the database refused for a reason of their own (not an outage): kept here with the error,
# never retried in a loop, never blocking the rows behind them. `row` is the JSON of the row.
telemetry_quarantine = Table(
    "telemetry_quarantine",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("quarantined_at", DateTime(timezone=True), nullable=False),
    Column("request_id", String(128)),
    Column("error", Text, nullable=False),
    Column("row", Text, nullable=False),
    Index(None, "quarantined_at"),
)

# Signed-out dashboard sessions, until their cookies would have expired anyway: every worker,
# replica and restart of the gateway refuses them (the cookie itself cannot be recalled).
dashboard_revocations = Table(
    "dashboard_revocations",
    metadata,
    Column("session_id", String(64), primary_key=True),
    Column("revoked_at", Float, nullable=False),  # unix seconds
    Column("expires_at", Float, nullable=False),
    Index(None, "expires_at"),
)

# Stored Responses API responses (`store`, default true): each one's conversation so far (`input`:
# the items it was given, the conversation it continued first) and what it answered (`output`),
# for `previous_response_id`, GET and DELETE /v1/responses/{id}. Only the key that created one
# (`owner`: its key id, or `addr:...` in open mode) may read or continue it.
responses = Table(
    "responses",
    metadata,
    Column("response_id", String(160), primary_key=True),
    Column("owner", String(128), nullable=False),
    Column("created_at", Float, nullable=False),  # unix seconds
    Column("model", String(256), nullable=False),
    Column("status", String(16), nullable=False),
    Column("previous_response_id", String(160)),
    Column("input_tokens", Integer),
    Column("output_tokens", Integer),
    Column("input_items", JSON, nullable=False),
    Column("output_items", JSON, nullable=False),
    Column("response", JSON, nullable=False),  # the response object as answered, output included
    Index(None, "owner", "created_at"),
)
