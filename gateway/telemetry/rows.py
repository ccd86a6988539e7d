"""A finished request's record as rows: plain JSON values, so the same entry goes to SQL, to the
spool, or over the relay to the supervisor's writer.

An entry is `{"r": request row, "s": [step rows]}` ("s" only when the request's verification steps
were sampled): the one form a record takes once it leaves the process that served it.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from typing import Any

import orjson

from specgate.gateway.telemetry.records import RequestRecord

Entry = dict[str, Any]
_ENCODE = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS

TIME_COLUMNS = ("arrival_time", "first_token_time", "finished_time")


def request_row(rec: RequestRecord) -> dict[str, Any]:
    route = rec.route.as_dict() if rec.route is not None else {}
    spec_route = route.get("spec") or {}
    spec = rec.spec_decoding or {}
    load = rec.load.engine if rec.load is not None else None
    in_flight = rec.load.backends.get(rec.backend) if rec.load is not None and rec.backend else None
    affinity = route.get("affinity") or {}
    slo = route.get("slo") or {}
    # The batch the serving backend's arm joined: an external one's, or the engine's.
    batch = rec.load.batch_of(rec.backend) if rec.load is not None and rec.backend else None
    return {
        "request_id": rec.request_id,
        "client_request_id": rec.client_request_id,
        "api_key_id": rec.api_key_id,
        "endpoint": rec.endpoint,
        "model": rec.model,
        "stream": rec.stream,
        "arrival_time": rec.arrival_time,
        "first_token_time": rec.first_token_time,
        "finished_time": rec.finished_time,
        "status": rec.status,
        "outcome": rec.outcome,
        "cancelled": rec.cancelled,
        "finish_reason": rec.finish_reason,
        "error_code": rec.error_code,
        "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens,
        "cached_tokens": rec.cached_tokens,
        "queue_time_ms": rec.queue_time_ms,
        "ttft_ms": rec.ttft_ms,
        "tpot_ms": rec.tpot_ms,
        "e2e_ms": rec.e2e_ms,
        "tokens_per_s": rec.tokens_per_s,
        "overhead_ms": rec.overhead_ms,
        "attempts": rec.attempts,
        "backend": rec.backend,
        # The method the request ran with (an external backend may report its own), else the route's.
        "spec_method": spec.get("method") or spec_route.get("method"),
        "spec_controller": spec_route.get("controller"),
        "k_min": spec_route.get("k_min"),
        "k_max": spec_route.get("k_max"),
        "policy": route.get("policy"),
        "policy_version": route.get("policy_version"),
        "decision_reason": route.get("reason"),
        "route": route or None,
        "workload_class": rec.workload_class,
        "class_confidence": rec.class_confidence,
        "features": rec.features or None,
        "load_queue_depth": load.num_waiting if load is not None else None,
        "load_running": load.num_running if load is not None else None,
        "load_kv_usage": round(load.kv_cache_usage, 4) if load is not None else None,
        "load_backend_in_flight": in_flight.in_flight if in_flight is not None else None,
        "num_drafts": spec.get("num_drafts"),
        "num_draft_tokens": spec.get("num_draft_tokens"),
        "num_accepted_tokens": spec.get("num_accepted_tokens"),
        "mean_acceptance_length": spec.get("mean_acceptance_length"),
        "draft_acceptance_rate": spec.get("draft_acceptance_rate"),
        "num_accepted_tokens_per_pos": spec.get("num_accepted_tokens_per_pos"),
        "num_tree_drafts": spec.get("num_tree_drafts"),
        "mean_draft_nodes": spec.get("mean_draft_nodes"),
        "grammar": rec.grammar,
        "num_forced_draft_tokens": spec.get("num_forced_draft_tokens"),
        "slo_ttft_ms": slo.get("ttft_ms"),
        "slo_tpot_ms": slo.get("tpot_ms"),
        "slo_met": rec.slo_met,
        "load_backend_batch": batch,
        "prefix_matched_blocks": affinity.get("matched_blocks"),
        "propensity": route.get("propensity"),
        "affinity_group": affinity.get("group"),
        "affinity_source": affinity.get("source"),
        "affinity_hit": affinity.get("hit"),
        "upstream": rec.upstream or None,
    }


def step_rows(rec: RequestRecord) -> list[dict[str, Any]]:
    return [
        {
            "request_id": rec.request_id,
            "step_index": i,
            "k_proposed": step.drafted,
            "accepted": step.accepted,
            "batch_tokens": step.batch_tokens,
            "step_ms": step.step_ms,
            "depth": step.depth,
        }
        for i, step in enumerate(rec.spec_steps)
    ]


def entry_of(rec: RequestRecord, step_sample_rate: float = 0.0, rng: random.Random | None = None) -> Entry:
    """The record's rows; its steps with probability `step_sample_rate`."""
    out: Entry = {"r": request_row(rec)}
    if rec.spec_steps and step_sample_rate and (rng or random).random() < step_sample_rate:
        out["s"] = step_rows(rec)
    return out


def encode_entry(value: Entry) -> bytes:
    """Compact JSON on one line, whatever the row holds: a row is never lost to a value. Numpy
    scalars (a classifier's probabilities in `features`) become numbers, other types their text.
    What orjson refuses (an upstream's integers past 64 bits or lone surrogates, kept as parsed in
    `upstream`) goes through the standard library, ASCII-escaped; a structure nested too deep for
    either keeps its row, with that one value replaced by a note (the writer fits the rest)."""
    try:
        return orjson.dumps(value, default=str, option=_ENCODE)
    except TypeError:
        pass
    try:
        return _stdlib_encode(value)
    except RecursionError:
        row = {
            k: _UNENCODABLE if isinstance(v, dict | list | tuple) and _too_deep(v) else v
            for k, v in value["r"].items()
        }
        return _stdlib_encode({**value, "r": row})


_UNENCODABLE = {"unencodable": "nested too deep to encode"}


def _stdlib_encode(value: Any) -> bytes:
    return json.dumps(value, default=str, ensure_ascii=True, separators=(",", ":")).encode()


def _too_deep(value: Any) -> bool:
    try:
        _stdlib_encode(value)
    except RecursionError:
        return True
    return False


def decode_entry(data: bytes) -> Entry:
    """An entry as `encode_entry` wrote it; ValueError for anything that is not one."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:  # NaN or an integer past 64 bits, written by the standard library
        value = json.loads(data)
    if not isinstance(value, dict) or not isinstance(value.get("r"), dict):
        raise ValueError("an entry is an object with a request row under 'r'")
    if not isinstance(value["r"].get("request_id"), str):
        raise ValueError("a request row needs a string request_id")
    steps = value.get("s")
    if steps is not None and not (isinstance(steps, list) and all(isinstance(r, dict) for r in steps)):
        raise ValueError("'s' holds a list of step rows")
    return value


# Rows spooled by earlier versions name some columns as they were before revisions 0004 and 0009.
LEGACY_COLUMNS = {
    "num_spec_steps": "num_drafts",
    "num_accepted_draft_tokens": "num_accepted_tokens",
    "acceptance_histogram": "num_accepted_tokens_per_pos",
    "received_at": "arrival_time",
    "first_token_at": "first_token_time",
    "finished_at": "finished_time",
    "queue_ms": "queue_time_ms",
}


def upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """A spooled row under today's column names."""
    if not any(old in row for old in LEGACY_COLUMNS):
        return row
    return {LEGACY_COLUMNS.get(k, k): v for k, v in row.items()}


def to_sql(row: dict[str, Any]) -> dict[str, Any]:
    """Unix-second timestamps to timezone-aware datetimes."""
    out = dict(row)
    for col in TIME_COLUMNS:
        if out.get(col) is not None:
            out[col] = dt.datetime.fromtimestamp(out[col], tz=dt.UTC)
    return out
