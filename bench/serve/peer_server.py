"""llama.cpp's own OpenAI-compatible server (llama-cpp-python) on the same GGUF file: the peer that
`specgate bench serve --peer llama-cpp` measures specgate against; and the processes of every server
a benchmark starts (`running`, `gateway_command`).

The server runs alone (the gateway is stopped first), is started with the same thread count, and
is stopped on every way out of the run: normal end, error, Ctrl-C, SIGTERM, and, through the
kernel's parent-death signal, even a SIGKILL of the harness.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

PEER = "llama.cpp"  # the arm's name in tables and in report.json

# Texts llama.cpp itself treats as end-of-generation when they are control tokens (llama-vocab.cpp);
# any of them ends a llama.cpp answer early, so all are banned when lengths must be equal.
EOG_TEXTS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>", "<EOT>"}
)
EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
CONTROL = 3  # gguf TokenType.CONTROL


def gguf_path(model: str | None) -> Path:
    """The GGUF file the gateway serves: --model when it names a .gguf (or a folder holding one),
    else the embedded default model's file."""
    if model is None:
        from specgate.engine.loader import default_model_source  # imports torch: only when needed

        src = default_model_source()
        if src.gguf_file is not None:
            return src.directory / src.gguf_file
    else:
        path = Path(model).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return path
        ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
        if len(ggufs) == 1:
            return ggufs[0]
    raise ValueError(f"--peer needs a GGUF model: {model!r} is not a .gguf file or a folder with one")


def eog_token_ids(gguf: Path) -> list[int]:
    """Ids that end a llama.cpp generation: the file's eos / eot / eom ids and control tokens
    with an end-of-generation text."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    ids = {int(fields[k].contents()) for k in EOG_KEYS if k in fields}
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in fields else []
    ids |= {i for i, (t, k) in enumerate(zip(tokens, types, strict=False)) if k == CONTROL and t in EOG_TEXTS}
    return sorted(ids)


def chat_template(gguf: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.chat_template")
    return None if field is None else str(field.contents())


def request_body(eog_ids: list[int]) -> dict[str, Any]:
    """Extra body fields for every peer request: end of generation banned when given (it then
    decodes exactly max_tokens, as specgate does with ignore_eos), and llama-cpp-python's sampling
    defaults that differ from OpenAI's (repeat_penalty 1.1, top_k 40, min_p 0.05) turned off."""
    body: dict[str, Any] = {"repeat_penalty": 1.0, "top_k": 0, "min_p": 0.0}
    if eog_ids:
        body["logit_bias"] = {str(i): -100.0 for i in eog_ids}
    return body


def command(gguf: Path, port: int, threads: int, alias: str, n_ctx: int = 4096) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        *("--model", str(gguf), "--model_alias", alias),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx)),
        # The default cuts a streaming answer short as soon as another request arrives: at
        # concurrency > 1 every answer but the last would end early.
        *("--interrupt_requests", "false"),
    ]


def gateway_command(
    port: int, options: dict[str, Any], extra: Sequence[str] = (), verbose: bool = False
) -> list[str]:
    """`specgate serve` on 127.0.0.1:`port` in a process of its own; `options` by name, those
    without a value left out; `verbose` logs how the model is served (-v)."""
    cmd = [sys.executable, "-m", "specgate.gateway.cli.main", *(["-v"] if verbose else []), "serve"]
    cmd += ["--port", str(port)]
    for name, value in options.items():
        if value:
            cmd += [f"--{name}", str(value)]
    return [*cmd, *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _libc_prctl() -> Any:
    try:
        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return None


# Looked up here, not in the forked child: dlopen there could wait on a lock another thread held.
_PRCTL = _libc_prctl()


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG (1): the kernel sends the server SIGTERM if the harness dies, even by
    # SIGKILL, so no server outlives a run.
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


@contextmanager
def running(
    cmd: list[str], log: Path, ready_url: str, timeout: float = 300.0, env: dict[str, str] | None = None
) -> Iterator[None]:
    """The server of `cmd`, ready (GET `ready_url` answers 200) for the body of the `with`; `env`
    replaces this process's environment for it."""
    main = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.getsignal(signal.SIGTERM)
    if main:  # SIGTERM's default action skips `finally`; as an exception it stops the server too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )
    try:
        _wait_ready(proc, ready_url, log, timeout)
        yield
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if main:
            signal.signal(signal.SIGTERM, previous)


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s; see {log}")
