"""`specgate bench structured`: structured outputs served end to end. Constrained decoding (JSON
schemas, function calls) beside unconstrained, with and without forced-token drafts and speculation,
and beside llama.cpp's llama-server on the same GGUF (--peer), every server up for the whole run and
each prompt through every arm in turn (interleaved.py: the order rotating, no prompt reuse).
(bench/README.md, "What each benchmark does", has the workload, the arms and what is reported.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs

from specgate.bench import interleaved, launch, models
from specgate.bench.client import PEER, PLAIN, RequestResult
from specgate.bench.stats import geomean, mean, percentile, table
from specgate.bench.workload import DATA, BenchRequest
from specgate.engine.structured_output.grammar import Grammar, check

BFCL = DATA / "bfcl"
BFCL_FILES = {"simple": "BFCL_v4_simple_python.json", "multiple": "BFCL_v4_multiple.json"}
OWN = "own"
SOURCES = (OWN, "simple", "multiple")
# BFCL's parameter types that JSON Schema spells otherwise; None: any value (the key is dropped).
BFCL_TYPES: dict[str, str | None] = {"dict": "object", "float": "number", "tuple": "array", "any": None}
# Keys whose values are schemas (or lists / maps of schemas) that the conversion walks into.
_SCHEMA_KEYS = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
SPECGATE, SPECGATE_NOFORCE, LLAMA_SERVER = "specgate", "specgate (forced drafts off)", "llama-server"


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    server: str
    constrained: bool
    spec: str = PLAIN  # specgate's speculation arm (client.spec_of); PEER for llama-server


ARMS = {
    a.name: a
    for a in (
        Arm("free", SPECGATE, False),
        Arm("json-noforce", SPECGATE_NOFORCE, True),
        Arm("json", SPECGATE, True),
        Arm("json-ngram", SPECGATE, True, "ngram"),
        Arm("json-suffix", SPECGATE, True, "suffix"),
        Arm("free-ngram", SPECGATE, False, "ngram"),
        Arm("free-suffix", SPECGATE, False, "suffix"),
        Arm("server-json", LLAMA_SERVER, True, PEER),
        Arm("server-free", LLAMA_SERVER, False, PEER),
    )
}
# Whose output an arm's must equal (greedy, lossless drafting) or, for llama-server, be compared with.
REFERENCE = {"json": "json-noforce", "json-ngram": "json-noforce", "json-suffix": "json-noforce"}
REFERENCE |= {"free-ngram": "free", "free-suffix": "free", "server-json": "json", "server-free": "free"}
# (label, arm, over arm, goal): paired by prompt, geometric mean of the per-request ratios of decode
# tokens/s (and end to end); STEP_RATIOS compare the mean time of a decode step instead.
RATIOS: list[tuple[str, str, str, float | None]] = [
    ("constrained / unconstrained, plain", "json", "free", 0.90),
    ("constrained (forced off) / unconstrained", "json-noforce", "free", None),
    ("forced drafts on / off", "json", "json-noforce", None),
    ("json+ngram / llama-server json", "json-ngram", "server-json", 1.5),
    ("json+suffix / llama-server json", "json-suffix", "server-json", 1.5),
    ("json (plain) / llama-server json", "json", "server-json", None),
    ("free / llama-server free", "free", "server-free", None),
    ("llama-server json / llama-server free", "server-json", "server-free", None),
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=40, help="up to 6 own schemas (a third), the rest BFCL")
    p.add_argument("--peer", choices=["llama-server"], help="add llama.cpp's llama-server on the same GGUF")
    p.add_argument("--llama-server", default=None, metavar="PATH", help=f"default ${launch.LLAMA_SERVER_ENV}")
    p.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, of {', '.join(SOURCES)}")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    launch.options(p, model=None, max_tokens=128, reps=1, threads=None, out="bench-out/structured")


@dataclass(frozen=True, slots=True)
class Case:
    """One prompt and the JSON schema its answer must match."""

    case_id: str
    source: str  # "own", "simple" or "multiple"
    messages: list[dict[str, str]]
    schema: dict[str, Any]  # what the servers are sent and an answer is validated against


def _walk(schema: Any, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """`schema` with `edit` applied to it and to every schema inside it, outermost first."""
    if isinstance(schema, list):
        return [_walk(s, edit) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = edit(dict(schema))
    for key, value in out.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _walk(v, edit) for k, v in value.items()}
        elif key in _SCHEMA_LISTS or key in _SCHEMA_KEYS:
            out[key] = _walk(value, edit)
    return out


def convert_bfcl(schema: Any, counts: Counter[str]) -> Any:
    """A BFCL parameter schema as JSON Schema: its types converted, every object with properties
    closed; what changed is counted in `counts`."""

    def edit(node: dict[str, Any]) -> dict[str, Any]:
        kind = node.get("type")
        if isinstance(kind, str) and kind in BFCL_TYPES:
            counts[f"type {kind} -> {BFCL_TYPES[kind] or '{}'}"] += 1
            if (spelled := BFCL_TYPES[kind]) is None:
                del node["type"]
            else:
                node["type"] = spelled
        if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
            node["additionalProperties"] = False
            counts["object closed (additionalProperties: false)"] += 1
        return node

    return _walk(schema, edit)


def enforceable(schema: dict[str, Any], dropped: Counter[str]) -> dict[str, Any] | None:
    """`schema` with the keywords and formats llguidance refuses dropped (counted in `dropped`), or
    None when it still refuses it for another reason. (A property named like a keyword stays.)"""
    for _ in range(16):
        if (problem := check(Grammar.json_schema(schema))) is None:
            return schema
        unimplemented = re.search(r"Unimplemented keys: (\[[^\]]*\])", problem)
        unknown_format = re.search(r"Unknown format: (\S+)", problem)
        if not unimplemented and not unknown_format:
            return None
        keys = set(json.loads(unimplemented.group(1))) if unimplemented else set()
        formats = {unknown_format.group(1).strip("'\".,;")} if unknown_format else set()

        def drop(node: dict[str, Any], keys: set[str] = keys, formats: set[str] = formats) -> dict[str, Any]:
            gone = [k for k, v in node.items() if k in keys or (k == "format" and v in formats)]
            dropped.update(f"{k}: {node[k]}" if k == "format" else k for k in gone)
            return {k: v for k, v in node.items() if k not in gone}

        schema = _walk(schema, drop)
    return None


def call_schema(functions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A call of one of `functions` (parameters already JSON Schema): {"name", "arguments"}."""
    calls = []
    for fn in functions:
        props = {"name": {"const": fn["name"]}, "arguments": fn.get("parameters") or {"type": "object"}}
        call = {"type": "object", "properties": props, "required": ["name", "arguments"]}
        calls.append({**call, "additionalProperties": False})
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def bfcl_cases(source: str, n: int, counts: Counter[str], dropped: Counter[str]) -> tuple[list[Case], int]:
    """n BFCL prompts of one file (spread over it) whose answer must call its function (one of its
    functions), and how many of the chosen ones were skipped (a schema llguidance refuses)."""
    rows = [json.loads(line) for line in (BFCL / BFCL_FILES[source]).read_text().splitlines() if line]
    n = min(n, len(rows))
    out: list[Case] = []
    skipped = 0
    for row in [rows[i * len(rows) // n] for i in range(n)]:  # spread evenly, the first included
        functions = []
        for fn in row["function"]:
            functions.append({"name": fn["name"], "description": fn.get("description", "")})
            functions[-1]["parameters"] = convert_bfcl(fn.get("parameters") or {"type": "object"}, counts)
        if (schema := enforceable(call_schema(functions), dropped)) is None:
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
        out.append(Case(row["id"], source, [{"role": "system", "content": system}, *turns], schema))
    return out, skipped


@dataclass(slots=True)
class Workload:
    cases: list[Case]
    conversions: Counter[str] = field(default_factory=Counter)  # BFCL keys converted
    dropped: Counter[str] = field(default_factory=Counter)  # keys llguidance refuses, dropped
    skipped: int = 0  # chosen BFCL prompts whose schema could not be made enforceable


def workload(n: int, sources: Sequence[str] = SOURCES) -> Workload:
    """n prompts: up to six of our own schemas (a third), the rest BFCL, simple and multiple alike;
    only the sources named (the others' share goes to the rest)."""
    bfcl = [s for s in ("simple", "multiple") if s in sources]
    own = (min(6, n // 3) if bfcl else min(6, n)) if OWN in sources else 0
    w = Workload([])
    for own_case in json.loads((DATA / "structured_schemas.json").read_text())[:own]:
        if (checked := enforceable(own_case["schema"], w.dropped)) is None:
            raise ValueError(f"llguidance refuses the schema of {own_case['id']}")
        system = "Answer with one JSON object that matches this JSON Schema, and nothing else:\n"
        system += json.dumps(checked)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": own_case["task"]}]
        w.cases.append(Case(own_case["id"], OWN, messages, checked))
    shares = [(n - own + 1) // 2, (n - own) // 2] if len(bfcl) == 2 else [n - own]
    for source, k in zip(bfcl, shares, strict=False):
        cases, skipped = bfcl_cases(source, k, w.conversions, w.dropped)
        w.cases += cases
        w.skipped += skipped
    return w


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
        errors = list(validator.iter_errors(json.loads(text)))
    except json.JSONDecodeError as exc:
        status, error = "unparsed", f"not JSON: {exc}"
    else:
        if not errors:
            return "valid", True, ""
        status, error = "invalid", f"{errors[0].message} at {list(errors[0].instance_path)}"
    for candidate in _json_candidates(text):
        with contextlib.suppress(json.JSONDecodeError):
            if validator.is_valid(json.loads(candidate)):
                return status, True, error
    return status, False, error


def request(arm: Arm, case: Case, max_tokens: int) -> BenchRequest:
    """The case as the arm sends it: the same OpenAI json_schema body to every server."""
    extra: dict[str, Any] = {}
    if arm.constrained:
        schema = {"name": "answer", "schema": case.schema, "strict": True}
        extra["response_format"] = {"type": "json_schema", "json_schema": schema}
    return BenchRequest(case.source, case.messages, max_tokens, extra=extra)


@dataclass(slots=True)
class Result:
    """One answer, its validity and its decode steps (specgate: its steps less its prefill chunks)."""

    arm: str
    case_id: str
    source: str
    rep: int
    r: RequestResult
    status: str = ""  # valid / invalid / unparsed
    lenient: bool = False
    invalid_reason: str = ""
    decode_steps: int | None = None

    @property
    def forced(self) -> int:
        """Drafted tokens the grammar forced."""
        return int(self.r.spec.get("num_forced_draft_tokens") or 0)

    @property
    def decode_tps(self) -> float | None:
        """Output tokens after the first, per second after the first content chunk."""
        return 1 / self.r.tpot if self.r.tpot else None

    @property
    def e2e_tps(self) -> float | None:
        return self.r.goodput or None

    @property
    def step_ms(self) -> float | None:
        """specgate: mean time of a decode step (a forward pass and what surrounds it)."""
        if not self.decode_steps or self.r.ttft is None or self.r.e2e is None:
            return None
        return (self.r.e2e - self.r.ttft) * 1e3 / self.decode_steps


def judged(arm: str, case: Case, rep: int, r: RequestResult, chunk: int) -> Result:
    out = Result(arm, case.case_id, case.source, rep, r)
    if r.ok:
        out.status, out.lenient, out.invalid_reason = validity(r.text, case.schema)
    if r.steps is not None:  # less the prefill chunks, the last of which emits the first token
        out.decode_steps = r.steps - max(1, math.ceil(max(0, r.prompt_tokens - r.cached_tokens) / chunk))
    return out


@contextlib.contextmanager
def servers(names: set[str], args: argparse.Namespace, model: str | None) -> Iterator[dict[str, str]]:
    """The servers the arms need (name: URL), each ready before the next starts, all stopped on
    every way out. specgate shares no cache of earlier outputs (draft_cache_scope off): the suffix
    arms must not draft an answer another arm already gave for the same prompt."""
    started: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for name, slug in ((SPECGATE, "specgate"), (SPECGATE_NOFORCE, "specgate-noforce")):
            if name in names:
                env = {"SPECGATE_EMBEDDED__DRAFT_CACHE_SCOPE": "off"}
                env["SPECGATE_EMBEDDED__FORCED_DRAFTS"] = "true" if name == SPECGATE else "false"
                data = args.out / f"{slug}-data"
                gateway = launch.specgate(args.out / f"{slug}.log", {"model": model}, 900, env=env, data=data)
                started[name] = stack.enter_context(gateway).url
        if LLAMA_SERVER in names:
            exe, port = launch.llama_server_binary(args.llama_server), launch.free_port()
            gguf, threads = models.gguf_path(model), args.threads or os.cpu_count() or 1
            cmd = launch.llama_server_command(exe, gguf, port, threads, 1, launch.ctx_size(1))
            log = args.out / "llama-server.log"
            server = stack.enter_context(launch.running(cmd, log, f"http://127.0.0.1:{port}/health", 900))
            started[LLAMA_SERVER] = server.url
        for name, url in started.items():
            launch.log(f"{name} ready at {url}")
        yield started


def warm_up(started: Mapping[str, str], cases: Sequence[Case]) -> None:
    """Untimed: every schema compiled once on specgate (its grammar cache), so that no measured
    request pays it, and the forced drafts as configured (a constrained answer forces tokens only
    where they are on)."""
    for name in [n for n in (SPECGATE, SPECGATE_NOFORCE) if n in started]:
        with httpx.Client(base_url=started[name], timeout=600) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for k, case in enumerate(cases):
                body = {"model": model, "messages": case.messages, "max_tokens": 1 if k else 24}
                body |= {"temperature": 0.0, **request(ARMS["json"], case, 1).extra}  # the json arm's schema
                r = client.post("/v1/chat/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"{name} refused the schema of {case.case_id}: {r.text[:300]}")
                forced = (r.json().get("metrics") or {}).get("spec_decoding", {}) or {}
                n = r.json()["usage"]["completion_tokens"]
                if not k and n > 2 and bool(forced.get("num_forced_draft_tokens")) != (name == SPECGATE):
                    raise RuntimeError(f"{name}: forced drafts {forced} in the warm-up answer")


async def measure(
    started: Mapping[str, str], arms: list[Arm], cases: list[Case], max_tokens: int, reps: int, chunk: int
) -> list[Result]:
    """Every case through every arm in turn (interleaved.py); llama-server's prompt reuse off."""
    ways = []
    for a in arms:
        extra = {"cache_prompt": False} if a.server == LLAMA_SERVER else {}
        reqs = [request(a, c, max_tokens) for c in cases]
        ways.append(interleaved.Arm(a.name, started[a.server], a.spec, extra=extra, reqs=reqs))
    results: list[Result] = []
    async with interleaved.connected(ways):
        for rep in range(reps):
            sender = interleaved.Sender(f"{uuid.uuid4().hex[:8]}-{rep}", [])
            got = await interleaved.one_in_flight(ways, len(cases), sender)
            results += [judged(a, cases[k], rep, r, chunk) for a, rs in got.items() for k, r in enumerate(rs)]
            launch.log(f"repetition {rep + 1}/{reps}: {len(cases)} prompts x {len(arms)} arms")
    return results


def arm_summary(results: Sequence[Result], arm: str) -> dict[str, Any]:
    rs = [x for x in results if x.arm == arm]
    ok = [x for x in rs if x.r.ok]
    decode = [t for x in ok if (t := x.decode_tps)]
    steps = [(x.r.output_tokens - 1, x.decode_steps) for x in ok if x.decode_steps]
    drafts = sum(x.r.spec.get("num_drafts") or 0 for x in ok)
    accepted = sum(x.r.spec.get("num_accepted_tokens") or 0 for x in ok)
    tokens, forced = sum(x.r.output_tokens for x in ok), sum(x.forced for x in ok)
    out = {"arm": arm, "requests": len(rs), "failed": len(rs) - len(ok)}
    out |= {"valid": sum(x.status == "valid" for x in ok), "lenient": sum(x.lenient for x in ok)}
    out |= {"cut": sum(x.r.finish == "length" for x in ok)}
    out["invalid_not_cut"] = sum(x.status != "valid" and x.r.finish != "length" for x in ok)
    out["mean_output_tokens"] = tokens / len(ok) if ok else None
    out["ttft_p50_ms"] = percentile([x.r.ttft * 1e3 for x in ok if x.r.ttft is not None], 50)
    out |= {"decode_tps": mean(decode), "decode_tps_p50": percentile(decode, 50)}
    out["e2e_tps"] = mean(t for x in ok if (t := x.e2e_tps))
    out["tokens_per_step"] = sum(t for t, _ in steps) / sum(n for _, n in steps if n) if steps else None
    out["step_ms_p50"] = percentile([t for x in ok if (t := x.step_ms)], 50)
    out["mean_acceptance_length"] = (accepted + drafts) / drafts if drafts else None
    return {**out, "forced_tokens": forced, "forced_share": forced / tokens if tokens else None}


def paired_ratio(
    results: Sequence[Result], a: str, b: str, metric: str, source: str | None = None
) -> tuple[float | None, float | None, int]:
    """Geometric mean and median over prompts of arm a's metric over b's, and n pairs."""
    by: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for x in results:
        if x.r.ok and (source is None or x.source == source) and (value := getattr(x, metric)):
            by[(x.case_id, x.rep)][x.arm] = value
    ratios = [v[a] / v[b] for v in by.values() if a in v and b in v]
    return geomean(ratios), percentile(ratios, 50), len(ratios)


def agreement(results: Sequence[Result], arm: str, reference: str) -> tuple[int, int]:
    """(answers equal to the reference arm's, pairs): text for specgate arms; parsed JSON value for
    llama-server's (its grammar allows other whitespace)."""
    refs = {(x.case_id, x.rep): x for x in results if x.arm == reference and x.r.ok}
    pairs = [(x, y) for x in results if x.arm == arm and x.r.ok and (y := refs.get((x.case_id, x.rep)))]
    return sum(_equal(x, y, ARMS[arm].server == LLAMA_SERVER) for x, y in pairs), len(pairs)


def _equal(x: Result, y: Result, parsed: bool) -> bool:
    if x.r.text == y.r.text:
        return True
    return parsed and x.status == y.status == "valid" and json.loads(x.r.text) == json.loads(y.r.text)


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def tables(results: Sequence[Result], arms: Sequence[str]) -> str:
    rows = []
    for arm in arms:
        s = arm_summary(results, arm)
        n, ref = s["requests"] - s["failed"], REFERENCE.get(arm)
        same = "{}: {}/{}".format(ref, *agreement(results, arm, ref)) if ref and ref in arms else ""
        forced = f"{s['forced_tokens']} ({_f(s['forced_share'], '{:.0%}')})" if s["forced_tokens"] else "-"
        row = [arm, f"{s['valid']}/{n}" + (f" ({s['failed']} failed)" if s["failed"] else "")]
        row += [f"{s['lenient']}/{n}", s["cut"], s["invalid_not_cut"], _f(s["mean_output_tokens"])]
        row += [_f(s["ttft_p50_ms"], "{:.0f}"), f"{_f(s['decode_tps'])} ({_f(s['decode_tps_p50'])})"]
        row += [_f(s["e2e_tps"]), _f(s["step_ms_p50"], "{:.2f}"), _f(s["tokens_per_step"], "{:.2f}")]
        rows.append([*row, _f(s["mean_acceptance_length"], "{:.2f}"), forced, same])
    head = ["arm", "valid", "valid, lenient", "cut at max_tokens", "invalid, not cut", "mean tokens"]
    head += ["TTFT p50 ms", "decode tok/s, mean (p50)", "end-to-end tok/s", "ms/step p50", "tokens/step"]
    lines = table([*head, "accepted length", "forced draft tokens (share)", "same answer as"], rows)
    lines += ["", "Ratios of tokens/s, paired by prompt: geometric mean of the per-request ratios (their "]
    lines[-1] += "median; n pairs), decode and end to end; per source, decode."
    sources = ["own", "BFCL simple", "BFCL multiple"]

    def ratio(a: str, b: str, metric: str, pairs: bool = True) -> str:
        """a's `metric` over b's, paired by prompt: geometric mean (median; n pairs)."""
        geo, median, n = paired_ratio(results, a, b, metric)
        return f"{_f(geo, '{:.2f}')} ({_f(median, '{:.2f}')}" + (f"; n={n})" if pairs else ")")

    def per_source(a: str, b: str, metric: str) -> list[str]:
        return [_f(paired_ratio(results, a, b, metric, src)[0], "{:.2f}") for src in SOURCES]

    rows = []
    for label, a, b, goal in [r for r in RATIOS if r[1] in arms and r[2] in arms]:
        cells = [ratio(a, b, "decode_tps"), ratio(a, b, "e2e_tps", pairs=False)]
        rows.append([label, f">= {goal:.2f}" if goal else "", *cells, *per_source(a, b, "decode_tps")])
    lines += ["", *table(["ratio", "goal", "decode (median)", "end to end (median)", *sources], rows)]
    steps = [(label, a, b) for label, a, b in STEP_RATIOS if a in arms and b in arms]
    rows = [[label, ratio(a, b, "step_ms"), *per_source(a, b, "step_ms")] for label, a, b in steps]
    if rows:
        title = "Time of a decode step, paired by prompt (geometric mean of per-request ratios, median):"
        lines += ["", title, "", *table(["ratio", "all (median)", *sources], rows)]
    return "\n".join(lines)


def failures(results: Sequence[Result], limit: int = 12) -> list[str]:
    """Constrained answers that do not validate though they were not cut, and failed requests."""
    out = []
    for x in results:
        where = f"- {x.arm} / {x.case_id} (rep {x.rep})"
        if not x.r.ok:
            out.append(f"{where}: request failed: {x.r.error}")
        elif ARMS[x.arm].constrained and x.status != "valid" and x.r.finish != "length":
            out.append(f"{where}: {x.status}, finish {x.r.finish}, {x.r.output_tokens} tokens: ")
            out[-1] += f"{x.invalid_reason[:160]}; answer {x.r.text[:240]!r}"
    return out[:limit] + ([f"- ... {len(out) - limit} more (report.json)"] if len(out) > limit else [])


def run(args: argparse.Namespace) -> int:
    from specgate.gateway.settings import EmbeddedSettings

    model = models.resolve(args.model)
    args.out = Path(args.out)
    arms = [ARMS[name] for name in args.arms.split(",") if ARMS[name].server != LLAMA_SERVER or args.peer]
    args.out.mkdir(parents=True, exist_ok=True)
    w = workload(args.prompts, args.sources.split(","))
    load_before, t0 = os.getloadavg(), time.monotonic()
    chunk = EmbeddedSettings().max_num_batched_tokens
    with servers({a.server for a in arms}, args, model) as started:
        warm_up(started, w.cases)
        launch.log(f"warmed up; measuring {len(w.cases)} prompts x {len(arms)} arms x {args.reps}")
        results = asyncio.run(measure(started, arms, w.cases, args.max_tokens, args.reps, chunk))
    names = [a.name for a in arms]
    by_source = ", ".join(f"{k} {v}" for k, v in Counter(c.source for c in w.cases).items())
    conversions = ", ".join(f"{k} x{v}" for k, v in sorted(w.conversions.items())) or "nothing converted"
    dropped = ", ".join(f"{k} x{v}" for k, v in sorted(w.dropped.items())) or "none"
    lines = [
        f"## Structured outputs, {Path(model).name if model else 'the default model (SmolLM2-135M)'}",
        "",
        f"Command: `{launch.command_line()}`",
        f"Machine: {launch.machine()}; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} "
        f"after; {time.monotonic() - t0:.0f} s with starts.",
        f"Prompts: {len(w.cases)} ({by_source}) x {args.reps} repetition(s), max_tokens {args.max_tokens}, "
        "greedy, one request at a time, streamed over HTTP.",
        f"BFCL schemas: {conversions}; dropped for llguidance: {dropped}; prompts skipped: {w.skipped}.",
        "",
        tables(results, names),
        "",
        "Constrained answers that failed to validate without being cut, and failed requests:",
        *(failures(results) or ["- none"]),
    ]
    text = "\n".join(lines)
    sys.stdout.write(text + f"\n\nreport: {args.out / 'report.md'}\n")
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items() if k != "func"}}
    report |= {"model": model, "summary": [arm_summary(results, a) for a in names]}
    report["results"] = [
        {**asdict(r), "r": {**asdict(r.r), "ttft": r.r.ttft, "e2e": r.r.e2e}} for r in results
    ]
    report["cases"] = [asdict(c) for c in w.cases]
    (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "report.md").write_text(text + "\n")
    return 0 if all(r.r.ok for r in results) else 1
