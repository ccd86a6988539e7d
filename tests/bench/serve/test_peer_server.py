"""The llama.cpp peer's pure parts: its GGUF, its end-of-generation ids, its command line, and a
server process that never outlives the `with` (an ordinary HTTP server stands in for llama.cpp)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from gguf import GGUFWriter

from specgate.bench.serve import peer_server


def write_gguf(path: Path, template: str | None = None) -> Path:
    w = GGUFWriter(str(path), "llama")
    w.add_token_list(["<|endoftext|>", "a", "<|im_end|>", "</s>", "<|im_start|>"])
    w.add_token_types([3, 1, 3, 1, 3])  # "</s>" as a normal token is text, not an end
    w.add_eos_token_id(2)
    if template:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_path_takes_a_gguf_file_or_a_folder_with_one(tmp_path: Path) -> None:
    f = write_gguf(tmp_path / "m.gguf")
    assert peer_server.gguf_path(str(f)) == f
    assert peer_server.gguf_path(str(tmp_path)) == f
    write_gguf(tmp_path / "n.gguf")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        peer_server.gguf_path(str(tmp_path))  # two: which one the gateway serves is unknown
    (tmp_path / "hf").mkdir()
    with pytest.raises(ValueError, match="needs a GGUF model"):
        peer_server.gguf_path(str(tmp_path / "hf"))


def test_gguf_path_defaults_to_the_embedded_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = SimpleNamespace(directory=tmp_path, gguf_file="SmolLM2.gguf")
    loader = SimpleNamespace(default_model_source=lambda: source)
    monkeypatch.setitem(sys.modules, "specgate.engine.loader", loader)
    assert peer_server.gguf_path(None) == tmp_path / "SmolLM2.gguf"


def test_eog_ids_and_chat_template_come_from_the_file(tmp_path: Path) -> None:
    f = write_gguf(tmp_path / "m.gguf", template="{{ messages }}")
    assert peer_server.eog_token_ids(f) == [0, 2]
    assert peer_server.chat_template(f) == "{{ messages }}"
    assert peer_server.chat_template(write_gguf(tmp_path / "n.gguf")) is None


def test_request_body_bans_the_ends_and_llama_cpp_sampling_extras() -> None:
    body = peer_server.request_body([0, 2])
    assert body == {"repeat_penalty": 1.0, "top_k": 0, "min_p": 0.0, "logit_bias": {"0": -100.0, "2": -100.0}}
    assert "logit_bias" not in peer_server.request_body([])


def test_command_line() -> None:
    cmd = peer_server.command(Path("/m/x.gguf"), 8123, 2, "x")
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


def test_the_server_is_up_inside_and_gone_after_even_on_error(tmp_path: Path) -> None:
    port = peer_server.free_port()
    cmd = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(tmp_path)]
    url = f"http://127.0.0.1:{port}/"
    with pytest.raises(KeyError), peer_server.running(cmd, tmp_path / "log", url, timeout=20):
        assert httpx.get(url, timeout=2).status_code == 200
        raise KeyError("a failing run")
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=2)


def test_a_server_that_exits_fails_fast(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "raise SystemExit(3)"]
    with (
        pytest.raises(RuntimeError, match=r"exited \(3\)"),
        peer_server.running(cmd, tmp_path / "log", "http://127.0.0.1:9/", timeout=20),
    ):
        pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_server_outlives_a_killed_harness(tmp_path: Path, sig: signal.Signals) -> None:
    port = peer_server.free_port()
    harness = f"""
import sys, time
from pathlib import Path
from specgate.bench.serve import peer_server
cmd = [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1", "-d", {str(tmp_path)!r}]
with peer_server.running(cmd, Path({str(tmp_path / "log")!r}), "http://127.0.0.1:{port}/", timeout=20):
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


def test_the_gateway_command_names_only_the_options_given() -> None:
    cmd = peer_server.gateway_command(8123, {"model": Path("/m/x.gguf"), "dtype": None, "threads": 2}, ["-x"])
    assert cmd == [
        *(sys.executable, "-m", "specgate.gateway.cli.main", "serve", "--port", "8123"),
        *("--model", "/m/x.gguf", "--threads", "2", "-x"),
    ]
    assert peer_server.gateway_command(1, {}, verbose=True)[3:5] == ["-v", "serve"]
