"""Model resolution: directories, GGUF files, the embedded default; local files only."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgate.engine.loader import ModelNotFoundError, resolve_model


def test_hf_directory(tiny_llama_dir: Path) -> None:
    src = resolve_model(str(tiny_llama_dir))
    assert src.directory == tiny_llama_dir and src.gguf_file is None


def test_gguf_file_and_directory_with_one_gguf(tmp_path: Path) -> None:
    f = tmp_path / "m.Q4.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)).gguf_file == "m.Q4.gguf"
    assert resolve_model(str(tmp_path)).gguf_file == "m.Q4.gguf"
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="gguf_file"):
        resolve_model(str(tmp_path))
    assert resolve_model(str(tmp_path), gguf_file="other.gguf").gguf_file == "other.gguf"
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(tmp_path), gguf_file="missing.gguf")


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="neither"):
        resolve_model(str(tmp_path / "nope"))
