"""Structured outputs served end to end: constrained decoding (JSON schemas, function calls) beside
unconstrained decoding, with and without forced-token drafts and speculation, and beside llama.cpp's
server on the same GGUF, side by side in one run.

    .venv/bin/python bench/bench_structured.py --peer llama-cpp                    # default model, 40 x 128
    .venv/bin/python bench/bench_structured.py --peer llama-cpp --model qwen2.5-coder-1.5b \\
        --prompts 12 --max-tokens 96
    .venv/bin/python bench/bench_structured.py --arms free,json,json-ngram --prompts 6   # a subset
    .venv/bin/python bench/bench_structured.py --peer llama-server --arms json,server-json \\
        --sources simple,multiple --prompts 8 --max-tokens 160 --as-sent   # validity vs llama-server

Workload: BFCL function-calling prompts (bench/data/bfcl: simple_python and multiple) whose answer is
forced to be a call `{"name": ..., "arguments": {...}}` of the offered function (of one of them, for
`multiple`, which ships no expected answer), plus six schemas written here (a product record, an
address, a todo list with enums, a nested config, a sentiment label with a confidence, a date-time
event). BFCL's parameter types that are not JSON Schema are converted (dict -> object, float ->
number, tuple -> array, any -> {}), objects with properties are closed (`additionalProperties:
false`, as OpenAI's strict mode and llama.cpp's converter read them), and keys llguidance refuses are
dropped; the run reports how many. The prompt shows the functions (or the schema) to every arm.

Arms, each on the same prompts, greedy, batch 1 (one request at a time), `max_tokens` fixed:
`free` (unconstrained, no speculation); `json-open` (constrained, objects read as plain JSON
Schema: unlisted properties allowed); `json-noforce` (constrained, forced drafts off: a second
specgate server with `embedded.forced_drafts = false`); `json` (constrained, forced drafts on, the
default); `json-ngram`, `json-suffix` (constrained + speculation); `free-ngram`, `free-suffix`;
with `--peer llama-cpp`, `llama-json` (llama-cpp-python's server, the same schema as its
`response_format`, which it converts to a GBNF grammar) and `llama-free`; with `--peer llama-server`,
`server-json` (llama.cpp's own C++ server, `-t 2 -np 1`, sent the same `json_schema` body as
specgate). `--as-sent` leaves BFCL's objects as they are (not closed), so each server's own reading
of a schema decides whether unlisted properties may be generated; answers are still validated
against the closed form (what a strict caller means). Every server is up for the
whole run (an idle one takes no CPU) so that each prompt goes through every arm back to back, in an
order rotated per prompt: machine noise hits all arms alike. Streaming over HTTP (httpx); TTFT is
the first content chunk; decode tokens/s is (tokens - 1) / (end - first chunk), end to end is tokens
/ (end - send); ms/step and tokens/step count specgate's decode steps (its steps less its prefill
chunks); accepted length is speculation's tokens per verification step (forced tokens included);
ratios between arms are paired by prompt. Every specgate arm has a prefix cache of its own per
repetition (`cache_salt`), so no prompt finds another arm's blocks, and llama.cpp's own prompt reuse
is defeated by a one-token request before each of its requests. The suffix proposer shares no cache
of earlier outputs (`embedded.draft_cache_scope = off`): every arm gives the same greedy answers,
which it would otherwise draft from the arm before.

Validity: the answer parses as JSON and validates against the schema (jsonschema_rs, formats
checked); `lenient` also accepts JSON inside a code fence or prose. Constrained arms should reach
100% but for answers cut at max_tokens (reported apart). Constrained outputs of the specgate arms
must be equal (forced drafts and speculation are lossless under greedy decoding): reported per arm.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs

from specgate.engine.grammar import Grammar, check

DATA = Path(__file__).resolve().parent / "data"
BFCL_FILES = {"simple": "BFCL_v4_simple_python.json", "multiple": "BFCL_v4_multiple.json"}
OWN = "own"
SOURCES = (OWN, "simple", "multiple")

# BFCL's parameter types that JSON Schema spells otherwise; None: any value (the key is dropped).
BFCL_TYPES: dict[str, str | None] = {"dict": "object", "float": "number", "tuple": "array", "any": None}
# Keys whose values are schemas (or lists / maps of schemas) that the conversion walks into.
_SCHEMA_KEYS = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


# ---- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    """One prompt and the JSON schema its answer must match."""

    case_id: str
    source: str  # "own", "simple" or "multiple"
    messages: list[dict[str, str]]
    schema: dict[str, Any]  # what an answer is validated against
    sent: dict[str, Any] | None = None  # what the servers are sent, where it differs (--as-sent)

    @property
    def request_schema(self) -> dict[str, Any]:
        return self.schema if self.sent is None else self.sent


def convert_bfcl(schema: Any, counts: Counter[str], close: bool = True) -> Any:
    """A BFCL parameter schema as JSON Schema: its types converted, every object with properties
    closed (unless `close` is false); what changed is counted in `counts`."""
    if isinstance(schema, list):
        return [convert_bfcl(s, counts, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str) and value in BFCL_TYPES:
            counts[f"type {value} -> {BFCL_TYPES[value] or '{}'}"] += 1
            if BFCL_TYPES[value] is not None:
                out[key] = BFCL_TYPES[value]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: convert_bfcl(v, counts, close) for k, v in value.items()}
        elif key in _SCHEMA_LISTS or key in _SCHEMA_KEYS:
            out[key] = convert_bfcl(value, counts, close)
        else:
            out[key] = value
    if close and isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
        counts["object closed (additionalProperties: false)"] += 1
    return out


def _drop(schema: Any, keys: set[str], formats: set[str], dropped: Counter[str]) -> Any:
    """`schema` without the keywords `keys` and the formats `formats`, wherever they are (a property
    that happens to be named like a keyword stays)."""
    if isinstance(schema, list):
        return [_drop(s, keys, formats, dropped) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in keys or (key == "format" and value in formats):
            dropped[f"{key}: {value}" if key == "format" else key] += 1
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _drop(v, keys, formats, dropped) for k, v in value.items()}
        elif key in _SCHEMA_LISTS or key in _SCHEMA_KEYS:
            out[key] = _drop(value, keys, formats, dropped)
        else:
            out[key] = value
    return out


def enforceable(schema: dict[str, Any], dropped: Counter[str]) -> dict[str, Any] | None:
    """`schema` with the keywords and formats llguidance refuses dropped (counted in `dropped`), or
    None when it still refuses it for another reason."""
    for _ in range(16):
        problem = check(Grammar.json_schema(schema))
        if problem is None:
            return schema
        keys: set[str] = set()
        formats: set[str] = set()
        unimplemented = re.search(r"Unimplemented keys: (\[[^\]]*\])", problem)
        unknown_format = re.search(r"Unknown format: (\S+)", problem)
        if unimplemented:
            keys = set(json.loads(unimplemented.group(1)))
        elif unknown_format:
            formats = {unknown_format.group(1).strip("'\".,;")}
        else:
            return None
        schema = _drop(schema, keys, formats, dropped)
    return None


def call_schema(functions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A call of one of `functions` (parameters already JSON Schema): {"name", "arguments"}."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": fn["name"]},
                "arguments": fn.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for fn in functions
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _spread(items: Sequence[Any], n: int) -> list[Any]:
    """n items spread evenly over `items` (the first one included)."""
    n = min(n, len(items))
    return [items[i * len(items) // n] for i in range(n)] if n else []


def _split(n: int) -> tuple[int, int, int]:
    """How many own / simple / multiple prompts make n: up to six own (a third), the rest BFCL."""
    own = min(len(OWN_CASES), n // 3)
    simple = (n - own + 1) // 2
    return own, simple, n - own - simple


def bfcl_cases(
    source: str,
    n: int,
    counts: Counter[str],
    dropped: Counter[str],
    directory: Path = DATA / "bfcl",
    as_sent: bool = False,
) -> tuple[list[Case], int]:
    """n BFCL prompts of one file (spread over it) whose answer must call its function (one of its
    functions), and how many of the chosen ones were skipped (a schema llguidance refuses)."""
    rows = [json.loads(line) for line in (directory / BFCL_FILES[source]).read_text().splitlines() if line]
    out: list[Case] = []
    skipped = 0
    for row in _spread(rows, n):
        functions = []
        raw = []
        for fn in row["function"]:
            params = convert_bfcl(fn.get("parameters") or {"type": "object"}, counts)
            functions.append(
                {"name": fn["name"], "description": fn.get("description", ""), "parameters": params}
            )
            unclosed = convert_bfcl(fn.get("parameters") or {"type": "object"}, Counter(), close=False)
            raw.append({**functions[-1], "parameters": unclosed})
        schema = enforceable(call_schema(functions), dropped)
        sent = enforceable(call_schema(raw), Counter()) if as_sent else None
        if schema is None or (as_sent and sent is None):
            skipped += 1
            continue
        catalogue = "\n".join(json.dumps(fn) for fn in functions)
        system = (
            "You are a function-calling assistant. These are the functions you can call, with their "
            f"parameters as JSON Schema:\n{catalogue}\n"
            'Answer with one JSON object and nothing else: {"name": <the function\'s name>, '
            '"arguments": {<parameter>: <value>, ...}}.'
        )
        turns = [m for m in row["question"][0] if m.get("role") in ("user", "assistant")]
        out.append(Case(row["id"], source, [{"role": "system", "content": system}, *turns], schema, sent))
    return out, skipped


def _closed(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
        **extra,
    }


_TEXT = {"type": "string", "maxLength": 80}
# (id, task, schema): six records of the kinds structured-output APIs are used for.
OWN_CASES: list[tuple[str, str, dict[str, Any]]] = [
    (
        "product",
        "Make a catalogue record for this item: a red merino wool scarf, 180 cm long, sold for 34.50 "
        "euros; 12 are in the warehouse. Its SKU is SCF-0042.",
        _closed(
            {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "name": _TEXT,
                "price": {"type": "number", "minimum": 0},
                "currency": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
                "in_stock": {"type": "boolean"},
                "quantity": {"type": "integer", "minimum": 0},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
            }
        ),
    ),
    (
        "address",
        "Extract the postal address from this message: 'Please ship it to Ana Lima, 1200 Harbor "
        "Boulevard, Apartment 5, Oakland, California 94607, United States. Thanks!'",
        _closed(
            {
                "recipient": _TEXT,
                "street": _TEXT,
                "unit": _TEXT,
                "city": _TEXT,
                "region": _TEXT,
                "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
            }
        ),
    ),
    (
        "todos",
        "Turn these notes into a todo list: book the flights to Lisbon (urgent, not started), renew "
        "the passport (medium priority, already in progress), buy a travel adapter (low priority, done).",
        _closed(
            {
                "todos": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": _closed(
                        {
                            "title": _TEXT,
                            "priority": {"enum": ["low", "medium", "high"]},
                            "status": {"enum": ["todo", "in_progress", "done"]},
                        }
                    ),
                }
            }
        ),
    ),
    (
        "config",
        "Write the service's configuration: the API server listens on 0.0.0.0 port 8080 with 4 "
        "workers; the database is postgres://db.internal:5432/shop with a pool of 10 connections; "
        "logs are at info level, as JSON; the features search and recommendations are enabled.",
        _closed(
            {
                "server": _closed(
                    {
                        "host": _TEXT,
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "workers": {"type": "integer", "minimum": 1, "maximum": 64},
                    }
                ),
                "database": _closed(
                    {"url": _TEXT, "pool_size": {"type": "integer", "minimum": 1, "maximum": 100}}
                ),
                "logging": _closed(
                    {"level": {"enum": ["debug", "info", "warning", "error"]}, "json": {"type": "boolean"}}
                ),
                "features": {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 8},
            }
        ),
    ),
    (
        "sentiment",
        "Classify the sentiment of this review: 'The battery lasts two days and the screen is "
        "gorgeous, but the charger broke within a week.'",
        _closed(
            {
                "label": {"enum": ["positive", "negative", "neutral", "mixed"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    (
        "event",
        "Put this in the calendar: the quarterly planning meeting on 14 March 2025 from 09:30 to "
        "11:00 UTC in room 4B, with Priya (priya@example.com) and Tom (tom@example.com).",
        _closed(
            {
                "title": _TEXT,
                "start": {"type": "string", "format": "date-time"},
                "end": {"type": "string", "format": "date-time"},
                "location": _TEXT,
                "attendees": {
                    "type": "array",
                    "maxItems": 6,
                    "items": _closed({"name": _TEXT, "email": {"type": "string", "format": "email"}}),
                },
            }
        ),
    ),
]


def own_cases(n: int, dropped: Counter[str]) -> list[Case]:
    out = []
    for case_id, task, schema in OWN_CASES[:n]:
        checked = enforceable(schema, dropped)
        if checked is None:
            raise ValueError(f"llguidance refuses the schema of {case_id}")
        system = (
            "Answer with one JSON object that matches this JSON Schema, and nothing else:\n"
            + json.dumps(checked)
        )
        out.append(
            Case(
                case_id,
                OWN,
                [{"role": "system", "content": system}, {"role": "user", "content": task}],
                checked,
            )
        )
    return out


@dataclass(slots=True)
class Workload:
    cases: list[Case]
    conversions: Counter[str] = field(default_factory=Counter)  # BFCL keys converted
    dropped: Counter[str] = field(default_factory=Counter)  # keys llguidance refuses, dropped
    skipped: int = 0  # chosen BFCL prompts whose schema could not be made enforceable


def workload(
    n: int, directory: Path = DATA / "bfcl", sources: Sequence[str] = SOURCES, as_sent: bool = False
) -> Workload:
    """n prompts: up to six of our own schemas (a third), the rest BFCL, simple and multiple alike;
    only the sources named (the others' share goes to the rest)."""
    own, simple, multiple = _split(n) if OWN in sources else (0, (n + 1) // 2, n // 2)
    if "simple" not in sources:
        simple, multiple = 0, multiple + simple
    if "multiple" not in sources:
        simple, multiple = simple + multiple, 0
    if "simple" not in sources and "multiple" not in sources:
        own = min(len(OWN_CASES), n)
    w = Workload([])
    w.cases += own_cases(own, w.dropped)
    for source, k in (("simple", simple), ("multiple", multiple)):
        cases, skipped = bfcl_cases(source, k, w.conversions, w.dropped, directory, as_sent)
        w.cases += cases
        w.skipped += skipped
    return w


# ---- validity -----------------------------------------------------------------------------------


def _json_candidates(text: str) -> Iterator[str]:
    """Where a lenient reader finds JSON in an answer: a code fence's body, the outermost braces."""
    for m in re.finditer(r"```(?:json)?\s*\n?(.*?)```", text, re.DOTALL):
        yield m.group(1)
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        yield text[start : end + 1]


def validity(text: str, schema: Mapping[str, Any]) -> tuple[str, bool, str]:
    """(status, valid leniently, first error): status is "valid" (the whole answer is JSON that
    validates), "invalid" (JSON that does not) or "unparsed" (not JSON)."""
    validator = jsonschema_rs.validator_for(dict(schema), validate_formats=True)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        status, error = "unparsed", f"not JSON: {exc}"
    else:
        errors = list(validator.iter_errors(value))
        if not errors:
            return "valid", True, ""
        status, error = "invalid", f"{errors[0].message} at {list(errors[0].instance_path)}"
    for candidate in _json_candidates(text):
        try:
            if validator.is_valid(json.loads(candidate)):
                return status, True, error
        except json.JSONDecodeError:
            continue
    return status, False, error


# ---- arms and servers ---------------------------------------------------------------------------

SPECGATE, SPECGATE_NOFORCE, LLAMA = "specgate", "specgate (forced drafts off)", "llama.cpp"
LLAMA_SERVER = "llama-server"  # llama.cpp's own C++ server
PEERS = (LLAMA, LLAMA_SERVER)
DEFAULT_LLAMA_BIN = Path("~/.cache/specgate/llama-cpp-11434/build/bin/llama-server")


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    server: str
    constrained: bool
    spec: str | None = None  # specgate's speculation method ("off": none); None for llama.cpp
    # specgate: plain JSON Schema (unlisted properties allowed where a schema does not say), its
    # reading before C2, through structured_outputs.disable_additional_properties false.
    open_objects: bool = False


ARMS = {
    a.name: a
    for a in (
        Arm("free", SPECGATE, False, "off"),
        Arm("json-noforce", SPECGATE_NOFORCE, True, "off"),
        Arm("json", SPECGATE, True, "off"),
        Arm("json-open", SPECGATE, True, "off", open_objects=True),
        Arm("json-ngram", SPECGATE, True, "ngram"),
        Arm("json-suffix", SPECGATE, True, "suffix"),
        Arm("free-ngram", SPECGATE, False, "ngram"),
        Arm("free-suffix", SPECGATE, False, "suffix"),
        Arm("llama-json", LLAMA, True),
        Arm("llama-free", LLAMA, False),
        Arm("server-json", LLAMA_SERVER, True),
    )
}
# Whose output an arm's must equal (greedy, lossless drafting) or, for llama.cpp, be compared with.
REFERENCE = {
    "json": "json-noforce",
    "json-ngram": "json-noforce",
    "json-suffix": "json-noforce",
    "json-open": "json",
    "free-ngram": "free",
    "free-suffix": "free",
    "llama-json": "json",
    "llama-free": "free",
    "server-json": "json",
}
# (label, arm, over arm, goal): paired by prompt, geometric mean of the per-request ratios of decode
# tokens/s (and end to end); STEP_RATIOS compare the mean time of a decode step instead.
RATIOS: list[tuple[str, str, str, float | None]] = [
    ("constrained / unconstrained, plain", "json", "free", 0.90),
    ("constrained (forced off) / unconstrained", "json-noforce", "free", None),
    ("forced drafts on / off", "json", "json-noforce", None),
    ("json+ngram / llama.cpp json", "json-ngram", "llama-json", 1.5),
    ("json+suffix / llama.cpp json", "json-suffix", "llama-json", 1.5),
    ("json (plain) / llama.cpp json", "json", "llama-json", None),
    ("json (plain) / llama-server json", "json", "server-json", None),
    ("free / llama.cpp free", "free", "llama-free", None),
    ("llama.cpp json / llama.cpp free", "llama-json", "llama-free", None),
    ("json+ngram / json", "json-ngram", "json", None),
    ("json+suffix / json", "json-suffix", "json", None),
    ("free+ngram / free", "free-ngram", "free", None),
    ("free+suffix / free", "free-suffix", "free", None),
]
STEP_RATIOS: list[tuple[str, str, str]] = [
    ("constrained (forced off) / unconstrained: the mask's cost per step", "json-noforce", "free"),
    ("constrained (forced on) / unconstrained", "json", "free"),
    ("forced drafts on / off", "json", "json-noforce"),
]


@dataclass(frozen=True, slots=True)
class Server:
    name: str
    url: str
    model: str
    max_num_batched_tokens: int = 512  # specgate's prefill chunk (to count its prefill steps)


def request_body(
    server: Server,
    arm: Arm,
    case: Case,
    max_tokens: int,
    salt: str | None,
    messages: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": server.model,
        "messages": messages if messages is not None else case.messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    if server.name == LLAMA_SERVER:
        # The same OpenAI json_schema body as specgate's; llama-server's own sampler chain is greedy
        # at temperature 0, and it reuses no prompt across requests (cache_prompt false).
        body["stream_options"] = {"include_usage": True}
        body["cache_prompt"] = False
        if arm.constrained:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": case.request_schema, "strict": True},
            }
        return body
    if server.name == LLAMA:
        # llama-cpp-python's sampling defaults that differ from OpenAI's, off; its response_format is
        # {"type": "json_object", "schema": ...} (it ignores OpenAI's json_schema form).
        body.update(repeat_penalty=1.0, top_k=0, min_p=0.0)
        if arm.constrained:
            body["response_format"] = {"type": "json_object", "schema": case.request_schema}
        return body
    body["stream_options"] = {"include_usage": True}
    body["spec"] = {"method": arm.spec or "off"}
    if salt is not None:
        body["cache_salt"] = salt
    if arm.constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": case.request_schema, "strict": True},
        }
        if arm.open_objects:
            body["structured_outputs"] = {"disable_additional_properties": False}
    return body


@dataclass(slots=True)
class Result:
    arm: str
    case_id: str
    source: str
    rep: int
    ok: bool = False
    error: str | None = None
    text: str = ""
    finish: str | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    num_steps: int | None = None
    decode_steps: int | None = None  # specgate: steps after the one that emitted the first token
    forced: int = 0  # drafted tokens the grammar forced
    spec: dict[str, Any] = field(default_factory=dict)  # metrics.spec_decoding
    status: str = ""  # validity: valid / invalid / unparsed
    lenient: bool = False
    invalid_reason: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.done is None else self.done - self.sent

    @property
    def decode_tps(self) -> float | None:
        """Output tokens after the first, per second after the first content chunk."""
        if self.first is None or self.done is None or self.output_tokens < 2 or self.done <= self.first:
            return None
        return (self.output_tokens - 1) / (self.done - self.first)

    @property
    def step_ms(self) -> float | None:
        """specgate: mean time of a decode step (a forward pass and what surrounds it)."""
        if self.first is None or self.done is None or not self.decode_steps:
            return None
        return (self.done - self.first) * 1e3 / self.decode_steps

    @property
    def e2e_tps(self) -> float | None:
        e2e = self.e2e
        return self.output_tokens / e2e if e2e and self.output_tokens else None


def _headers(server: Server) -> dict[str, str] | None:
    # llama-server drops a kept-alive connection after a streamed answer; the next request on it
    # would fail without a response.
    return {"connection": "close"} if server.name == LLAMA_SERVER else None


def send(
    client: httpx.Client,
    server: Server,
    arm: Arm,
    case: Case,
    max_tokens: int,
    rep: int = 0,
    salt: str | None = None,
) -> Result:
    """One streamed request, timed; the answer checked against the case's schema."""
    res = Result(arm.name, case.case_id, case.source, rep)
    body = request_body(server, arm, case, max_tokens, salt)
    chunks = 0
    usage = False
    parts: list[str] = []
    res.sent = time.perf_counter()
    try:
        url = f"{server.url}/v1/chat/completions"
        with client.stream("POST", url, json=body, headers=_headers(server)) as response:
            if response.status_code != 200:
                res.error = f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}"
                return res
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    content = (choice.get("delta") or {}).get("content")
                    if content is not None:
                        chunks += 1
                        if content and res.first is None:
                            res.first = now
                        parts.append(content)
                    res.finish = choice.get("finish_reason") or res.finish
                if chunk.get("usage"):
                    usage = True
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
                metrics = chunk.get("metrics")
                if isinstance(metrics, dict):
                    res.num_steps = metrics.get("num_steps")
                    res.spec = metrics.get("spec_decoding") or {}
                    res.forced = res.spec.get("num_forced_draft_tokens") or 0
        res.done = time.perf_counter()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if not usage:  # llama-cpp-python streams one token per chunk and no usage
        res.output_tokens = max_tokens if res.finish == "length" else chunks
    res.text = "".join(parts)
    if res.num_steps is not None:  # less the prefill chunks, the last of which emits the first token
        uncached = max(0, res.prompt_tokens - res.cached_tokens)
        res.decode_steps = res.num_steps - max(1, math.ceil(uncached / server.max_num_batched_tokens))
    res.ok = True
    res.status, res.lenient, res.invalid_reason = validity(res.text, case.schema)
    return res


# ---- servers --------------------------------------------------------------------------------------


def specgate_command(port: int, model: str | None, data_dir: Path, forced_drafts: bool) -> list[str]:
    env = [
        f"SPECGATE_DATA_DIR={data_dir}",
        # No shared cache of earlier outputs: the suffix arms must not draft an answer another arm
        # (or an earlier repetition) already gave for the same prompt.
        "SPECGATE_EMBEDDED__DRAFT_CACHE_SCOPE=off",
        f"SPECGATE_EMBEDDED__FORCED_DRAFTS={'true' if forced_drafts else 'false'}",
    ]
    cmd = ["env", *env, sys.executable, "-m", "specgate.gateway.cli.main", "serve", "--port", str(port)]
    return cmd + (["--model", model] if model else [])


@contextlib.contextmanager
def servers(
    names: set[str],
    model: str | None,
    out: Path,
    threads: int,
    log: Callable[[str], None],
    llama_bin: Path = DEFAULT_LLAMA_BIN,
) -> Iterator[dict[str, Server]]:
    """The servers the arms need, started one after the other (each ready before the next starts)
    and all stopped on every way out (bench/serve/peer_server.py's `running`)."""
    from specgate.bench.serve import peer_server
    from specgate.gateway.settings import EmbeddedSettings

    chunk = EmbeddedSettings().max_num_batched_tokens
    started: dict[str, Server] = {}
    with contextlib.ExitStack() as stack:
        for name in (SPECGATE, SPECGATE_NOFORCE, LLAMA, LLAMA_SERVER):
            if name not in names:
                continue
            port = peer_server.free_port()
            url = f"http://127.0.0.1:{port}"
            t0 = time.monotonic()
            if name == LLAMA_SERVER:
                gguf = peer_server.gguf_path(model)
                cmd = [str(llama_bin.expanduser()), "-m", str(gguf), "-t", str(threads), "-np", "1"]
                cmd += ["--host", "127.0.0.1", "--port", str(port), "--alias", gguf.stem]
                stack.enter_context(peer_server.running(cmd, out / "llama-server.log", f"{url}/health"))
                started[name] = Server(name, url, gguf.stem)
            elif name == LLAMA:
                gguf = peer_server.gguf_path(model)
                cmd = peer_server.command(gguf, port, threads, gguf.stem)
                stack.enter_context(peer_server.running(cmd, out / "llama-cpp.log", f"{url}/v1/models"))
                started[name] = Server(name, url, gguf.stem)
            else:
                slug = "specgate" if name == SPECGATE else "specgate-noforce"
                cmd = specgate_command(port, model, out / f"{slug}-data", forced_drafts=name == SPECGATE)
                stack.enter_context(
                    peer_server.running(cmd, out / f"{slug}.log", f"{url}/readyz", timeout=900)
                )
                served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
                started[name] = Server(name, url, served, chunk)
            log(f"{name} ready in {time.monotonic() - t0:.1f} s at {url}")
        yield started


def warm_up(client: httpx.Client, server: Server, cases: Sequence[Case], max_tokens: int) -> None:
    """Untimed: one free and one constrained answer per server (thread pools, llguidance's tokenizer),
    and on specgate every schema compiled once (its grammar cache), so no measured request pays it."""
    probe = cases[0]
    for arm in (Arm("warm", server.name, False, "off"), Arm("warm", server.name, True, "off")):
        res = send(client, server, arm, probe, min(max_tokens, 16), salt="warm-up")
        if not res.ok:
            raise RuntimeError(f"the warm-up request to {server.name} failed: {res.error}")
        if server.name not in PEERS and arm.constrained:
            # The configuration reached the engine: forced drafts there only when switched on.
            on = server.name == SPECGATE
            if res.output_tokens > 2 and (res.forced > 0) != on:
                raise RuntimeError(f"{server.name}: {res.forced} forced draft tokens in the warm-up answer")
    if server.name in PEERS:
        return
    tiny = [{"role": "user", "content": "{}"}]
    for case in cases:
        body = request_body(server, Arm("warm", server.name, True, "off"), case, 1, "warm-up", tiny)
        body["stream"] = False
        body.pop("stream_options", None)
        r = client.post(f"{server.url}/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{server.name} refused the schema of {case.case_id}: {r.text[:300]}")


def flush_llama(client: httpx.Client, server: Server, n: int) -> None:
    """A one-token request, so that llama.cpp's next prompt shares no prefix with its last one."""
    body = {"model": server.model, "messages": [{"role": "user", "content": f"ok {n}"}], "max_tokens": 1}
    client.post(f"{server.url}/v1/chat/completions", json=body, headers=_headers(server))


def measure(
    client: httpx.Client,
    started: Mapping[str, Server],
    arms: Sequence[Arm],
    cases: Sequence[Case],
    max_tokens: int,
    reps: int,
    run_id: str,
    log: Callable[[str], None] = lambda _: None,
) -> list[Result]:
    """Every case through every arm, back to back, the arms' order rotated per case and repetition."""
    results: list[Result] = []
    n = 0
    for rep in range(reps):
        for i, case in enumerate(cases):
            k = (i + rep * 3) % len(arms)
            for arm in [*arms[k:], *arms[:k]]:
                server = started[arm.server]
                if server.name in PEERS:
                    flush_llama(client, server, n)
                n += 1
                res = send(client, server, arm, case, max_tokens, rep, salt=f"{run_id}-{arm.name}-{rep}")
                results.append(res)
            done = results[-len(arms) :]
            log(
                f"rep {rep + 1}/{reps} prompt {i + 1}/{len(cases)} {case.case_id}: "
                + ", ".join(
                    f"{r.arm} {r.output_tokens}t {r.status or 'ERR'}"
                    + (f" {r.decode_tps:.0f}/s" if r.decode_tps else "")
                    for r in done
                )
            )
    return results


# ---- summaries ----------------------------------------------------------------------------------


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _geomean(xs: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def arm_summary(results: Sequence[Result], arm: str) -> dict[str, Any]:
    rs = [r for r in results if r.arm == arm]
    ok = [r for r in rs if r.ok]
    decode = [r.decode_tps for r in ok if r.decode_tps]
    e2e = [r.e2e_tps for r in ok if r.e2e_tps]
    ttft = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    steps = [(r.output_tokens - 1, r.decode_steps) for r in ok if r.decode_steps]
    emitted = sum(t for t, _ in steps)
    decode_n = sum(n for _, n in steps if n)
    step_ms = [r.step_ms for r in ok if r.step_ms]
    drafts = sum(r.spec.get("num_drafts") or 0 for r in ok)
    accepted = sum(r.spec.get("num_accepted_tokens") or 0 for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "arm": arm,
        "requests": len(rs),
        "failed": len(rs) - len(ok),
        "valid": sum(r.status == "valid" for r in ok),
        "lenient": sum(r.lenient for r in ok),
        "cut": sum(r.finish == "length" for r in ok),
        "invalid_not_cut": sum(r.status != "valid" and r.finish != "length" for r in ok),
        "mean_output_tokens": out_tokens / len(ok) if ok else None,
        "ttft_p50_ms": statistics.median(ttft) if ttft else None,
        "decode_tps": _mean(decode),
        "decode_tps_p50": statistics.median(decode) if decode else None,
        "e2e_tps": _mean(e2e),
        "tokens_per_step": emitted / decode_n if decode_n else None,
        "step_ms_p50": statistics.median(step_ms) if step_ms else None,
        "mean_acceptance_length": (accepted + drafts) / drafts if drafts else None,
        "forced_tokens": sum(r.forced for r in ok),
        "forced_share": sum(r.forced for r in ok) / out_tokens if out_tokens else None,
    }


def paired_ratio(
    results: Sequence[Result], a: str, b: str, metric: str, source: str | None = None
) -> tuple[float | None, float | None, int]:
    """Geometric mean and median over prompts (and repetitions) of arm a's metric over arm b's,
    and how many pairs they are over."""
    by: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for r in results:
        if r.ok and (source is None or r.source == source):
            value = getattr(r, metric)
            if value:
                by[(r.case_id, r.rep)][r.arm] = value
    ratios = [v[a] / v[b] for v in by.values() if a in v and b in v]
    return _geomean(ratios), statistics.median(ratios) if ratios else None, len(ratios)


def agreement(results: Sequence[Result], arm: str, reference: str) -> tuple[int, int]:
    """(answers equal to the reference arm's, pairs): text for specgate arms; parsed JSON value for
    llama.cpp's (its grammar allows other whitespace)."""
    refs = {(r.case_id, r.rep): r for r in results if r.arm == reference and r.ok}
    same = total = 0
    for r in results:
        ref = refs.get((r.case_id, r.rep))
        if r.arm != arm or not r.ok or ref is None:
            continue
        total += 1
        if r.text == ref.text:
            same += 1
        elif arm.startswith("llama") and r.status == "valid" and ref.status == "valid":
            same += json.loads(r.text) == json.loads(ref.text)
    return same, total


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def tables(results: Sequence[Result], arms: Sequence[str]) -> str:
    lines = [
        "| arm | valid | valid, lenient | cut at max_tokens | invalid, not cut | mean tokens | TTFT p50 ms "
        "| decode tok/s, mean (p50) | end-to-end tok/s | ms/step p50 | tokens/step | accepted length "
        "| forced draft tokens (share) | same answer as |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        s = arm_summary(results, arm)
        n = s["requests"] - s["failed"]
        ref = REFERENCE.get(arm)
        same = ""
        if ref is not None and ref in arms:
            k, total = agreement(results, arm, ref)
            same = f"{ref}: {k}/{total}"
        forced = f"{s['forced_tokens']} ({_f(s['forced_share'], '{:.0%}')})" if s["forced_tokens"] else "-"
        failed = f" ({s['failed']} failed)" if s["failed"] else ""
        lines.append(
            f"| {arm} | {s['valid']}/{n}{failed} | {s['lenient']}/{n} | {s['cut']} | {s['invalid_not_cut']} "
            f"| {_f(s['mean_output_tokens'])} | {_f(s['ttft_p50_ms'], '{:.0f}')} "
            f"| {_f(s['decode_tps'])} ({_f(s['decode_tps_p50'])}) "
            f"| {_f(s['e2e_tps'])} | {_f(s['step_ms_p50'], '{:.2f}')} | {_f(s['tokens_per_step'], '{:.2f}')} "
            f"| {_f(s['mean_acceptance_length'], '{:.2f}')} | {forced} | {same} |"
        )
    lines += [
        "",
        "Ratios of tokens/s, paired by prompt: geometric mean of the per-request ratios (their "
        "median; n pairs), decode and end to end; per source, decode.",
        "",
        "| ratio | goal | decode (median) | end to end (median) | own | BFCL simple | BFCL multiple |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, a, b, goal in RATIOS:
        if a not in arms or b not in arms:
            continue
        decode, decode_med, n = paired_ratio(results, a, b, "decode_tps")
        e2e, e2e_med, _ = paired_ratio(results, a, b, "e2e_tps")
        per_source = [paired_ratio(results, a, b, "decode_tps", src)[0] for src in SOURCES]
        goal_text = f">= {goal:.2f}" if goal else ""
        lines.append(
            f"| {label} | {goal_text} | {_f(decode, '{:.2f}')} ({_f(decode_med, '{:.2f}')}; n={n}) "
            f"| {_f(e2e, '{:.2f}')} ({_f(e2e_med, '{:.2f}')}) | "
            + " | ".join(_f(x, "{:.2f}") for x in per_source)
            + " |"
        )
    steps = [(label, a, b) for label, a, b in STEP_RATIOS if a in arms and b in arms]
    if steps:
        lines += [
            "",
            "Time of a decode step, paired by prompt (geometric mean of per-request ratios, median):",
            "",
            "| ratio | all (median) | own | BFCL simple | BFCL multiple |",
            "|---|---|---|---|---|",
        ]
    for label, a, b in steps:
        mean, median, n = paired_ratio(results, a, b, "step_ms")
        per_source = [paired_ratio(results, a, b, "step_ms", src)[0] for src in SOURCES]
        lines.append(
            f"| {label} | {_f(mean, '{:.2f}')} ({_f(median, '{:.2f}')}; n={n}) | "
            + " | ".join(_f(x, "{:.2f}") for x in per_source)
            + " |"
        )
    return "\n".join(lines)


def failures(results: Sequence[Result], arms: Sequence[str], limit: int = 12) -> list[str]:
    """Constrained answers that do not validate though they were not cut, and failed requests."""
    out = []
    for r in results:
        arm = ARMS[r.arm]
        if not r.ok:
            out.append(f"- {r.arm} / {r.case_id} (rep {r.rep}): request failed: {r.error}")
        elif arm.constrained and r.status != "valid" and r.finish != "length":
            out.append(
                f"- {r.arm} / {r.case_id} (rep {r.rep}): {r.status}, finish {r.finish}, "
                f"{r.output_tokens} tokens: {r.invalid_reason[:160]}; answer {r.text[:240]!r}"
            )
    return out[:limit] + ([f"- ... {len(out) - limit} more (report.json)"] if len(out) > limit else [])


# ---- the command ----------------------------------------------------------------------------------


def machine() -> str:
    name = flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line
    avx512 = sorted({f for f in flags.split() if f.startswith("avx512")})
    isa = (
        "AVX-512 (" + ", ".join(f for f in avx512 if f in ("avx512_vnni", "avx512_bf16")) + ")"
        if avx512
        else "no AVX-512"
    )
    return f"{name or 'unknown CPU'}, {os.cpu_count()} cores, {isa}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="a GGUF path or a bench/models.py name (default: the embedded model)")
    ap.add_argument(
        "--prompts", type=int, default=40, help="prompts: up to 6 own schemas (a third), the rest BFCL"
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--reps", type=int, default=1, help="repetitions, interleaved (each prompt through every arm)"
    )
    ap.add_argument(
        "--peer",
        choices=["llama-cpp", "llama-server"],
        help="add llama.cpp's server on the same GGUF: llama-cpp-python's, or the C++ llama-server",
    )
    ap.add_argument("--llama-bin", type=Path, default=DEFAULT_LLAMA_BIN, help="llama-server's binary")
    ap.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, of {', '.join(SOURCES)}")
    ap.add_argument(
        "--as-sent",
        action="store_true",
        help="send BFCL's objects unclosed (each server's reading decides); validate against the closed form",
    )
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: all cores)")
    ap.add_argument("--bfcl-dir", type=Path, default=DATA / "bfcl")
    ap.add_argument(
        "--out", type=Path, default=None, help="logs and report.json (default: a temporary folder)"
    )
    args = ap.parse_args(argv)

    from specgate.bench.models import resolve

    model = resolve(args.model)
    arms = [ARMS[a] for a in args.arms.split(",")]
    peer = {"llama-cpp": LLAMA, "llama-server": LLAMA_SERVER}.get(args.peer or "")
    arms = [a for a in arms if a.server not in PEERS or a.server == peer]
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-structured-"))
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
        sys.stderr.flush()

    w = workload(args.prompts, args.bfcl_dir, args.sources.split(","), args.as_sent)
    llama_fallbacks: list[str] = []
    if any(a.server == LLAMA for a in arms):
        from llama_cpp import llama_grammar

        for case in w.cases:  # llama-cpp-python answers with any JSON where its converter fails
            try:
                llama_grammar.json_schema_to_gbnf(json.dumps(case.schema))
            except Exception as exc:  # any converter failure is its silent fallback
                llama_fallbacks.append(f"{case.case_id} ({type(exc).__name__}: {str(exc)[:80]})")
    load_before = os.getloadavg()
    t0 = time.monotonic()
    run_id = f"{int(time.time())}"
    with (
        servers(
            {a.server for a in arms}, model, out, args.threads or os.cpu_count() or 1, log, args.llama_bin
        ) as started,
        httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client,
    ):
        for server in started.values():
            warm_up(client, server, w.cases, args.max_tokens)
        log(f"warmed up; measuring {len(w.cases)} prompts x {len(arms)} arms x {args.reps}")
        t_measure = time.monotonic()
        results = measure(client, started, arms, w.cases, args.max_tokens, args.reps, run_id, log)
        measured = time.monotonic() - t_measure
    load_after = os.getloadavg()
    names = [a.name for a in arms]

    by_source = Counter(c.source for c in w.cases)
    header = [
        f"## Structured outputs, {Path(model).name if model else 'the default model (SmolLM2-135M)'}",
        "",
        f"Command: `{' '.join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}`",
        f"Machine: {machine()}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"measuring took {measured:.0f} s ({time.monotonic() - t0:.0f} s with starts).",
        f"Prompts: {len(w.cases)} ({', '.join(f'{k} {v}' for k, v in by_source.items())}) x {args.reps} "
        f"repetition(s), max_tokens {args.max_tokens}, greedy, one request at a time, streamed over HTTP.",
        "BFCL schemas: "
        + (", ".join(f"{k} x{v}" for k, v in sorted(w.conversions.items())) or "nothing converted")
        + "; dropped for llguidance: "
        + (", ".join(f"{k} x{v}" for k, v in sorted(w.dropped.items())) or "none")
        + f"; prompts skipped (schema refused): {w.skipped}.",
    ]
    if any(a.server == LLAMA for a in arms):
        header.append(
            "llama.cpp's converter failed (it then allows any JSON) on: "
            + (", ".join(llama_fallbacks) or "none")
        )
    body = tables(results, names)
    bad = failures(results, names)
    text = "\n".join(
        [
            *header,
            "",
            body,
            "",
            "Constrained answers that failed to validate without being cut, and failed requests:",
            *(bad or ["- none"]),
        ]
    )
    sys.stdout.write(text + "\n")
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "model": model,
        "machine": machine(),
        "load": [load_before, load_after],
        "conversions": dict(w.conversions),
        "dropped": dict(w.dropped),
        "skipped": w.skipped,
        "llama_fallbacks": llama_fallbacks,
        "summary": [arm_summary(results, a) for a in names],
        "results": [asdict(r) for r in results],
        "cases": [asdict(c) for c in w.cases],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(text + "\n")
    sys.stdout.write(f"\nreport: {out / 'report.md'}\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
