"""An external backend's Prometheus /metrics text, read into a load snapshot (`ScrapedLoad`), or refused.

The gateway scrapes every external server (vLLM, SGLang, llama.cpp's `llama-server --metrics`, another
specgate) on its health interval and routes on what it read: requests running and waiting, the share
of KV cache in use, and the server's cumulative speculation counters. This module is the pure part:
the caller fetches the text, `parse_metrics` turns it into a `ScrapedLoad` or raises `ScrapeError`.

Why a parser of its own rather than prometheus_client's: that one is quadratic on hostile label
values (a 2 MB line of escaped quotes takes a minute), and a backend's /metrics is input from another
machine. This one is a line-by-line scan with possessive regular expressions, linear in the text,
bounded up front (`MAX_TEXT_CHARS`, `MAX_LINES`, `MAX_SAMPLES`), and strict: any malformed line
refuses the whole scrape, as Prometheus itself would.

A number the router would act on is never passed on unchecked ("lies" are refused): NaN or infinite
values, negative counts, absurd queues, KV usage outside [0, 1], negative counters, more accepted than
drafted tokens, the same series twice. Error messages name the metric and the problem, and quote at
most `QUOTE_CHARS` characters of what the server sent.

Several label sets of one metric (vLLM's engines, SGLang's ranks, specgate's models) are combined:
counts and counters add up; KV usage is the fullest engine's (a sum of shares is not a share, and a
mean would let one process's stale 0 hide a full one); SGLang's mean acceptance length is averaged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "MAX_LINES",
    "MAX_SAMPLES",
    "MAX_TEXT_CHARS",
    "ScrapeError",
    "ScrapedLoad",
    "parse_metrics",
]

MAX_TEXT_CHARS = 4 * 1024 * 1024  # a real server's /metrics is tens to hundreds of KiB
MAX_LINES = 100_000  # comments and blank lines included
MAX_SAMPLES = 20_000
MAX_REQUESTS = 1_000_000  # running or waiting, summed over label sets
MAX_COUNTER = float(2**53)  # beyond this a float counter no longer counts in ones
MAX_ACCEPT_LENGTH = 1_000.0  # tokens per verification step; real ones are under ~20
KV_ROUNDING = 1e-6  # a KV share up to 1 + this is rounding, clamped to 1
ACCEPT_ROUNDING = 1e-6  # relative: accepted tokens may exceed drafted by this much (printed precision)
QUOTE_CHARS = 64


class ScrapeError(ValueError):
    """The text is refused; the message says what was wrong (metric and problem, never the whole text)."""


@dataclass(frozen=True, slots=True)
class ScrapedLoad:
    source: str  # "vllm" | "sglang" | "llama.cpp" | "specgate"
    num_running: int  # requests being decoded now
    num_waiting: int  # requests queued for a batch slot
    kv_cache_usage: float | None  # share of KV cache in use, [0, 1]; None if not reported
    # Cumulative speculation counters since the server started (None: it reports none, i.e. it does
    # not speculate or does not say). Monotonic counters; the caller takes deltas.
    spec_drafts: float | None
    spec_draft_tokens: float | None
    spec_accepted_tokens: float | None
    # Mean tokens per verification step, where the server reports only that gauge (SGLang); None
    # elsewhere. Not cumulative: the server's own recent average.
    accept_length: float | None = None

    @property
    def speculative(self) -> bool | None:
        """True if it reports drafted tokens (or, SGLang, a mean acceptance length over 1); False if its
        counters say nothing was drafted yet (speculation off, or not used since it started); None if
        it does not say."""
        if self.spec_draft_tokens is not None:
            return self.spec_draft_tokens > 0
        if self.accept_length is not None and self.accept_length > 1:
            return True
        return None


@dataclass(frozen=True, slots=True)
class _Source:
    name: str
    running: str
    waiting: str
    kv: tuple[str, ...]  # the first one present is read
    # Counters by their name without `_total` (read as `<name>_total`, or `<name>` if a server wrote
    # it so); None: this server has no such counter.
    drafts: str | None = None
    draft_tokens: str | None = None
    accepted_tokens: str | None = None
    accept_length: str | None = None  # a gauge

    @property
    def identifying(self) -> tuple[str, ...]:
        return (self.running, self.waiting, *self.kv)

    @property
    def gauges(self) -> tuple[str, ...]:
        return tuple(n for n in (self.running, self.waiting, *self.kv, self.accept_length) if n)

    @property
    def counters(self) -> tuple[str, ...]:
        return tuple(n for n in (self.drafts, self.draft_tokens, self.accepted_tokens) if n)


# Detection order: the first source with any of its identifying names present.
_SOURCES = (
    _Source(
        "vllm",
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        # gpu_cache_usage_perc: the name before 0.9 (a fraction despite the name), hidden since.
        kv=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        drafts="vllm:spec_decode_num_drafts",
        draft_tokens="vllm:spec_decode_num_draft_tokens",
        accepted_tokens="vllm:spec_decode_num_accepted_tokens",
    ),
    _Source(
        "sglang",
        running="sglang:num_running_reqs",
        waiting="sglang:num_queue_reqs",
        kv=("sglang:token_usage",),
        accept_length="sglang:spec_accept_length",
    ),
    _Source(
        "llama.cpp",
        running="llamacpp:requests_processing",
        waiting="llamacpp:requests_deferred",
        kv=("llamacpp:kv_cache_usage_ratio",),  # older builds only; current ones do not report it
        drafts="llamacpp:spec_decode_num_drafts",  # newer builds; 0 while speculation is off
        draft_tokens="llamacpp:spec_decode_num_draft_tokens",
        accepted_tokens="llamacpp:spec_decode_num_accepted_tokens",
    ),
    _Source(
        "specgate",
        running="specgate_in_flight_requests",
        waiting="specgate_engine_queue_depth",
        kv=("specgate_engine_kv_usage",),
        # Tokens drafted and accepted for the requests it served, by model and method; it has no
        # count of drafts (verification steps).
        draft_tokens="specgate_spec_draft_tokens",
        accepted_tokens="specgate_spec_accepted_tokens",
    ),
)

_GAUGE_TYPES = frozenset({"gauge", "untyped", "unknown"})
_COUNTER_TYPES = frozenset({"counter", "untyped", "unknown"})
_KNOWN_TYPES = frozenset(
    {"counter", "gauge", "histogram", "summary", "untyped", "unknown", "gaugehistogram", "stateset", "info"}
)


def _wanted() -> dict[str, str]:
    """Every sample name read, mapped to the metric name that errors and TYPE lines use."""
    out: dict[str, str] = {}
    for src in _SOURCES:
        for gauge in src.gauges:
            out[gauge] = gauge
        for counter in src.counters:
            out[counter] = counter
            out[counter + "_total"] = counter
    return out


_WANTED = _wanted()

# The text format (0.0.4, and what OpenMetrics adds that a server may send: exemplars). Possessive
# quantifiers: no backtracking, so matching is linear in the line whatever it holds.
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*+"
_LABEL = r"[ \t]*+[a-zA-Z_][a-zA-Z0-9_]*+[ \t]*+=[ \t]*+\"(?:[^\"\\]++|\\.)*+\"[ \t]*+"
_FLOAT = r"[+-]?+(?:(?:[0-9]++(?:\.[0-9]*+)?+|\.[0-9]++)(?:[eE][+-]?+[0-9]++)?+|(?i:inf(?:inity)?+|nan))"
_SAMPLE = re.compile(
    rf"(?P<name>{_NAME})"
    rf"(?:[ \t]*+\{{(?P<labels>(?:{_LABEL},)*+(?:{_LABEL})?+)[ \t]*+\}})?+"
    rf"[ \t]++(?P<value>{_FLOAT})"
    rf"(?:[ \t]++{_FLOAT})?+"  # timestamp
    r"[ \t]*+(?:#.*+)?+",  # exemplar
    re.ASCII,
)
_LABEL_PAIR = re.compile(
    r"[ \t]*+([a-zA-Z_][a-zA-Z0-9_]*+)[ \t]*+=[ \t]*+\"((?:[^\"\\]++|\\.)*+)\"", re.ASCII
)
_TYPE = re.compile(rf"#[ \t]*+TYPE[ \t]++({_NAME})[ \t]++([a-z]++)[ \t]*+", re.ASCII)
_HELP = re.compile(rf"#[ \t]*+HELP[ \t]++{_NAME}(?:[ \t].*+)?+", re.ASCII)

_LabelKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class _Sample:
    value: float
    text: str  # the value as written, for messages


@dataclass(slots=True)
class _Parsed:
    samples: dict[str, dict[_LabelKey, _Sample]]  # by sample name, only the names in _WANTED
    types: dict[str, str]  # TYPE lines of the names in _WANTED (and their `_total` forms)
    seen: set[str]  # names in _WANTED that appear in a sample or a TYPE line


def parse_metrics(text: str) -> ScrapedLoad:
    """Read one scrape of a backend's /metrics. Raises ScrapeError (and nothing else) if the text is
    too big, malformed, from no known server, or holds a value that cannot be true."""
    if not isinstance(text, str):
        raise ScrapeError(f"metrics text must be str, not {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise ScrapeError(f"metrics text of {len(text)} characters, over {MAX_TEXT_CHARS}")
    if text.count("\n") >= MAX_LINES:
        raise ScrapeError(f"metrics text of more than {MAX_LINES} lines")
    parsed = _parse(text.removeprefix("\ufeff"))
    for src in _SOURCES:
        if any(name in parsed.seen for name in src.identifying):
            return _read(src, parsed)
    raise ScrapeError("no known load metrics")


def _parse(text: str) -> _Parsed:
    parsed = _Parsed(samples={}, types={}, seen=set())
    n_samples = 0
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip(" \t\r")
        if not line:
            continue
        if line[0] == "#":
            _comment(number, line, parsed)
            continue
        n_samples += 1
        if n_samples > MAX_SAMPLES:
            raise ScrapeError(f"more than {MAX_SAMPLES} samples")
        m = _SAMPLE.fullmatch(line)
        if m is None:
            raise ScrapeError(f"line {number}: malformed sample {_quote(line)}")
        name = m["name"]
        if name not in _WANTED:
            continue
        parsed.seen.add(name)
        key = _label_key(number, name, m["labels"] or "")
        series = parsed.samples.setdefault(name, {})
        if key in series:
            raise ScrapeError(f"{_WANTED[name]}: the same series twice ({_quote(_render(name, key))})")
        value_text = m["value"]
        series[key] = _Sample(float(value_text), value_text)
    return parsed


def _comment(number: int, line: str, parsed: _Parsed) -> None:
    words = line[1:].split(None, 1)
    kind = words[0] if words else ""
    if kind == "TYPE":
        m = _TYPE.fullmatch(line)
        if m is None or m[2] not in _KNOWN_TYPES:
            raise ScrapeError(f"line {number}: malformed TYPE line {_quote(line)}")
        name, typ = m[1], m[2]
        if name in _WANTED:
            metric = _WANTED[name]
            if metric in parsed.types:
                raise ScrapeError(f"{metric}: TYPE given twice")
            parsed.types[metric] = typ
            parsed.seen.add(name)
    elif kind == "HELP" and _HELP.fullmatch(line) is None:
        raise ScrapeError(f"line {number}: malformed HELP line {_quote(line)}")
    # Other comments (and OpenMetrics' UNIT and EOF) say nothing this module reads.


def _label_key(number: int, name: str, labels: str) -> _LabelKey:
    pairs: dict[str, str] = {}
    for label, value in _LABEL_PAIR.findall(labels):
        if label in pairs:
            raise ScrapeError(f"line {number}: {_WANTED[name]} repeats the label {_quote(label)}")
        pairs[label] = value  # still escaped: equal series are equal as written
    return tuple(sorted(pairs.items()))


def _read(src: _Source, parsed: _Parsed) -> ScrapedLoad:
    for gauge in src.gauges:
        _check_type(parsed, gauge, _GAUGE_TYPES)
    for counter in src.counters:
        _check_type(parsed, counter, _COUNTER_TYPES)
    running = _count(parsed, src.running)
    waiting = _count(parsed, src.waiting)
    if src.name == "specgate":
        # Its in-flight gauge counts every request it holds, its queue included.
        running = max(0, running - waiting)
    kv_usage = next((_share(parsed, n) for n in src.kv if _gauge(parsed, n)), None)
    drafts = _counter(parsed, src.drafts)
    draft_tokens = _counter(parsed, src.draft_tokens)
    accepted = _counter(parsed, src.accepted_tokens)
    if (
        draft_tokens is not None
        and accepted is not None
        and accepted - draft_tokens > ACCEPT_ROUNDING * max(draft_tokens, 1.0)
    ):
        raise ScrapeError(
            f"{src.accepted_tokens} ({_fmt(accepted)}) exceeds {src.draft_tokens} ({_fmt(draft_tokens)})"
        )
    return ScrapedLoad(
        source=src.name,
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=kv_usage,
        spec_drafts=drafts,
        spec_draft_tokens=draft_tokens,
        spec_accepted_tokens=accepted,
        accept_length=_accept_length(parsed, src.accept_length),
    )


def _check_type(parsed: _Parsed, metric: str, allowed: frozenset[str]) -> None:
    typ = parsed.types.get(metric)
    if typ is not None and typ not in allowed:
        expected = "counter" if "counter" in allowed else "gauge"
        raise ScrapeError(f"{metric} is declared {typ}, not {expected}")


def _gauge(parsed: _Parsed, name: str) -> list[_Sample]:
    return list(parsed.samples.get(name, {}).values())


def _finite(metric: str, samples: list[_Sample]) -> Iterator[_Sample]:
    for s in samples:
        if math.isnan(s.value):
            raise ScrapeError(f"{metric} is NaN")
        if math.isinf(s.value):
            raise ScrapeError(f"{metric} is not finite ({_quote(s.text)})")
        yield s


def _sum(metric: str, samples: list[_Sample]) -> float:
    """The label sets' sum of a count that cannot be negative."""
    total = 0.0
    for s in _finite(metric, samples):
        if s.value < 0:
            raise ScrapeError(f"{metric} is negative ({_quote(s.text)})")
        total += s.value
    return total


def _count(parsed: _Parsed, metric: str) -> int:
    samples = _gauge(parsed, metric)
    if not samples:
        raise ScrapeError(f"{metric} is missing")
    total = _sum(metric, samples)
    if total > MAX_REQUESTS:
        raise ScrapeError(f"{metric} is {_fmt(total)}, over {MAX_REQUESTS}")
    return round(total)


def _share(parsed: _Parsed, metric: str) -> float:
    samples = _gauge(parsed, metric)
    for s in _finite(metric, samples):
        if not 0.0 <= s.value <= 1.0 + KV_ROUNDING:
            raise ScrapeError(f"{metric} is {_quote(s.text)}, outside [0, 1]")
    # The fullest engine's share, not the mean: a stale 0 from one process (vLLM's API servers
    # each export it) must not make a nearly full server look free.
    return min(max(s.value for s in samples), 1.0)


def _counter(parsed: _Parsed, metric: str | None) -> float | None:
    if metric is None:
        return None
    name = metric + "_total" if metric + "_total" in parsed.samples else metric
    samples = _gauge(parsed, name)
    if not samples:
        return None
    total = _sum(metric, samples)
    if total > MAX_COUNTER:
        raise ScrapeError(f"{metric} is {_fmt(total)}, over 2**53")
    return total


def _accept_length(parsed: _Parsed, metric: str | None) -> float | None:
    """The mean over the label sets (ranks) that report one; 0.0 if none does (not speculating)."""
    if metric is None:
        return None
    samples = _gauge(parsed, metric)
    if not samples:
        return None
    for s in _finite(metric, samples):
        if not 0.0 <= s.value <= MAX_ACCEPT_LENGTH:
            raise ScrapeError(f"{metric} is {_quote(s.text)}, outside [0, {MAX_ACCEPT_LENGTH:g}]")
    reported = [s.value for s in samples if s.value > 0]
    return math.fsum(reported) / len(reported) if reported else 0.0


def _render(name: str, key: _LabelKey) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in key) + "}"


def _fmt(value: float) -> str:
    return f"{value:.12g}"


def _quote(text: str) -> str:
    """At most QUOTE_CHARS characters of what the server sent, escaped (no control characters)."""
    if len(text) > QUOTE_CHARS:
        return repr(text[:QUOTE_CHARS]) + "..."
    return repr(text)
