"""`specgate generate` streams text from an engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main


def test_generate_streams_text_and_reports_stats(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_llama_dir),
            "--raw",
            "--max-tokens",
            "12",
            "--dtype",
            "float32",
            "Hi",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0
    assert len(out.out.strip("\n")) > 0
    assert "tokens in" in out.err and "finish_reason=" in out.err


def test_generate_bad_model_path_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(tmp_path / "missing"), "hello"])
    assert rc == 2
    assert "error" in capsys.readouterr().err


def test_generate_with_speculation_reports_acceptance(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--model", str(tiny_llama_dir), "--raw", "--dtype", "float32", "--max-tokens", "30"]
    rc = main([*argv, "--spec", "ngram", "--spec-controller", "static", "Hi"])
    assert rc == 0
    assert "ngram:" in capsys.readouterr().err


def test_generate_unknown_speculation_method_is_a_clean_error(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["generate", "--model", str(tiny_llama_dir), "--raw", "--spec", "telepathy", "Hi"])
    assert rc == 2
    assert "unknown speculation method" in capsys.readouterr().err
