"""parse_metrics: /metrics texts of vLLM, SGLang, llama.cpp and specgate read into a ScrapedLoad; lies,
malformed and oversized texts refused with a ScrapeError that says what was wrong, and nothing else
ever raised (fuzzed)."""

from __future__ import annotations

import dataclasses
import math
import re
import time
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from specgate.gateway.backends.upstream.scrape import (
    MAX_LINES,
    MAX_SAMPLES,
    MAX_TEXT_CHARS,
    QUOTE_CHARS,
    ScrapedLoad,
    ScrapeError,
    parse_metrics,
)
from specgate.gateway.telemetry.metrics import Metrics
from specgate.gateway.telemetry.records import RequestRecord

FIXTURES = Path(__file__).parent / "metrics_fixtures"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def refused(text: str) -> str:
    with pytest.raises(ScrapeError) as info:
        parse_metrics(text)
    return str(info.value)


# --- real servers' texts ------------------------------------------------------------------------


EXPECTED = {
    # Two data-parallel engines: counts add up, KV usage is the fuller one's; histograms (one named
    # ..._total), _created gauges and process metrics are ignored.
    "vllm_v1.txt": ScrapedLoad("vllm", 21, 3, 0.62, None, None, None),
    "vllm_spec.txt": ScrapedLoad("vllm", 4, 0, 0.1825, 5120.0, 15360.0, 9871.0),
    "vllm_old.txt": ScrapedLoad("vllm", 6, 2, 0.3543, None, None, None),
    # Two DP ranks; num_running_reqs_offline_batch is another metric and not counted.
    "sglang.txt": ScrapedLoad("sglang", 12, 3, 0.31, None, None, None, accept_length=3.0),
    "llamacpp.txt": ScrapedLoad("llama.cpp", 3, 5, None, 1024.0, 4096.0, 2710.0),
    # Rendered from this project's Metrics (in flight 7, of which 3 queued; three model/method series).
    "specgate.txt": ScrapedLoad("specgate", 4, 3, 0.4375, None, 156.0, 83.0),
}
SPECULATIVE = {
    "vllm_v1.txt": None,
    "vllm_spec.txt": True,
    "vllm_old.txt": None,
    "sglang.txt": True,
    "llamacpp.txt": True,
    "specgate.txt": True,
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_reads_as_expected(name: str) -> None:
    load = parse_metrics(fixture(name))
    expected = EXPECTED[name]
    assert dataclasses.replace(load, kv_cache_usage=None) == dataclasses.replace(
        expected, kv_cache_usage=None
    )
    if expected.kv_cache_usage is None:
        assert load.kv_cache_usage is None
    else:
        assert load.kv_cache_usage == pytest.approx(expected.kv_cache_usage)
    assert load.speculative is SPECULATIVE[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_values_agree_with_prometheus_client(name: str) -> None:
    """The same sums as prometheus_client's own parser gives, for every name read (a check of this
    module's parser on real texts; the module does not use that parser because it is quadratic)."""
    text = fixture(name)
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    load = parse_metrics(text)
    names = {
        "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
        "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
        "llama.cpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
        "specgate": ("specgate_in_flight_requests", "specgate_engine_queue_depth"),
    }[load.source]
    running, waiting = (round(sums[n]) for n in names)
    if load.source == "specgate":
        running -= waiting  # its in-flight gauge holds its queue too
    assert (load.num_running, load.num_waiting) == (running, waiting)
    counters = {
        "vllm": "vllm:spec_decode_num_draft_tokens_total",
        "llama.cpp": "llamacpp:spec_decode_num_draft_tokens_total",
        "specgate": "specgate_spec_draft_tokens_total",
    }
    if load.source in counters:
        assert load.spec_draft_tokens == sums.get(counters[load.source])


def _render_specgate(records: list[RequestRecord]) -> str:
    m = Metrics()
    m.models = lambda: {"m": None}
    for rec in records:
        m.observe(rec)
    m.watch_writer(
        types.SimpleNamespace(
            queued=1, written=1, spooled=0, replayed=0, dropped=0, db_errors=0, quarantined=0, spool_backlog=0
        ),
        lambda: 0,
    )
    return m.render().decode()


def test_specgate_metrics_as_rendered_now() -> None:
    """Against the live registry, not only the fixture: a rename in telemetry/metrics.py fails here."""
    idle = parse_metrics(_render_specgate([]))
    assert idle == ScrapedLoad("specgate", 0, 0, 0.0, None, None, None)
    assert idle.speculative is None  # no speculative request served yet: the counters have no series
    now = time.time()
    spec = {"method": "eagle", "num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 7}
    rec = RequestRecord(
        "r", "chat", "m", arrival_time=now, stream=False, status=200, spec_decoding=spec, finished_time=now
    )
    load = parse_metrics(_render_specgate([rec, rec]))
    assert (load.spec_draft_tokens, load.spec_accepted_tokens, load.spec_drafts) == (24.0, 14.0, None)
    assert load.speculative is True


# --- what each server may also send --------------------------------------------------------------


def test_untyped_minimal_text() -> None:
    load = parse_metrics("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n")
    assert load == ScrapedLoad("vllm", 1, 0, None, None, None, None)


def test_kv_usage_rounding_over_one_is_clamped() -> None:
    text = VLLM_SPEC.replace("} 0.1825", "} 1.0000005")
    assert parse_metrics(text).kv_cache_usage == 1.0


def test_older_llamacpp_with_kv_ratio_and_no_spec_counters() -> None:
    text = (
        "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.25\n"
        "# TYPE llamacpp:kv_cache_tokens gauge\nllamacpp:kv_cache_tokens 2048\n"
        "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 1\n"
        "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 0\n"
    )
    load = parse_metrics(text)
    assert load == ScrapedLoad("llama.cpp", 1, 0, 0.25, None, None, None)
    assert load.speculative is None


def test_llamacpp_with_speculation_off_is_not_speculative() -> None:
    text = re.sub(
        r"^(llamacpp:spec_decode_num_[a-z_]+_total) [0-9]+$", r"\1 0", fixture("llamacpp.txt"), flags=re.M
    )
    load = parse_metrics(text)
    assert (load.spec_drafts, load.spec_draft_tokens, load.spec_accepted_tokens) == (0.0, 0.0, 0.0)
    assert load.speculative is False


def test_sglang_without_speculation() -> None:
    text = fixture("sglang.txt").replace("} 3.1\n", "} 0.0\n").replace("} 2.9\n", "} 0.0\n")
    load = parse_metrics(text)
    assert load.accept_length == 0.0 and load.speculative is None


def test_sglang_accept_length_is_the_mean_of_the_ranks_that_report_one() -> None:
    text = fixture("sglang.txt").replace("} 2.9\n", "} 0.0\n")
    assert parse_metrics(text).accept_length == pytest.approx(3.1)


def test_counter_written_without_total_suffix() -> None:
    text = (
        "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\n"
        "# TYPE vllm:spec_decode_num_draft_tokens counter\nvllm:spec_decode_num_draft_tokens 30\n"
        "# TYPE vllm:spec_decode_num_accepted_tokens counter\nvllm:spec_decode_num_accepted_tokens 12\n"
    )
    load = parse_metrics(text)
    assert (load.spec_draft_tokens, load.spec_accepted_tokens, load.spec_drafts) == (30.0, 12.0, None)


def test_openmetrics_style_text() -> None:
    """Counter TYPE without _total, exemplars, timestamps, UNIT and EOF lines, CRLF and blanks."""
    text = (
        "# TYPE vllm:num_requests_running gauge\r\n"
        'vllm:num_requests_running{engine="0"} 3 1753120441000\r\n'
        "\r\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        "# UNIT vllm:num_requests_waiting requests\n"
        'vllm:num_requests_waiting{engine="0"} 1.0e0\n'
        "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
        'vllm:spec_decode_num_draft_tokens_total{engine="0"} 9 # {trace_id="abc"} 1.0 1753120441.0\n'
        'vllm:spec_decode_num_draft_tokens_created{engine="0"} 1753120000.0\n'
        "# EOF\n"
    )
    load = parse_metrics(text)
    assert (load.num_running, load.num_waiting, load.spec_draft_tokens) == (3, 1, 9.0)


def test_label_values_with_escapes_and_odd_characters() -> None:
    text = (
        'vllm:num_requests_running{model_name="a\\"b\\\\c\\nd } { , = # é 模型",engine="0"} 2\n'
        'vllm:num_requests_running { model_name = "x" , engine = "1" , } 3\n'
        "vllm:num_requests_waiting{} 0\n"
    )
    assert parse_metrics(text).num_running == 5


def test_detection_order_prefers_vllm() -> None:
    text = fixture("specgate.txt") + fixture("vllm_spec.txt")
    assert parse_metrics(text).source == "vllm"


def test_leading_byte_order_mark_is_ignored() -> None:
    assert parse_metrics("\ufeff" + fixture("llamacpp.txt")).source == "llama.cpp"


def test_snapshot_is_frozen_and_slotted() -> None:
    load = parse_metrics(fixture("vllm_spec.txt"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        load.num_running = 0  # type: ignore[misc]
    assert not hasattr(load, "__dict__")


# --- refused: lies ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("hostile_nan.txt", "vllm:num_requests_running is NaN"),
        ("hostile_negative.txt", "sglang:num_queue_reqs is negative ('-4.0')"),
        ("hostile_absurd.txt", "llamacpp:requests_deferred is 4200000000, over 1000000"),
    ],
)
def test_hostile_fixtures_are_refused(name: str, fragment: str) -> None:
    assert fragment in refused(fixture(name))


VLLM_SPEC = fixture("vllm_spec.txt")
RUNNING = 'vllm:num_requests_running{model_name="Qwen/Qwen3-8B",engine="0"} 4.0'
WAITING = 'vllm:num_requests_waiting{model_name="Qwen/Qwen3-8B",engine="0"} 0.0'
KV = 'vllm:kv_cache_usage_perc{model_name="Qwen/Qwen3-8B",engine="0"} 0.1825'
DRAFTS = 'vllm:spec_decode_num_drafts_total{model_name="Qwen/Qwen3-8B",engine="0"} 5120.0'
DRAFT_TOKENS = 'vllm:spec_decode_num_draft_tokens_total{model_name="Qwen/Qwen3-8B",engine="0"} 15360.0'
ACCEPTED = 'vllm:spec_decode_num_accepted_tokens_total{model_name="Qwen/Qwen3-8B",engine="0"} 9871.0'


def _with(old: str, new: str, text: str = VLLM_SPEC) -> str:
    assert old in text
    return text.replace(old, new)


@pytest.mark.parametrize(
    ("old", "new", "fragment"),
    [
        (RUNNING, RUNNING.replace("4.0", "+Inf"), "vllm:num_requests_running is not finite ('+Inf')"),
        (WAITING, WAITING.replace("0.0", "-Inf"), "vllm:num_requests_waiting is not finite ('-Inf')"),
        (WAITING, WAITING.replace("0.0", "nan"), "vllm:num_requests_waiting is NaN"),
        (RUNNING, RUNNING.replace("4.0", "-1"), "vllm:num_requests_running is negative ('-1')"),
        (RUNNING, RUNNING.replace("4.0", "1000001"), "vllm:num_requests_running is 1000001, over 1000000"),
        (RUNNING, RUNNING.replace("4.0", "1e400"), "vllm:num_requests_running is not finite ('1e400')"),
        (RUNNING, "", "vllm:num_requests_running is missing"),
        (WAITING, "", "vllm:num_requests_waiting is missing"),
        (KV, KV.replace("0.1825", "1.5"), "vllm:kv_cache_usage_perc is '1.5', outside [0, 1]"),
        (KV, KV.replace("0.1825", "-0.01"), "vllm:kv_cache_usage_perc is '-0.01', outside [0, 1]"),
        (KV, KV.replace("0.1825", "18.25"), "vllm:kv_cache_usage_perc is '18.25', outside [0, 1]"),
        (KV, KV.replace("0.1825", "NaN"), "vllm:kv_cache_usage_perc is NaN"),
        (DRAFTS, DRAFTS.replace("5120.0", "NaN"), "vllm:spec_decode_num_drafts is NaN"),
        (DRAFTS, DRAFTS.replace("5120.0", "-5"), "vllm:spec_decode_num_drafts is negative ('-5')"),
        (
            DRAFT_TOKENS,
            DRAFT_TOKENS.replace("15360.0", "Inf"),
            "vllm:spec_decode_num_draft_tokens is not finite",
        ),
        (
            DRAFT_TOKENS,
            DRAFT_TOKENS.replace("15360.0", "1e300"),
            "vllm:spec_decode_num_draft_tokens is 1e+300",
        ),
        (
            ACCEPTED,
            ACCEPTED.replace("9871.0", "15361"),
            "vllm:spec_decode_num_accepted_tokens (15361) exceeds vllm:spec_decode_num_draft_tokens (15360)",
        ),
        (RUNNING, RUNNING + "\n" + RUNNING, "vllm:num_requests_running: the same series twice"),
        (
            RUNNING,
            RUNNING
            + "\n"
            + RUNNING.replace(
                'model_name="Qwen/Qwen3-8B",engine="0"', 'engine="0",model_name="Qwen/Qwen3-8B"'
            ),
            "vllm:num_requests_running: the same series twice",
        ),
        (
            "# TYPE vllm:num_requests_running gauge",
            "# TYPE vllm:num_requests_running gauge\n# TYPE vllm:num_requests_running gauge",
            "vllm:num_requests_running: TYPE given twice",
        ),
        (
            "# TYPE vllm:num_requests_running gauge",
            "# TYPE vllm:num_requests_running histogram",
            "vllm:num_requests_running is declared histogram, not gauge",
        ),
        (
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            "# TYPE vllm:spec_decode_num_drafts_total gauge",
            "vllm:spec_decode_num_drafts is declared gauge, not counter",
        ),
    ],
)
def test_lies_are_refused(old: str, new: str, fragment: str) -> None:
    assert fragment in refused(_with(old, new))


def test_accepted_equal_to_drafted_up_to_printed_precision_is_kept() -> None:
    load = parse_metrics(_with(ACCEPTED, ACCEPTED.replace("9871.0", "15360.01")))
    assert load.spec_accepted_tokens == 15360.01


def test_counts_are_checked_after_summing_label_sets() -> None:
    second = RUNNING.replace('engine="0"', 'engine="1"')
    text = _with(RUNNING, RUNNING.replace("4.0", "600000") + "\n" + second.replace("4.0", "600000"))
    assert "vllm:num_requests_running is 1200000, over 1000000" in refused(text)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("NaN", "sglang:spec_accept_length is NaN"),
        ("-1", "sglang:spec_accept_length is '-1', outside [0, 1000]"),
        ("1e9", "sglang:spec_accept_length is '1e9', outside [0, 1000]"),
    ],
)
def test_sglang_accept_length_lies(value: str, fragment: str) -> None:
    assert fragment in refused(fixture("sglang.txt").replace("} 3.1\n", f"}} {value}\n"))


def test_a_lie_in_a_metric_not_read_is_not_refused() -> None:
    text = fixture("vllm_v1.txt").replace(
        'vllm:num_preemptions_total{model_name="meta-llama/Llama-3.1-8B-Instruct",engine="0"} 4.0',
        'vllm:num_preemptions_total{model_name="meta-llama/Llama-3.1-8B-Instruct",engine="0"} NaN',
    )
    assert parse_metrics(text).num_running == 21


# --- refused: not a known server, malformed, too big ----------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        "# just a comment\n",
        "up 1\nnode_load1 0.3\n",
        # A histogram whose series merely start with a known name is not that metric.
        'vllm:num_requests_running_bucket{le="1"} 3\nvllm:num_requests_running_count 3\n',
    ],
)
def test_no_known_load_metrics(text: str) -> None:
    assert refused(text) == "no known load metrics"


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('vllm:num_requests_running{engine="0" 1', "malformed sample"),
        ('vllm:num_requests_running{engine="0} 1', "malformed sample"),
        ("vllm:num_requests_running{engine=0} 1", "malformed sample"),
        ("vllm:num_requests_running 1 2 3", "malformed sample"),
        ("vllm:num_requests_running", "malformed sample"),
        ("vllm:num_requests_running abc", "malformed sample"),
        ("vllm:num_requests_running 1_000", "malformed sample"),  # float() would take it
        ("vllm:num_requests_running 0x10", "malformed sample"),
        ("vllm:num_requests_running ١", "malformed sample"),  # float() would take it too
        ("vllm:num_requests_running{} 1{}", "malformed sample"),
        ('{"vllm:num_requests_running"} 1', "malformed sample"),
        ("1vllm 1", "malformed sample"),
        ("vllm.num_requests_running 1", "malformed sample"),
        ("# TYPE vllm:num_requests_running", "malformed TYPE line"),
        ("# TYPE vllm:num_requests_running sometype", "malformed TYPE line"),
        ("# TYPE vllm.num gauge", "malformed TYPE line"),
        ("# HELP", "malformed HELP line"),
        ("# HELP 9x doc", "malformed HELP line"),
        ('vllm:num_requests_running{a="1",a="2"} 1', "repeats the label 'a'"),
    ],
)
def test_malformed_text_is_refused(line: str, fragment: str) -> None:
    message = refused(VLLM_SPEC + line + "\n")
    assert fragment in message and message.startswith("line 46:")


def test_messages_quote_little_of_what_was_sent() -> None:
    line = "vllm:num_requests_running{" + "x" * 100_000
    message = refused(line)
    assert "malformed sample" in message and len(message) < QUOTE_CHARS + 60
    huge = "9" * 300
    message = refused(_with(KV, KV.replace("0.1825", huge)))
    assert "outside [0, 1]" in message and len(message) < QUOTE_CHARS + 80


def test_size_caps() -> None:
    assert "over 4194304" in refused("#" * (MAX_TEXT_CHARS + 1))
    assert f"more than {MAX_LINES} lines" in refused("\n" * MAX_LINES)
    samples = "".join(f'other{{i="{i}"}} 1\n' for i in range(MAX_SAMPLES + 1))
    assert f"more than {MAX_SAMPLES} samples" in refused(samples)
    with pytest.raises(ScrapeError, match="must be str"):
        parse_metrics(b"vllm:num_requests_running 1\n")  # type: ignore[arg-type]


def test_hostile_label_values_cost_linear_time() -> None:
    """prometheus_client's parser takes about a minute on the first of these (2 MB of escaped quotes)."""
    escaped = 'vllm:num_requests_running{a="' + '\\"' * 1_000_000 + '"} 1\nvllm:num_requests_waiting 0\n'
    many_labels = "other{" + ",".join(f'a{i}="x"' for i in range(150_000)) + "} 1\n"
    unclosed = 'other{a="' + "\\" * 3_000_000 + "\n"
    start = time.perf_counter()
    assert parse_metrics(escaped).num_running == 1
    assert refused(many_labels + "vllm:num_requests_running 1\n") == "vllm:num_requests_waiting is missing"
    assert "malformed sample" in refused(unclosed)
    assert time.perf_counter() - start < 3.0


def test_a_full_size_realistic_text_parses_quickly() -> None:
    bucket = (
        'vllm:time_to_first_token_seconds_bucket{model_name="' + "m" * 100 + '",engine="0",le="%d"} 1.0\n'
    )
    text = "".join(bucket % i for i in range(MAX_SAMPLES - 2))
    text += RUNNING + "\n" + WAITING + "\n"
    assert len(text) < MAX_TEXT_CHARS
    start = time.perf_counter()
    assert parse_metrics(text).num_running == 4
    assert time.perf_counter() - start < 2.0


# --- fuzz: ScrapeError or a sound snapshot, never anything else ---------------------------------


def _sound(load: ScrapedLoad) -> None:
    assert load.source in ("vllm", "sglang", "llama.cpp", "specgate")
    assert isinstance(load.num_running, int) and 0 <= load.num_running <= 1_000_000
    assert isinstance(load.num_waiting, int) and 0 <= load.num_waiting <= 1_000_000
    assert load.kv_cache_usage is None or 0.0 <= load.kv_cache_usage <= 1.0
    for counter in (load.spec_drafts, load.spec_draft_tokens, load.spec_accepted_tokens, load.accept_length):
        assert counter is None or (math.isfinite(counter) and counter >= 0)
    if load.spec_draft_tokens is not None and load.spec_accepted_tokens is not None:
        assert load.spec_accepted_tokens <= load.spec_draft_tokens * (1 + 1e-6) + 1e-6


def _parse_or_refuse(text: str) -> None:
    try:
        load = parse_metrics(text)
    except ScrapeError as exc:
        assert str(exc) and len(str(exc)) < 300
    else:
        _sound(load)


GOOD = sorted(EXPECTED)
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.text(max_size=400))
def test_fuzz_random_text(text: str) -> None:
    _parse_or_refuse(text)


@FUZZ
@given(st.binary(max_size=400), st.sampled_from(["utf-8", "latin-1"]))
def test_fuzz_random_bytes(data: bytes, encoding: str) -> None:
    _parse_or_refuse(data.decode(encoding, errors="replace"))


@FUZZ
@given(st.sampled_from(GOOD), st.floats(0, 1))
def test_fuzz_truncated(name: str, where: float) -> None:
    text = fixture(name)
    _parse_or_refuse(text[: int(len(text) * where)])


@FUZZ
@given(st.sampled_from(GOOD), st.floats(0, 1), st.text(min_size=1, max_size=20))
def test_fuzz_inserted(name: str, where: float, junk: str) -> None:
    text = fixture(name)
    at = int(len(text) * where)
    _parse_or_refuse(text[:at] + junk + text[at:])


@FUZZ
@given(st.sampled_from(GOOD), st.data())
def test_fuzz_duplicated_and_dropped_lines(name: str, data: st.DataObject) -> None:
    lines = fixture(name).split("\n")
    i = data.draw(st.integers(0, len(lines) - 1))
    j = data.draw(st.integers(0, len(lines) - 1))
    lines.insert(j, lines[i])
    if data.draw(st.booleans()):
        del lines[data.draw(st.integers(0, len(lines) - 1))]
    _parse_or_refuse("\n".join(lines))


@FUZZ
@given(
    st.sampled_from(GOOD),
    st.sampled_from(["NaN", "+Inf", "-Inf", "-1", "1e308", "1.0000001", "2", "0", "-0", "1e7"]),
    st.integers(0, 10_000),
)
def test_fuzz_replaced_values(name: str, value: str, which: int) -> None:
    lines = fixture(name).split("\n")
    samples = [i for i, line in enumerate(lines) if line and not line.startswith("#")]
    i = samples[which % len(samples)]
    lines[i] = lines[i].rsplit(" ", 1)[0] + " " + value
    _parse_or_refuse("\n".join(lines))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@FUZZ
@given(
    st.lists(st.text(max_size=30), min_size=1, max_size=5, unique=True),
    st.lists(st.integers(0, 1000), min_size=5, max_size=5),
)
def test_fuzz_label_values_round_trip(models: list[str], counts: list[int]) -> None:
    """Any label value, escaped as the format says, is read; series with distinct values all count."""
    lines = ["# TYPE sglang:num_running_reqs gauge"]
    lines += [
        f'sglang:num_running_reqs{{model_name="{_escape(m)}"}} {c}'
        for m, c in zip(models, counts[: len(models)], strict=True)
    ]
    lines.append("sglang:num_queue_reqs 0")
    load = parse_metrics("\n".join(lines) + "\n")
    assert load.num_running == sum(counts[: len(models)])
