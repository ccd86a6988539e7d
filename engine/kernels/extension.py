"""Building and loading the GGUF kernels (gguf_kernels.cpp, its headers), once per machine, torch and source.

The C++ files ship in the package and is compiled by the machine's own C++ compiler against the
installed torch the first time a GGUF model is served (about 20 s on two cores), into the kernel
cache (`$SPECGATE_KERNEL_CACHE`, default `~/.cache/specgate/kernels`); later starts load the
cached library at once. The library is named by a hash of the sources, the torch version, the
compiler and its flags, so an upgrade of either builds afresh and a stale build is never loaded.
One build runs at a time (a file lock), and a finished one is moved into place whole.

Where no compiler is found, the build fails, or `SPECGATE_KERNELS=off`, `load()` says why and
returns False: GGUF weights are then served by the older path (dequantized, plan.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("specgate.engine.kernels")
SOURCE = Path(__file__).with_name("gguf_kernels.cpp")
# Every file the translation unit includes: a change to any of them is a new build.
PARTS = (
    "gguf_kernels.cpp",
    "cpu_features.h",
    "gguf_blocks.h",
    "layer_math.h",
    "quantized_matmul.h",
    "attention.h",
    "decoder.h",
)
NAMESPACE = "specgate_gguf"

_state: dict[str, object] = {}


def cache_dir() -> Path:
    env = os.environ.get("SPECGATE_KERNEL_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("specgate")) / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _flags() -> list[str]:
    torch_dir = Path(torch.__file__).parent
    include = torch_dir / "include"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    return [
        "-O3",
        # No fused multiply-adds the source did not write: the fp32 reference paths in tests and the
        # kernels must round alike whatever the compiler chooses.
        "-ffp-contract=off",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fopenmp",
        "-Wno-c++20-extensions",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{include}",
        f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-L{torch_dir / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]


def _version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else compiler
    except (OSError, subprocess.SubprocessError):
        return compiler


def library_path(compiler: str) -> Path:
    """Where the build for this source, torch, Python and compiler lives."""
    digest = hashlib.sha256()
    sources = [(SOURCE.parent / name).read_bytes() for name in PARTS]
    for part in (*sources, torch.__version__.encode(), sys.version.encode(), _version(compiler).encode()):
        digest.update(part)
        digest.update(b"\x00")
    digest.update(" ".join(_flags()).encode())
    return cache_dir() / f"gguf_kernels-{digest.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same library
        if target.exists():
            return
        logger.warning("building the GGUF kernels for this machine (once, about 20 s)")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            cmd = [compiler, str(SOURCE), "-o", tmp, *_flags()]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if result.returncode != 0:
                raise RuntimeError(f"compiling {SOURCE.name} failed:\n{result.stderr[-4000:]}")
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def load() -> bool:
    """Make `torch.ops.specgate_gguf` available (building it if need be); False, with the reason
    logged once, where it cannot be."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    why = None
    if os.environ.get("SPECGATE_KERNELS", "").lower() in ("off", "0", "false", "no"):
        why = "SPECGATE_KERNELS=off"
    compiler = _compiler()
    if why is None and compiler is None:
        why = "no C++ compiler found (install g++)"
    if why is None:
        assert compiler is not None
        try:
            path = library_path(compiler)
            if not path.exists():
                _build(compiler, path)
            torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
            _register_fakes()
        except Exception as exc:
            why = f"{type(exc).__name__}: {str(exc).strip()[:2000]}"
    _state["loaded"] = why is None
    _state["why"] = why
    if why is not None:
        logger.warning("GGUF kernels unavailable, serving GGUF weights dequantized: %s", why)
    return why is None


def _register_fakes() -> None:
    """Shapes of the ops' outputs for torch.compile's tracing (it never runs the kernels to learn them)."""

    @torch.library.register_fake(f"{NAMESPACE}::qmatmul")  # type: ignore[untyped-decorator]
    def _qmatmul(
        x: torch.Tensor,
        weights: list[torch.Tensor],
        types: list[int],
        outs: list[int],
        in_features: int,
        biases: list[torch.Tensor],
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        gated: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], sum(outs))

    @torch.library.register_fake(f"{NAMESPACE}::paged_attend")  # type: ignore[untyped-decorator]
    def _paged_attend(
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        layer: int,
        kv_slots: torch.Tensor,
        start: int,
        q_index: torch.Tensor,
        mask: torch.Tensor | None,
        t: int,
        scale: float,
    ) -> torch.Tensor:
        return q.new_empty(kv_slots.shape[0] * t, q.shape[1], q.shape[2])

    @torch.library.register_fake(f"{NAMESPACE}::rope_store")  # type: ignore[untyped-decorator]
    def _rope_store(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> torch.Tensor:
        d = qkv.shape[1] // (heads + 2 * kv_heads)
        return qkv.new_empty(qkv.shape[0], heads, d, dtype=torch.float32)

    @torch.library.register_fake(f"{NAMESPACE}::dequantize_rows")  # type: ignore[untyped-decorator]
    def _dequantize_rows(
        w: torch.Tensor, type_id: int, in_features: int, rows: int, ids: torch.Tensor
    ) -> torch.Tensor:
        return w.new_empty(ids.numel(), in_features, dtype=torch.float32)


def unavailable_reason() -> str | None:
    """Why `load()` returned False (None if it did not, or was not called)."""
    why = _state.get("why")
    return why if isinstance(why, str) else None


def ops() -> Any:
    """The kernels' ops (`qmatmul`, `repack`, `dequantize_rows`, ...); `load()` must have returned True."""
    return getattr(torch.ops, NAMESPACE)


def isa_level() -> int:
    """0: portable C++, 1: AVX2, 2: AVX-512 VNNI (what this CPU runs)."""
    return int(torch.ops.specgate_gguf.isa_level())
