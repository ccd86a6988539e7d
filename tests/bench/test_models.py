"""What benchmarks read of a model: the GGUF file of a --model, its end-of-generation ids and its
chat template (small files written here; no model is fetched)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from gguf import GGUFWriter

from specgate.bench import models


def write_gguf(path: Path, template: str | None = None) -> Path:
    w = GGUFWriter(str(path), "llama")
    w.add_token_list(["<|endoftext|>", "a", "<|im_end|>", "</s>", "<|im_start|>"])
    w.add_token_types([3, 1, 3, 1, 3])  # "</s>" as a normal token is text, not an end
    w.add_eos_token_id(2)
    if template:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_path_takes_a_gguf_file_or_a_folder_with_one(tmp_path: Path) -> None:
    f = write_gguf(tmp_path / "m.gguf")
    assert models.gguf_path(str(f)) == f
    assert models.gguf_path(str(tmp_path)) == f
    write_gguf(tmp_path / "n.gguf")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        models.gguf_path(str(tmp_path))  # two: which one the gateway serves is unknown
    (tmp_path / "hf").mkdir()
    with pytest.raises(ValueError, match="needs a GGUF model"):
        models.gguf_path(str(tmp_path / "hf"))


def test_gguf_path_defaults_to_the_embedded_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = SimpleNamespace(directory=tmp_path, gguf_file="SmolLM2.gguf")
    loader = SimpleNamespace(default_model_source=lambda: source)
    monkeypatch.setitem(sys.modules, "specgate.engine.loader", loader)
    assert models.gguf_path(None) == tmp_path / "SmolLM2.gguf"


def test_eog_ids_and_chat_template_come_from_the_file(tmp_path: Path) -> None:
    f = write_gguf(tmp_path / "m.gguf", template="{{ messages }}")
    assert models.eog_token_ids(f) == [0, 2]
    assert models.chat_template(f) == "{{ messages }}"
    assert models.chat_template(write_gguf(tmp_path / "n.gguf")) is None


def test_a_bench_model_name_resolves_to_its_cached_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = models.MODELS["qwen2.5-coder-0.5b"]
    monkeypatch.setenv("SPECGATE_BENCH_MODELS", str(tmp_path))
    target = tmp_path / spec.file_name
    target.write_bytes(b"\0" * 16)
    monkeypatch.setattr(models, "MODELS", {"tiny": models.SplitModel(spec.file_name, "p{}", 1, None, 16, "")})
    assert models.resolve("tiny") == str(target) and models.gguf_path("tiny") == target
    assert models.resolve("/some/path") == "/some/path" and models.resolve(None) is None
