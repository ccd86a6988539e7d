"""The profiler's client against the real stub backend: it reads whole answers and refuses others."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgate.bench import gateway_targets as gt
from specgate.bench.profile_gateway import BODY, RawClient, print_top_frames, quantile


def test_the_raw_client_reads_whole_answers_on_one_connection(tmp_path: Path) -> None:
    stub = gt.start_stub(tmp_path)
    try:
        client = RawClient(stub.url, BODY)
        times = [client.call() for _ in range(20)]  # one kept-alive connection throughout
        assert all(0 < t < 5 for t in times)
        client.close()
        bad = RawClient(stub.url, {"model": "nope", "messages": "not a list"})
        bad.request = bad.request.replace(b"/v1/chat/completions", b"/v1/nowhere")
        with pytest.raises(RuntimeError, match="unexpected answer"):
            bad.call()
        bad.close()
    finally:
        stub.stop()


def test_quantile() -> None:
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.5) == 51.0
    assert quantile(values, 0.99) == 100.0 and quantile(values, 1.0) == 100.0


def test_top_frames_count_each_sample_once_per_frame(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stacks = tmp_path / "stacks.txt"
    # A recursive frame appears twice on one stack and still counts that stack's samples once.
    stacks.write_text("main;handle;send 30\nmain;handle;handle;parse 10\nmain;idle 60\nnot a stack line\n")
    print_top_frames(stacks, top=3)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("100 samples")
    assert [line.split()[0] for line in lines[1:]] == ["100.0%", "60.0%", "40.0%"]
    assert [line.split()[1] for line in lines[1:]] == ["main", "idle", "handle"]
