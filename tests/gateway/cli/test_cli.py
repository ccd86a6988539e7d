"""`specgate generate` streams text from an engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgate.gateway.cli.main import build_parser, main
from specgate.gateway.cli.serve import serve_settings


def test_generate_streams_text_and_reports_stats(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "generate",
            "--model",
            str(tiny_llama_dir),
            "--raw",
            "--max-tokens",
            "12",
            "--dtype",
            "float32",
            "Hi",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0
    assert len(out.out.strip("\n")) > 0
    assert "tokens in" in out.err and "finish_reason=" in out.err


def test_generate_bad_model_path_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(tmp_path / "missing"), "hello"])
    assert rc == 2
    assert "error" in capsys.readouterr().err


def test_generate_with_speculation_reports_acceptance(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--model", str(tiny_llama_dir), "--raw", "--dtype", "float32", "--max-tokens", "30"]
    rc = main([*argv, "--spec", "ngram", "--spec-controller", "static", "Hi"])
    assert rc == 0
    assert "ngram:" in capsys.readouterr().err


def test_generate_unknown_speculation_method_is_a_clean_error(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["generate", "--model", str(tiny_llama_dir), "--raw", "--spec", "telepathy", "Hi"])
    assert rc == 2
    assert "unknown speculation method" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_runs_the_gateway_from_a_config_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx
    import openai

    from tests.gateway.live import free_port, wait_until_ready

    port = free_port()
    config = tmp_path / "specgate.toml"
    config.write_text(
        'api_keys = ["from-file"]\n'
        "refused_rpm = 6\n"  # one refusal per ten seconds
        "[embedded]\n"
        f'model = "{tiny_llama_dir}"\n'
        'served_model_name = "tiny"\n'
        'aliases = ["tiny-alias"]\n'
        "num_blocks = 128\n"
    )
    env = {**os.environ, "SPECGATE_EMBEDDED__DTYPE": "float32"}  # env vars override the file
    # Read here, in the supervisor; rendered in the worker, which never sees the file.
    template = tmp_path / "brackets.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}>")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specgate.gateway.cli.main",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--chat-template-file",
            str(template),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(url, time.monotonic() + 120)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="from-file", max_retries=0)
        assert sorted(m.id for m in client.models.list().data) == ["tiny", "tiny-alias"]
        r = client.chat.completions.create(
            model="tiny-alias", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert r.usage is not None and r.usage.completion_tokens == 3 and r.model == "tiny-alias"
        assert r.usage.prompt_tokens == len("[hi]>")  # one token a character: the file's template
        ready = httpx.get(f"{url}/readyz").json()
        assert ready["status"] == "ready"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        # X-Forwarded-For from a peer that is no configured proxy is the client's own claim: it
        # buys no fresh refusal budget (uvicorn would take it from any loopback peer).
        spoofed = httpx.get(
            f"{url}/v1/models", headers={"authorization": "Bearer wrong", "x-forwarded-for": "203.0.113.9"}
        )
        assert spoofed.status_code == 429, spoofed.text
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status tells what ended it.
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "from-file" not in out and "Traceback" not in out


def test_serve_refuses_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("backends:\n  - name: x\n    base_url: ftp://nowhere\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "base_url must start with http" in capsys.readouterr().err


def _serve(*argv: str) -> object:
    return serve_settings(build_parser().parse_args(["serve", *argv]))


def test_serve_prefix_cache_flags(tmp_path: Path) -> None:
    default = _serve().embedded  # type: ignore[attr-defined]
    assert default.prefix_caching is True and default.prefix_cache_bytes is None
    off = _serve("--no-prefix-caching").embedded  # type: ignore[attr-defined]
    assert off.prefix_caching is False
    for text, size in (
        ("1048576", 2**20),
        ("256M", 256 * 2**20),
        ("1GiB", 2**30),
        ("64kb", 64 * 2**10),
        ("0", 0),
    ):
        assert _serve("--prefix-cache-bytes", text).embedded.prefix_cache_bytes == size  # type: ignore[attr-defined]
    # A flag overrides the config file; a setting no flag names is kept.
    config = tmp_path / "c.toml"
    config.write_text('[embedded]\nprefix_caching = false\nprefix_cache_scope = "address"\n')
    both = _serve("--config", str(config), "--prefix-cache-bytes", "1M").embedded  # type: ignore[attr-defined]
    assert both.prefix_caching is False and both.prefix_cache_bytes == 2**20
    assert both.prefix_cache_scope == "address"
    assert both.engine_config().prefix_cache_bytes == 2**20


@pytest.mark.parametrize("value", ["-1", "lots", "1.5G", "", "²"])
def test_serve_refuses_a_bad_prefix_cache_size(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--prefix-cache-bytes", value])
    assert exit_.value.code == 2
    assert "--prefix-cache-bytes" in capsys.readouterr().err


def test_serve_deterministic_flag(tmp_path: Path) -> None:
    assert _serve().embedded.deterministic is False  # type: ignore[attr-defined]
    assert _serve("--deterministic").embedded.engine_config().deterministic is True  # type: ignore[attr-defined]
    config = tmp_path / "c.toml"
    config.write_text("[embedded]\ndeterministic = true\n")
    assert _serve("--config", str(config)).embedded.deterministic is True  # type: ignore[attr-defined]
    off = _serve("--config", str(config), "--no-deterministic").embedded  # type: ignore[attr-defined]
    assert off.deterministic is False


def test_serve_compile_flag(tmp_path: Path) -> None:
    assert _serve().embedded.compile_sizes == []  # type: ignore[attr-defined]
    assert _serve("--compile").embedded.engine_config().compile_sizes == (1, 2, 4, 8, 16)  # type: ignore[attr-defined]
    assert _serve("--compile", "4,1").embedded.engine_config().compile_sizes == (1, 4)  # type: ignore[attr-defined]
    config = tmp_path / "c.toml"
    config.write_text("[embedded]\ncompile_sizes = [1, 2]\n")
    assert _serve("--config", str(config)).embedded.compile_sizes == [1, 2]  # type: ignore[attr-defined]
    assert _serve("--config", str(config), "--compile", "off").embedded.compile_sizes == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", ["x", "0", "1,300", ",", "1;2"])
def test_serve_refuses_bad_compile_sizes(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--compile", value])
    assert exit_.value.code == 2
    assert "--compile" in capsys.readouterr().err


def test_serve_chat_template_flags(tmp_path: Path) -> None:
    assert _serve().embedded.chat_template is None  # type: ignore[attr-defined]
    assert _serve("--chat-template", "gemma").embedded.chat_template == "gemma"  # type: ignore[attr-defined]
    jinja = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert _serve("--chat-template", jinja).embedded.chat_template == jinja  # type: ignore[attr-defined]
    template = tmp_path / "t.jinja"
    template.write_text(jinja)
    assert _serve("--chat-template-file", str(template)).embedded.chat_template == jinja  # type: ignore[attr-defined]
    # A flag replaces the configured template, given by name or by file.
    config = tmp_path / "c.toml"
    config.write_text(f'[embedded]\nchat_template_file = "{template}"\n')
    assert _serve("--config", str(config)).embedded.chat_template == jinja  # type: ignore[attr-defined]
    assert _serve("--config", str(config), "--chat-template", "phi4").embedded.chat_template == "phi4"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            ["--chat-template", "chatlm"],
            "embedded.chat_template (--chat-template): 'chatlm' is not a built-in",
        ),
        (["--chat-template", "{% if %}"], "the Jinja template does not compile"),
        (["--chat-template-file", "/nonexistent/t.jinja"], "--chat-template-file): cannot read"),
    ],
)
def test_serve_refuses_a_bad_chat_template_before_starting(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specgate: error: ") and error in err and "Traceback" not in err


def test_serve_refuses_a_bad_configured_chat_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[embedded]\nchat_template = "llama-3"\n')
    assert main(["serve", "--config", str(config)]) == 2
    assert "'llama-3' is not a built-in template" in capsys.readouterr().err


def test_serve_takes_one_chat_template_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--chat-template", "chatml", "--chat-template-file", "t.jinja"])
    assert "not allowed with" in capsys.readouterr().err


def test_generate_renders_chat_with_the_given_template(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--model", str(tiny_llama_dir), "--dtype", "float32", "--max-tokens", "2"]
    assert main([*argv, "--chat-template", "nope", "Hi"]) == 2
    assert "'nope' is not a built-in template" in capsys.readouterr().err
    # The template from the file is the one rendered: this one says so by refusing.
    refusing = tmp_path / "refusing.jinja"
    refusing.write_text("{{ raise_exception('rendered from the file') }}{{ messages }}")
    with pytest.raises(Exception, match="rendered from the file"):
        main([*argv, "--chat-template-file", str(refusing), "Hi"])
    assert main([*argv, "--chat-template", "chatml", "Hi"]) == 0
    assert "tokens in" in capsys.readouterr().err
