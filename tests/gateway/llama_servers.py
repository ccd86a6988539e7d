"""llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`) in a subprocess, on the
embedded default model's GGUF file: the real third-party backend of the gateway's live tests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from specgate.engine.loader import default_model_source
from tests.gateway.live import free_port

ALIAS = "smollm2"  # the model name the server answers to

# `python -m llama_cpp.server`, with the model's weights left as the GGUF has them: llama.cpp's
# "extra buffer types" (use_extra_bufts, on by default and not a server setting) repack Q4_1 for
# AMX-INT8 where the CPU has it, and the AMX kernels multi-token batches then run die with SIGILL
# on such machines (seen with llama-cpp-python 0.3.36 on a Xeon with AMX-INT8). Without the
# repack, batches of several tokens run on the ordinary CPU kernels.
_NO_REPACK = """\
import runpy
import llama_cpp.llama_cpp as C
_defaults = C.llama_model_default_params
def _params():
    p = _defaults()
    p.use_extra_bufts = False
    return p
C.llama_model_default_params = _params
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


class LlamaServer:
    """llama-cpp-python's server in a subprocess on a fixed port; can be killed and started again.

    Defaults: the server as `python -m llama_cpp.server` starts it, one thread, prompts evaluated
    a token at a time. `repack=False` launches it with the weights' AMX repacking off (above), the
    only way multi-token batches (`n_batch` > 1) run on every CPU; `extra_args` go on its command
    line (e.g. a draft model)."""

    def __init__(
        self,
        log_dir: Path,
        *,
        name: str = "llama-server",
        alias: str = ALIAS,
        n_batch: int = 1,
        repack: bool = True,
        extra_args: Sequence[str] = (),
    ) -> None:
        source = default_model_source()
        assert source.gguf_file is not None
        self.gguf = source.directory / source.gguf_file
        self.port = free_port()
        self.log = log_dir / f"{name}.log"
        self.alias = alias
        self.n_batch = n_batch
        self.repack = repack
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 90.0) -> None:
        self.spawn()
        self.wait_ready(timeout)

    def spawn(self) -> None:
        launcher = ["-m", "llama_cpp.server"] if self.repack else ["-c", _NO_REPACK]
        cmd = [
            sys.executable,
            *launcher,
            "--model",
            str(self.gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model_alias",
            self.alias,
            "--n_threads",
            "1",
            "--n_ctx",
            "2048",
            # Prompts evaluated a token at a time by default: llama.cpp's batched CPU path, built for
            # this machine's units, segfaults on this GGUF's multi-token prompts on some CPUs (seen
            # with llama-cpp-python 0.3.36 on a Xeon with AMX-INT8); one token per decode never did,
            # and the prompts here are short. (`repack=False` is the way around it.)
            "--n_batch",
            str(self.n_batch),
            *self.extra_args,
        ]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 90.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited ({self.proc.returncode}): {self.tail()}")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"llama.cpp server did not come up: {self.tail()}")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
