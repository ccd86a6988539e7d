"""Gateway settings: defaults, then an optional config file (TOML, YAML or JSON), then SPECGATE_* env vars.

Pydantic lives here because this is an edge: operators write these values by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from specgate.engine.vocab import SpecParams

if TYPE_CHECKING:
    from specgate.engine.config import EngineConfig

MIN_ADMIN_KEY_CHARS = 16


class EmbeddedSettings(BaseModel):
    """The in-process engine. `model` None serves the embedded default (SmolLM2-135M-Instruct)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    name: str = Field("embedded", min_length=1, max_length=128, pattern=r"^[^:\s]+$")  # see BackendSettings
    model: str | None = None
    gguf_file: str | None = None
    served_model_name: str | None = None  # default: the model's own name
    # The chat template, overriding the model's own (llama-server's --chat-template): a built-in's
    # name (chatml, llama3, ...: backends/embedded/builtin_templates.py) or Jinja text. None: the
    # model's own, and chat requests to a model without one get a 400.
    chat_template: str | None = None
    # The chat template from a file: read once, at load, into `chat_template`.
    chat_template_file: str | None = None
    aliases: list[str] = Field(default_factory=list)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    # Linear weights on CPU: auto = each tensor at its GGUF source's precision (4-bit -> int4 kernels;
    # the default model's Q4_1 layers are reproduced exactly), none / int8 / int4 (engine/models/plan.py).
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    # auto: the compact decoder for Llama / Qwen2 / Mistral, the Hugging Face modules otherwise.
    model_impl: Literal["auto", "compact", "hf"] = "auto"
    threads: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    kv_cache_bytes: int = Field(512 * 2**20, ge=1)
    num_blocks: int | None = Field(None, ge=1)
    block_size: int = Field(16, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    convert_cache_dir: str | None = None
    seed: int = 0
    # Time forward passes of 1-64 tokens after loading (about 3 s on a 1.5B model on two
    # cores), so that speculation's step-cost curve is measured before the first requests draft.
    warm_up: bool = True
    # Requests waiting for a batch slot beyond this get 503 with Retry-After.
    max_waiting: int = Field(256, ge=1)
    # How requests speculate unless the routing policy or the request says otherwise: the engine's
    # own SpecParams (method, controller, k_min, k_max, num_speculative_tokens, acceptance_prior).
    spec: SpecParams = Field(default_factory=lambda: SpecParams(method="ngram"))
    # Who shares the suffix proposer's cache of earlier outputs (a draft taken from another tenant's
    # output would leak it through acceptance and timing): "tenant" = per API key, or per client
    # address in open mode; "address" = per client address; "global" = everyone; "off" = nobody.
    draft_cache_scope: Literal["tenant", "address", "global", "off"] = "tenant"
    # Automatic prefix caching: a prompt that starts like an earlier one reuses its KV blocks and
    # skips their prefill. `prefix_cache_bytes` caps what cached blocks no request uses may hold
    # (None: any free part of the KV pool; 0 keeps nothing once its requests end).
    prefix_caching: bool = True
    prefix_cache_bytes: int | None = Field(None, ge=0)
    # Who may hit whose cached prompts: a hit shows in the time to first token, so a shared cache
    # tells one tenant what another's prompts start with. Same values as draft_cache_scope; a
    # request's `cache_salt` partitions its scope further, never reaching beyond it.
    prefix_cache_scope: Literal["tenant", "address", "global", "off"] = "tenant"
    # Batch-invariant kernels: a temperature-0 answer does not depend on the batch it ran in, the
    # speculation method or K, or a prefix-cache hit (engine/batch_invariant.py; docs/engine.md has its cost).
    deterministic: bool = False
    # Constrained requests (structured outputs) draft the tokens their grammar forces: free drafts,
    # verified like any other, so the output is unchanged. Off only to measure what they give.
    forced_drafts: bool = True
    # Token counts of the decode / verify steps compiled with torch.compile at start-up (CPU, compact
    # decoder; ~45 s each on two cores, every start). `specgate serve --compile` sets (1, 2, 4, 8, 16).
    # Empty: every step runs eagerly.
    compile_sizes: list[Annotated[int, Field(ge=1, le=256)]] = Field(default_factory=list)
    # Per proposer, e.g. {"draft_model": {"model": "/path"}, "eagle": {"head": "/path"}}; the default
    # model's EAGLE head ships with specgate.
    proposer_options: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _no_engine_process(cls, data: Any) -> Any:
        # A removed key is named with its replacement, not refused as merely unknown.
        if isinstance(data, dict) and "engine_process" in data:
            raise ValueError(
                "embedded.engine_process is not a setting (remove it): `specgate serve` runs the engine "
                "in its shared engine core process, `specgate serve --engine-thread` in a thread of one "
                "gateway process, as an app built by create_app does"
            )
        return data

    @model_validator(mode="after")
    def _template_file(self) -> EmbeddedSettings:
        if self.chat_template_file is not None:
            if self.chat_template is not None:
                raise ValueError("set embedded.chat_template or embedded.chat_template_file, not both")
            # Read: a copy of these settings (each worker's) carries the text, not the path.
            self.chat_template = read_chat_template_file(self.chat_template_file)
            self.chat_template_file = None
        return self

    def engine_config(self, cache_dir: str | None = None) -> EngineConfig:
        """The engine's config: every EngineConfig field these settings name (and `threads` as
        num_threads); the engine validates it. No field list to keep in step by hand."""
        from specgate.engine.config import EngineConfig  # torch: only when an engine is built

        names = {f.name for f in dataclasses.fields(EngineConfig)}
        given = {k: v for k, v in self.model_dump().items() if k in names}
        given["num_threads"] = self.threads
        given["convert_cache_dir"] = self.convert_cache_dir or cache_dir
        return EngineConfig(**given)


class BackendSettings(BaseModel):
    """An external OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp, Ollama, another specgate)."""

    model_config = ConfigDict(extra="forbid")
    # A routing arm is "<backend>:<method>": a name with a colon could not be told apart.
    name: str = Field(min_length=1, max_length=128, pattern=r"^[^:\s]+$")
    base_url: str  # up to and including /v1, e.g. http://127.0.0.1:8001/v1
    api_key: SecretStr | None = None
    # Public model name -> the backend's own name; a list entry serves a model under its own name.
    # Empty: the models the backend lists at /models, discovered by the health probe.
    models: dict[str, str] = Field(default_factory=dict)
    connect_timeout: float = Field(2.0, gt=0)
    read_timeout: float = Field(60.0, gt=0)  # between bytes
    total_timeout: float = Field(600.0, gt=0)  # whole request, streaming included
    max_retries: int = Field(2, ge=0)  # on connection errors, 429 and 5xx before the first byte
    retry_backoff: float = Field(0.05, ge=0)  # seconds, doubled per retry
    max_retry_wait: float = Field(2.0, ge=0)  # a longer Retry-After moves on to the next backend
    breaker_failures: int = Field(3, ge=1)  # consecutive failures that open the breaker
    breaker_cooldown: float = Field(10.0, gt=0)  # seconds open before a half-open probe
    health_interval: float = Field(5.0, ge=0)  # 0 disables background probes
    max_response_bytes: int = Field(32 * 2**20, ge=1024)  # a bigger upstream body is a 502
    max_event_bytes: int = Field(2**20, ge=1024)  # a bigger SSE line or event is a 502
    # Backends with the same group are replicas of one deployment (the same weights behind
    # several servers): a conversation sticks to one of them while it is healthy and not
    # overloaded, so that the replica's prefix cache holds its earlier turns (`affinity`).
    # The group is one routing arm (the policy picks the group, affinity the replica in it), so its
    # name follows the same rule as a backend's and may not be another backend's name.
    replica_group: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[^:\s]+$")
    # Whether this server speculates, and how: a routing arm of its own kind, `<name>:upstream` when
    # it does not, `<name>:upstream-<method>` when it does. auto: discovered from its /metrics
    # (speculation counters that count drafts), off until they do; "on": it speculates, method unsaid.
    speculative: Literal["auto", "off", "on", "ngram", "suffix", "eagle", "draft_model"] = "auto"
    # Its Prometheus /metrics, read every health interval for its load (requests running and waiting,
    # KV-cache use, speculation counters). None: `base_url` without its trailing /v1, plus /metrics.
    metrics_url: str | None = None
    scrape_metrics: bool = True  # False: its load is this gateway's own in-flight count alone
    # It serves the OpenAI Responses API itself (vLLM, SGLang, llama-server): /v1/responses goes to
    # its /responses as sent (the gateway keeps the stored conversation); False: it gets the request
    # translated to chat completions, as the embedded engine does.
    responses_api: bool = False

    @field_validator("models", mode="before")
    @classmethod
    def _list_to_map(cls, value: Any) -> Any:
        if isinstance(value, list):
            return {str(m): str(m) for m in value}
        return value

    @field_validator("base_url", "metrics_url")
    @classmethod
    def _strip_slash(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"{info.field_name} must start with http:// or https://")
        return value.rstrip("/")

    @property
    def metrics_endpoint(self) -> str:
        if self.metrics_url is not None:
            return self.metrics_url
        base = self.base_url.removesuffix("/v1")
        return f"{base}/metrics"


class ModelRoute(BaseModel):
    """Per-model routing overrides: which backends in which order, and how to speculate."""

    model_config = ConfigDict(extra="forbid")
    backends: list[str] = Field(default_factory=list)  # empty: every backend serving the model
    spec: SpecParams | None = None


class AffinitySettings(BaseModel):
    """Session and prefix affinity across the replicas of a `replica_group` (routing/affinity.py)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    # Bounded load: a replica takes a conversation while its requests in flight stay within this
    # factor of the group's mean (consistent hashing with bounded loads); above it, the next on
    # the ring does. Lower spreads load more evenly, higher keeps conversations home more often.
    load_factor: float = Field(1.25, gt=1.0, le=100.0)
    # ...but a replica with fewer requests than this in flight always keeps its conversations: at
    # light load the mean is tiny and the bound alone would move them for no gain.
    spill_after: int = Field(8, ge=1, le=1_000_000)
    # Points per replica on the hash ring: more spread keys more evenly across replicas.
    ring_points: int = Field(64, ge=1, le=4096)
    # Without a `user` field, a conversation is known by its leading messages (the system and
    # developer messages and the first user message), and a completion by this many leading
    # characters of its prompt.
    prompt_chars: int = Field(512, ge=16, le=65536)
    # prefix: a request goes to the replica that (by where this gateway sent earlier prompts, checked
    # against the cached_tokens replicas report) holds the longest part of its prompt in its prefix
    # cache, traded against load (routing/prefix_index.py); the least loaded when none holds enough
    # of it (the session key's replica among equals). session: the session key alone (the `user`
    # field or leading messages).
    mode: Literal["prefix", "session"] = "prefix"
    block_chars: int = Field(256, ge=8, le=4096)  # prompt characters per hashed block (~64 tokens)
    # A match shorter than this many blocks counts for nothing: a short preamble every request
    # shares must not pin all traffic to the replica that saw it first.
    min_match_blocks: int = Field(4, ge=1, le=65536)
    # What one request in flight weighs against prefill: a replica with one more request in flight
    # is worth this many uncached prompt tokens. Lower keeps prompts with their cached prefix more;
    # higher spreads them by load more (`specgate bench pools` measures both).
    tokens_per_request: float = Field(256.0, gt=0.0, le=1e7)
    chars_per_token: float = Field(4.0, gt=0.0, le=64.0)  # to turn unmatched characters into tokens
    # Blocks remembered per replica (LRU): about its KV-cache tokens / (block_chars / chars_per_token),
    # divided by `workers` (each worker process keeps its own index of its own traffic). Too large
    # and the index promises blocks the replica has already evicted.
    index_blocks: int = Field(8192, ge=16, le=2**24)
    max_prompt_blocks: int = Field(128, ge=1, le=65536)  # blocks hashed of one prompt (32k chars)


class TelemetrySettings(BaseModel):
    """Where request rows go. `url` None: a SQLite file in the user's data directory."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    url: SecretStr | None = (
        None  # e.g. postgresql+psycopg://user:pass@host/db (a secret: it may hold a password)
    )
    # None: upgrade the embedded default database automatically, never any other.
    auto_upgrade: bool | None = None
    # Directory of spool files (one per process) for rows written while the database is down;
    # default: next to the embedded database, one directory per URL.
    spool_dir: str | None = None
    connect_timeout: float = Field(5.0, gt=0)  # seconds; PostgreSQL
    statement_timeout: float = Field(15.0, gt=0)  # seconds per statement; PostgreSQL
    batch_size: int = Field(256, ge=1)
    flush_interval: float = Field(0.2, gt=0)
    max_queue: int = Field(100_000, ge=1)
    retry_interval: float = Field(1.0, gt=0)
    # Share of speculative requests whose verification steps get rows (spec_steps): the measured
    # step cost by batch size that tells the routing policy where speculation stops paying.
    spec_steps_sample_rate: float = Field(0.05, ge=0.0, le=1.0)


class PolicySettings(BaseModel):
    """The adaptive routing policy. Disabled: the static route (config + the request's `spec`)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    classifier_path: str | None = None  # default: the classifier shipped in the package
    # Speculation methods the policy may choose on the embedded engine (besides "off").
    # Those the engine cannot build (no EAGLE head for the model, no draft model) are skipped.
    methods: list[str] = Field(default_factory=lambda: ["ngram", "suffix", "eagle"])
    # Retrain from telemetry this often, in seconds (0: only when an operator asks).
    retrain_interval: float = Field(0.0, ge=0.0)
    # Telemetry window a retrain reads, in hours.
    train_window_hours: float = Field(168.0, gt=0.0)
    holdout_share: float = Field(0.2, gt=0.0, lt=0.9)
    seed: int | None = None  # exploration randomness; set for reproducible benchmarks
    # How often (seconds) a gateway with a telemetry database asks it which policy version is
    # active, and installs it if another worker or replica changed it (an edit, rollback, retrain).
    sync_interval: float = Field(2.0, gt=0.0)


class ApiKey(BaseModel):
    """An accepted /v1 key and, optionally, limits of its own (else the gateway-wide ones)."""

    model_config = ConfigDict(extra="forbid")
    key: SecretStr
    # Requests of this key in flight at once (streams included); 0: no cap.
    max_in_flight: int | None = Field(None, ge=0, le=1_000_000)
    # Of those, streams open at once (each holds a connection for as long as it runs); 0: no cap.
    max_streams: int | None = Field(None, ge=0, le=1_000_000)
    rate_limit_rpm: int | None = Field(None, ge=0)
    # Latency targets for this key's requests that send none (x-slo-ttft-ms / x-slo-tpot-ms).
    slo_ttft_ms: float | None = Field(None, gt=0, le=1e7)
    slo_tpot_ms: float | None = Field(None, gt=0, le=1e7)

    @field_validator("key")
    @classmethod
    def _sane(cls, value: SecretStr) -> SecretStr:
        raw = value.get_secret_value()
        if not raw or raw != raw.strip() or any(ord(c) < 0x21 or ord(c) == 0x7F for c in raw):
            raise ValueError("an API key must be non-empty printable text without spaces")
        return value


class SloSettings(BaseModel):
    """Latency targets: a request's `x-slo-ttft-ms` / `x-slo-tpot-ms` headers, else its key's
    (ApiKey.slo_*), else these. The learned policy keeps to the arms it predicts will meet them."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(None, gt=0, le=1e7)
    tpot_ms: float | None = Field(None, gt=0, le=1e7)
    # A request no arm is predicted to serve within its targets: 429 with Retry-After (True), or
    # served by the arm with the most headroom (False).
    reject: bool = False


class ConnectionSettings(BaseModel):
    """What one client connection may cost a worker process (gateway/http/connections.py)."""

    model_config = ConfigDict(extra="forbid")
    # Seconds from a connection's first byte (or its opening) to the end of its request head;
    # beyond: 408 and the connection is closed. Keep-alive idling is `keep_alive_timeout`.
    head_timeout: float = Field(10.0, gt=0, le=3600)
    # Seconds a body read may wait for the next bytes, and the whole body may take (408 beyond).
    body_read_timeout: float = Field(15.0, gt=0, le=3600)
    body_timeout: float = Field(60.0, gt=0, le=86400)
    # Open connections per worker process (None: what its file-descriptor limit allows, less a
    # reserve for the process itself) and per client address (trusted proxies are exempt). At a
    # cap, the oldest connection of that scope that is idle or still sending its head is closed
    # for the new one; when every one is busy with a request, the new one is closed instead.
    max_connections: int | None = Field(None, ge=16, le=1_000_000)
    max_per_address: int = Field(512, ge=1, le=1_000_000)


class UISettings(BaseModel):
    """The operator dashboard at /admin/ui (needs `admin_key`; signed in by a session cookie)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    # A session lasts this long, then the operator signs in again (seconds; default 8 hours).
    session_ttl: float = Field(8 * 3600.0, ge=60.0, le=30 * 86400.0)
    # Failed sign-ins per client address before further attempts are refused for `signin_lockout`
    # seconds (every key, the right one included, so a guesser cannot tell when it hit).
    max_failed_signins: int = Field(5, ge=1, le=1000)
    signin_lockout: float = Field(900.0, ge=1.0, le=86400.0)
    # The cookie's Secure flag: "auto" sets it when the request came over HTTPS (directly, or as
    # uvicorn's proxy headers report it), "always" behind a TLS-terminating proxy that does not say.
    secure_cookie: Literal["auto", "always", "never"] = "auto"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECGATE_", env_nested_delimiter="__", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # `specgate serve`: gateway processes sharing the port, one engine core, one /metrics view
    # (gateway/serve/supervisor.py). 1: one process.
    workers: int = Field(1, ge=1, le=64)
    # Accepted /v1 keys: strings, or tables with limits of their own (ApiKey); empty: /v1 is open.
    api_keys: list[ApiKey] = Field(default_factory=list)
    # More keys, one per line ("#" starts a comment): keeps them out of the config and of `ps`.
    api_keys_file: str | None = None
    admin_key: SecretStr | None = None  # None: /admin is closed; at least MIN_ADMIN_KEY_CHARS
    admin_key_file: str | None = None  # the admin key from a file (its first line)
    max_body_bytes: int = Field(4 * 2**20, ge=1024)
    # Seconds an idle client connection stays open. A request a client sends just as the server
    # closes an idle connection is never read (the client sees a reset and should retry), so this
    # should exceed the idle timeout of any proxy or client pool in front (nginx: 75 s).
    keep_alive_timeout: int = Field(75, ge=1)
    # Request rate per API key (per client address in open mode), requests per minute; 0: no limit.
    rate_limit_rpm: int = Field(0, ge=0)
    # Requests in flight, and streams open, per API key (per client address in open mode); 0: no
    # cap. Beyond them: 429 with Retry-After. An ApiKey may set its own.
    max_in_flight_per_key: int = Field(256, ge=0, le=1_000_000)
    max_streams_per_key: int = Field(128, ge=0, le=1_000_000)
    connections: ConnectionSettings = Field(default_factory=ConnectionSettings)
    # The file holding the gateway's secret (the key of the API-key fingerprints in telemetry):
    # made once, mode 0600. Default: `gateway.secret` in the data directory. Replicas that share
    # one database should share this file too, so that one key has one fingerprint.
    secret_file: str | None = None
    # /docs and /openapi.json (the API's own schema); off unless asked for.
    docs: bool = False
    # Refused requests (401 bad key, 413 body too large) per client address and minute; beyond
    # it (bursts of a sixth) the address gets 429 for everything until its budget refills. 0: no limit.
    refused_rpm: int = Field(300, ge=0)
    # Proxies whose X-Forwarded-For is believed (addresses or CIDR networks); none: the peer address.
    trusted_proxies: list[str] = Field(default_factory=list)
    retry_after_seconds: int = Field(1, ge=1)  # Retry-After sent with 503 when overloaded
    embedded: EmbeddedSettings = Field(default_factory=EmbeddedSettings)
    backends: list[BackendSettings] = Field(default_factory=list)
    routes: dict[str, ModelRoute] = Field(default_factory=dict)
    affinity: AffinitySettings = Field(default_factory=AffinitySettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    policy: PolicySettings = Field(default_factory=PolicySettings)
    slo: SloSettings = Field(default_factory=SloSettings)
    ui: UISettings = Field(default_factory=UISettings)
    log_requests: bool = True

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment variables override the config file, which arrives as init arguments.
        return env_settings, init_settings

    @field_validator("api_keys", mode="before")
    @classmethod
    def _key_strings(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"key": v} if isinstance(v, (str, SecretStr)) else v for v in value]
        return value

    @model_validator(mode="after")
    def _key_files(self) -> Settings:
        if self.api_keys_file:
            known = {k.key.get_secret_value() for k in self.api_keys}
            for key in read_key_file(self.api_keys_file):
                if key not in known:
                    known.add(key)
                    self.api_keys.append(ApiKey(key=SecretStr(key)))
            self.api_keys_file = None  # read: a copy of these settings must not add them twice
        if self.admin_key_file:
            keys = read_key_file(self.admin_key_file)
            if len(keys) != 1:
                raise ValueError(f"admin_key_file {self.admin_key_file} must hold exactly one key")
            self.admin_key, self.admin_key_file = SecretStr(keys[0]), None
        if self.admin_key is not None and len(self.admin_key.get_secret_value()) < MIN_ADMIN_KEY_CHARS:
            raise ValueError(
                f"admin_key must be at least {MIN_ADMIN_KEY_CHARS} characters (a short one can be "
                "guessed); e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return self

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        import ipaddress

        for entry in value:
            ipaddress.ip_network(entry.strip(), strict=False)  # ValueError names the bad entry
        return value

    @model_validator(mode="after")
    def _unique_backends(self) -> Settings:
        names = [b.name for b in self.backends] + ([self.embedded.name] if self.embedded.enabled else [])
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"backend names must be unique; repeated: {', '.join(sorted(dupes))}")
        groups = {b.replica_group for b in self.backends if b.replica_group is not None}
        clash = groups & set(names)
        if clash:
            raise ValueError(
                "a replica_group is a routing arm and may not share a backend's name: "
                + ", ".join(sorted(clash))
            )
        for model, route in self.routes.items():
            unknown = set(route.backends) - set(names)
            if unknown:
                raise ValueError(f"route for {model!r} names unknown backends: {', '.join(sorted(unknown))}")
        return self

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any) -> Settings:
        data = read_config_file(config_file) if config_file else {}
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)


def read_key_file(path: str | Path) -> list[str]:
    """The keys of a key file: one per line; blank lines and "#" comments are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the key file {path}: {exc}") from None
    keys = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return [k for k in keys if k]


def read_chat_template_file(path: str | Path) -> str:
    """A chat template file's Jinja text (`--chat-template-file`, `embedded.chat_template_file`)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"embedded.chat_template_file (--chat-template-file): cannot read {path}: {exc}"
        ) from None
    if "{%" not in text and "{{" not in text:  # what tells Jinja from a built-in's name
        raise ValueError(
            f"embedded.chat_template_file (--chat-template-file): {path} holds no Jinja template "
            "(no {% or {{)"
        )
    return text


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".toml":
        data: Any = tomllib.loads(text)
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.suffix == ".json":
        data = json.loads(text)
    else:
        raise ValueError(f"config file {path} must be .toml, .yaml, .yml or .json")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping at the top level")
    return data


def default_cache_dir() -> str:
    """Where converted model checkpoints are kept: $SPECGATE_CACHE_DIR, else the user cache."""
    from platformdirs import user_cache_dir

    return os.environ.get("SPECGATE_CACHE_DIR") or str(Path(user_cache_dir("specgate")) / "models")
